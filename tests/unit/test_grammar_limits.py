"""Grammar compile limits, for both grammar backends: a source over --grammar-max-size is
refused at once with a message naming the flag; a compile past --grammar-compile-timeout is
stopped and refused; a small grammar does not queue behind a large one that compiles for ever
(its child stopped), and the large lane recovers; and JSON schemas bound runs of whitespace
(--constrained-json-max-whitespace-cnt, 16 by default)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import xgrammar as xgr
from proc_children import grammar_children
from transformers import AutoTokenizer

from srt_ascend.constrained import (
    Grammar,
    GrammarBackend,
    GrammarError,
    GrammarOptions,
    grammar_backend,
)
from srt_ascend.constrained.grammar_backend import SMALL_SOURCE
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs

VOCAB = 8192
EOS = 1
TIMEOUT = 4.0  # seconds a compile may run in these tests
LARGE = 2000  # enum values: a source past SMALL_SOURCE characters, for the large lane


def enum_schema(n: int, tag: str) -> str:
    """A JSON-schema string enum of n values (compiles in under a second at LARGE)."""
    return json.dumps({"type": "string", "enum": [f"{tag}{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)


BACKENDS = ["xgrammar", "llguidance"]  # --grammar-backend: the same lanes and bounds


@pytest.mark.parametrize("name", BACKENDS)
def test_oversized_grammar_is_refused_before_compiling(tokenizer, name):
    options = GrammarOptions(max_size=1000, backend=name)
    backend = GrammarBackend(tokenizer, VOCAB, [EOS], options)
    try:
        started = time.monotonic()
        with pytest.raises(GrammarError) as e:
            backend.compile(("json_schema", enum_schema(200, "v"))).result(timeout=5)
        assert "the limit is --grammar-max-size 1000" in str(e.value)
        assert time.monotonic() - started < 1.0
        assert backend.compile(("regex", "[ab]{3}")).result(timeout=120) is not None
    finally:
        backend.shutdown()


@pytest.mark.parametrize("name", BACKENDS)
def test_grammar_storm_small_grammar_does_not_wait_and_large_ones_stop(tokenizer, name):
    """A large grammar that compiles for ever: the large lane's child is stopped (SIGSTOP)
    before it is given one, so its compile runs past the timeout on any machine (a grammar
    merely big enough to be slow compiled in time on a faster one). A small grammar sent
    meanwhile compiles at once in its own lane; the stuck compile fails with the timeout's
    message after TIMEOUT s, its child killed, and the grammar queued behind it compiles on
    the fresh child that replaces it."""
    options = GrammarOptions(compile_timeout=TIMEOUT, backend=name)
    backend = GrammarBackend(tokenizer, VOCAB, [EOS], options)
    try:
        backend.compile(("regex", "x+")).result(timeout=120)  # the small lane's child is up
        before = set(grammar_children())
        warm = ("json_schema", enum_schema(LARGE, "w"))
        assert len(warm[1]) > SMALL_SOURCE  # compiled in the large lane
        assert backend.compile(warm).result(timeout=120)  # the large lane's child is up
        (stuck,) = set(grammar_children()) - before
        os.kill(stuck, signal.SIGSTOP)
        large = [backend.compile(("json_schema", enum_schema(LARGE, t))) for t in "ab"]
        time.sleep(0.5)  # the first is sent to the stopped child, the second queued
        started = time.monotonic()
        small = backend.compile(("regex", "[0-9]{3}-[a-z]+")).result(timeout=TIMEOUT)
        assert small is not None
        assert time.monotonic() - started < TIMEOUT  # not behind the large lane
        with pytest.raises(GrammarError) as e:
            large[0].result(timeout=120)
        assert f"did not compile within --grammar-compile-timeout {TIMEOUT}" in str(e.value)
        assert stuck not in grammar_children()  # killed and reaped
        assert large[1].result(timeout=120)  # on the child that replaced it
    finally:
        backend.shutdown()


def test_json_whitespace_runs_are_bounded(tokenizer):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    bounded = GrammarBackend(tokenizer, VOCAB, [EOS], GrammarOptions(json_max_whitespace=4))
    unbounded = GrammarBackend(tokenizer, VOCAB, [EOS], GrammarOptions())
    try:
        for backend, longest in ((bounded, 4), (unbounded, 64)):
            compiled = backend.compile(("json_schema", schema)).result(timeout=120)
            for n in (1, longest):
                m = xgr.GrammarMatcher(compiled)
                assert m.accept_string("{" + "\n" + " " * (n - 1) + '"a": 1}'), n
            m = xgr.GrammarMatcher(compiled)
            assert m.accept_string("{" + " " * longest)
            assert not m.accept_string(" ") if backend is bounded else m.accept_string(" ")
    finally:
        bounded.shutdown()
        unbounded.shutdown()


def test_llguidance_json_whitespace_runs_are_bounded(tokenizer):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    options = GrammarOptions(json_max_whitespace=4, backend="llguidance")
    backend = GrammarBackend(tokenizer, VOCAB, [EOS], options)
    try:
        compiled = backend.compile(("json_schema", schema)).result(timeout=120)
        for n, ok in ((1, True), (4, True), (5, False)):
            g = Grammar(compiled)
            ids = tokenizer.encode("{" + " " * n + '"a": 1}', add_special_tokens=False)
            assert all(g.accept(t) for t in ids) is ok, n
    finally:
        backend.shutdown()


def test_options_from_server_args():
    args = ServerArgs()
    assert args.constrained_json_max_whitespace_cnt == 16  # bounded by default
    opts = GrammarOptions.from_args(args)
    assert (opts.json_any_whitespace, opts.json_max_whitespace) == (True, 16)
    assert (opts.compile_timeout, opts.max_size) == (30.0, 131072)
    assert GrammarOptions.from_args(args, bounded=False).compile_timeout is None
    unbounded = dataclasses.replace(args, constrained_json_max_whitespace_cnt=0)
    assert GrammarOptions.from_args(unbounded).json_max_whitespace is None
    assert opts.backend == "xgrammar"
    llg = ServerArgs(grammar_backend="llguidance")
    assert GrammarOptions.from_args(llg).backend == "llguidance"
    with pytest.raises(ValueError, match="accepted: xgrammar, llguidance"):
        ServerArgs(grammar_backend="outlines")


def test_cache_is_bounded_by_compiled_bytes(tokenizer, monkeypatch):
    monkeypatch.setattr(grammar_backend, "CACHE_BYTES", 12_000)  # about two small regexes
    backend = GrammarBackend(tokenizer, VOCAB, [EOS])
    try:
        specs = [("regex", f"[0-9]{{3}}-[a-z]+{i}") for i in range(4)]
        first = backend.compile(specs[0])
        assert first.result(timeout=120).memory_size_bytes > 4000
        for spec in specs[1:]:
            backend.compile(spec).result(timeout=120)
        assert backend.compile(specs[-1]).done()  # the newest is kept
        assert backend.compile(specs[0]) is not first  # the oldest was dropped: compiled anew
    finally:
        backend.shutdown()
