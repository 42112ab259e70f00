"""Compiles request grammars (xgrammar, or llguidance with --grammar-backend llguidance; see
compilers.py), off the caller's thread, once per grammar.

`GrammarBackend.compile((kind, source))` returns a Future of the CompiledGrammar; the futures
are cached by (kind, source), so concurrent requests with one schema share one compile and
later ones get it at once. A grammar that does not compile fails its future with GrammarError
carrying xgrammar's message (failures are cached too: the same source fails the same way).
The cache is bounded in entries and in the compiled grammars' memory (CACHE_BYTES).

Limits (GrammarOptions): a source longer than `max_size` characters is refused before it
compiles; a compile running past `compile_timeout` seconds is stopped (its child process is
killed, see compile_worker) and refused. Sources up to SMALL_SOURCE characters compile in one
lane and longer ones in another, so a small grammar never waits behind a large one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import xgrammar as xgr

from srt_ascend.constrained.compile_worker import CompileLane, GrammarError, JsonWhitespace
from srt_ascend.constrained.compilers import COMPILERS

CompiledGrammar = xgr.CompiledGrammar

# The cache keeps the futures of at most this many distinct grammars, whose compiled grammars
# take at most CACHE_BYTES together (least recently used dropped first; the newest is kept).
CACHE_ENTRIES = 1024
CACHE_BYTES = 1 << 30
# Sources up to this many characters compile in the small lane, longer ones in the large lane.
SMALL_SOURCE = 8192


@dataclass(frozen=True)
class GrammarOptions:
    """What the compiler allows: JSON whitespace, and the limits on one grammar."""

    json_any_whitespace: bool = True  # False: compact JSON
    json_max_whitespace: int | None = None  # most consecutive whitespace chars; None: unbounded
    compile_timeout: float | None = None  # seconds one compile may run; None: no bound
    max_size: int | None = None  # most characters in a source; None: no bound
    backend: str = "xgrammar"  # the grammar library (compilers.COMPILERS, --grammar-backend)

    @classmethod
    def from_args(cls, args, bounded: bool = True) -> GrammarOptions:
        """From ServerArgs' constrained-generation flags. `bounded` False drops the limits
        (ranks that compile grammars the leader already accepted)."""
        return cls(
            json_any_whitespace=not args.constrained_json_disable_any_whitespace,
            json_max_whitespace=args.constrained_json_max_whitespace_cnt or None,
            compile_timeout=args.grammar_compile_timeout if bounded else None,
            max_size=args.grammar_max_size if bounded else None,
            backend=args.grammar_backend,
        )


class GrammarBackend:
    """The compiler for one tokenizer; thread-safe. Owns two child processes (the lanes)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        options: GrammarOptions | None = None,
    ) -> None:
        """`tokenizer`: the checkpoint's Hugging Face tokenizer; `vocab_size`: the model's (the
        logits' width, which may exceed the tokenizer's); `stop_token_ids`: the tokens that end
        generation (EOS), which a grammar allows once it is complete."""
        self.vocab_size = vocab_size
        self.options = options = options or GrammarOptions()
        compiler = COMPILERS[options.backend].for_tokenizer(tokenizer, vocab_size, stop_token_ids)
        ws = JsonWhitespace(options.json_any_whitespace, options.json_max_whitespace)
        self._small = CompileLane(compiler, ws, options.compile_timeout, "small")
        self._large = CompileLane(compiler, ws, options.compile_timeout, "large")
        self._small.start()  # the large lane's child starts at its first grammar
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._bytes: dict[tuple[str, str], int] = {}  # compiled sizes of cached grammars
        self._lock = threading.RLock()  # RLock: a done future's callback runs at once

    def wait_started(self, timeout: float) -> bool:
        """Waits at most `timeout` seconds for the small lane's child, started with the
        backend, to finish importing (CompileLane.wait_started); False if it did not."""
        return self._small.wait_started(timeout)

    def compile(self, spec: tuple[str, str]) -> Future:
        """Future of the CompiledGrammar for (kind, source); GrammarError if it does not
        compile, is longer than `max_size` (at once) or compiles longer than the timeout."""
        kind, source = spec
        limit = self.options.max_size
        if limit is not None and len(source) > limit:
            fut: Future = Future()
            fut.set_exception(
                GrammarError(
                    f"{kind} is {len(source)} characters; the limit is --grammar-max-size {limit}"
                )
            )
            return fut
        with self._lock:
            fut = self._cache.get(spec)
            if fut is None:
                lane = self._small if len(source) <= SMALL_SOURCE else self._large
                fut = self._cache[spec] = lane.submit(kind, source)
                fut.add_done_callback(lambda f: self._account(spec, f))
            self._cache.move_to_end(spec)
            self._evict()
            return fut

    def _account(self, spec: tuple[str, str], fut: Future) -> None:
        """Counts a compiled grammar's memory against CACHE_BYTES."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            if self._cache.get(spec) is fut:
                self._bytes[spec] = fut.result().memory_size_bytes
                self._evict()

    def _evict(self) -> None:
        while len(self._cache) > 1 and (
            len(self._cache) > CACHE_ENTRIES or sum(self._bytes.values()) > CACHE_BYTES
        ):
            spec, _ = self._cache.popitem(last=False)
            self._bytes.pop(spec, None)

    def shutdown(self) -> None:
        """Stops both lanes' children; compiles not finished fail (GrammarError)."""
        self._small.close()
        self._large.close()


__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarOptions"]
