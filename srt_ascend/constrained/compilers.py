"""The grammar libraries behind --grammar-backend, registered by name (`COMPILERS`).

Each backend has two halves. The parent half (`XGrammarCompiler`, `LLGuidanceCompiler`) is
built by GrammarBackend for a tokenizer: `setup()` is the picklable object a compile lane
sends its child, and `load(payload)` turns the child's answer into the compiled grammar the
per-request matchers start from (matcher.Grammar). The child half (`XGrammarSetup`,
`LLGuidanceSetup`) is built in the child from that setup (`build(ws)`), and compiles
(kind, source) into a payload string or raises GrammarError with the library's message.

xgrammar compiles in the child (the payload is its serialized CompiledGrammar). llguidance
needs no compile step: the child turns the source into llguidance's grammar and validates it
(tokenizer-free; the killable, time-bounded part), and the parent builds one matcher for it
(its lexer: GIL released) that each request deep-copies. llguidance serves regex, JSON schema
and EBNF (GBNF or Lark); SGLang's structural tags are xgrammar's only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from srt_ascend.constrained.compile_worker import (
    GrammarError,
    JsonWhitespace,
    compile_grammar,
)

# ---- xgrammar ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class XGrammarSetup:
    """What a child needs to compile with xgrammar: the tokenizer info as JSON."""

    info_json: str

    def build(self, ws: JsonWhitespace) -> _XGrammarChild:
        info = xgr.TokenizerInfo.deserialize_json(self.info_json)
        return _XGrammarChild(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), ws)


@dataclass
class _XGrammarChild:
    compiler: xgr.GrammarCompiler
    ws: JsonWhitespace

    def compile(self, kind: str, source: str) -> str:
        return compile_grammar(self.compiler, kind, source, self.ws).serialize_json()


class XGrammarCompiler:
    name = "xgrammar"

    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.info = info

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        """For a Hugging Face tokenizer, the model's vocabulary size (the logits' width) and
        the tokens that end generation (every backend is built this way)."""
        return cls(
            xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
            )
        )

    def setup(self) -> XGrammarSetup:
        return XGrammarSetup(self.info.serialize_json())

    def load(self, payload: str) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(payload, self.info)


# ---- llguidance -------------------------------------------------------------------------------

LLGUIDANCE_KINDS = ("json_schema", "regex", "ebnf")


def llguidance_grammar(kind: str, source: str, ws: JsonWhitespace) -> str:
    """llguidance's grammar for (kind, source), validated; GrammarError with llguidance's
    message for one it refuses (structural tags included: not served by llguidance)."""
    import llguidance

    if kind not in LLGUIDANCE_KINDS:
        raise GrammarError(
            f"{kind} is not served by --grammar-backend llguidance (it serves "
            f"{', '.join(LLGUIDANCE_KINDS)}; xgrammar serves structural tags)"
        )
    try:
        if kind == "json_schema":
            # compact JSON is xgrammar's: one space after "," and ":" (SGLang's json_schema)
            options: dict[str, Any] = {"whitespace_flexible": ws.any_whitespace}
            if not ws.any_whitespace:
                options |= {"item_separator": ", ", "key_separator": ": "}
            elif ws.max_count is not None:
                options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{ws.max_count}}}"
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=options)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            grammar = llguidance.grammar_from("ebnf", source)
    except (ValueError, TypeError, RuntimeError) as e:  # a source that does not parse
        raise GrammarError(f"invalid {kind}: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {kind}: {error.strip()}")
    return grammar


@dataclass(frozen=True)
class LLGuidanceSetup:
    """What a child needs to check grammars for llguidance: nothing but the whitespace rule."""

    def build(self, ws: JsonWhitespace) -> _LLGuidanceChild:
        import llguidance  # noqa: F401 - imported before the child says "started"

        return _LLGuidanceChild(ws)


@dataclass
class _LLGuidanceChild:
    ws: JsonWhitespace

    def compile(self, kind: str, source: str) -> str:
        return llguidance_grammar(kind, source, self.ws)


@dataclass
class LLGuidanceGrammar:
    """A grammar for llguidance: a matcher at its start, which each request deep-copies."""

    matcher: Any  # llguidance.LLMatcher, never advanced
    stop_token_ids: list[int]
    memory_size_bytes: int  # the grammar's size, counted against the cache's bound


class LLGuidanceCompiler:
    name = "llguidance"

    def __init__(self, tokenizer, stop_token_ids: list[int]) -> None:
        """`tokenizer`: llguidance's LLTokenizer."""
        self.tokenizer, self.stop_token_ids = tokenizer, list(stop_token_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import llguidance.hf

        ids = list(stop_token_ids)
        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=ids), ids)

    def setup(self) -> LLGuidanceSetup:
        return LLGuidanceSetup()

    def load(self, payload: str) -> LLGuidanceGrammar:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, payload, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return LLGuidanceGrammar(matcher, self.stop_token_ids, len(payload))


COMPILERS = {c.name: c for c in (XGrammarCompiler, LLGuidanceCompiler)}
