"""Compiles request grammars with xgrammar, off the caller's thread, once per grammar.

`GrammarBackend.compile((kind, source))` returns a Future of the CompiledGrammar; compiles run
in a small thread pool and the futures are cached by (kind, source), so concurrent requests
with one schema share one compile and later ones get it at once. A grammar that does not
compile fails its future with GrammarError carrying xgrammar's message (failures are cached
too: the same source fails the same way).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

CompiledGrammar = xgr.CompiledGrammar

# The cache keeps the futures of this many distinct grammars (least recently used dropped).
CACHE_ENTRIES = 1024
# xgrammar prefixes messages with "[time] file.cc:line: " and sometimes "Check failed: (...)
# is false: "; users get the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A grammar that xgrammar cannot compile; the message is xgrammar's."""


class GrammarBackend:
    """The compiler for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        json_any_whitespace: bool = True,
        threads: int = 2,
    ) -> None:
        """`tokenizer`: the checkpoint's Hugging Face tokenizer; `vocab_size`: the model's (the
        logits' width, which may exceed the tokenizer's); `stop_token_ids`: the tokens that end
        generation (EOS), which a grammar allows once it is complete; `json_any_whitespace`:
        JSON schemas allow any whitespace between JSON tokens (else compact JSON)."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self.json_any_whitespace = json_any_whitespace
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: tuple[str, str]) -> Future:
        """Future of the CompiledGrammar for (kind, source); GrammarError if it fails."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is None:
                fut = self._cache[spec] = self._pool.submit(self._compile, *spec)
                if len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec)
            return fut

    def _compile(self, kind: str, source: str) -> CompiledGrammar:
        c = self._compiler
        compilers = {  # SGLang's sampling-parameter name -> xgrammar's compiler
            "json_schema": lambda s: c.compile_json_schema(
                s, any_whitespace=self.json_any_whitespace
            ),
            "regex": c.compile_regex,
            "ebnf": c.compile_grammar,
            "structural_tag": c.compile_structural_tag,
        }
        if kind not in compilers:
            raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(compilers)}")
        try:
            return compilers[kind](source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"invalid {kind}: {_XGR_PREFIX.sub('', str(e)).strip()}") from e

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
