"""Grammar-constrained generation (regex, JSON schema, EBNF, structural tag) on xgrammar or
llguidance (compilers.py): compilation with a cache (GrammarBackend), per-request matchers and
token bitmasks."""

from srt_ascend.constrained.grammar_backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarOptions,
)
from srt_ascend.constrained.matcher import (
    Grammar,
    apply_token_bitmask,
    fill_grammar_bitmask,
)

__all__ = [
    "CompiledGrammar",
    "Grammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarOptions",
    "apply_token_bitmask",
    "fill_grammar_bitmask",
]
