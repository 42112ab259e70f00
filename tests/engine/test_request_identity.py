"""Request identity in the TokenizerManager: a rid reused right after its request was
abandoned (the client disconnected) gets its own outputs, never the abandoned request's abort;
a shutdown's aborts say so; an unknown rid aborts nothing. Also: the Engine is returned (the
server ready) only once the grammar compiler's child has imported; it takes SGLang's spelling
of the sampling parameters; shut down, it leaves no thread or child behind."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from proc_children import grammar_children

from srt_ascend import Engine
from srt_ascend.constrained import compile_worker
from srt_ascend.managers.io_struct import SERVER_SHUTTING_DOWN

ROUNDS = 8


@pytest.fixture(scope="module")
def engine(model_path):
    e = Engine(model_path=model_path, dtype="float32", max_total_tokens=4096)
    yield e
    e.shutdown()


def test_engine_is_ready_only_once_the_grammar_child_has_imported(engine):
    """Runs first, right after the Engine returned. The child importing xgrammar (seconds of
    CPU) after the Engine reported ready made the first ~140 decode steps 2-25x slower on 2
    cores; now the Engine waits for its "started" handshake."""
    assert engine.tokenizer_manager.grammars.wait_started(0)
    children = grammar_children()
    assert len(children) == 1, children
    with open(f"/proc/{children[0]}/maps") as f:
        assert "libxgrammar_bindings" in f.read()  # its import is done


def _run(engine: Engine, coro):
    return asyncio.run_coroutine_threadsafe(coro, engine.loop).result(timeout=300)


async def _last(tm, req) -> dict:
    last = None
    async for out in tm.generate_one(req):
        last = out
    return last


def test_a_rid_reused_after_a_disconnect_gets_its_own_outputs(engine):
    """The first request streams a token, then its client leaves (the iterator closes: its
    abort is sent); a new request with the same rid starts at once, before the scheduler
    has handled that abort. The old code routed the abort's finish (by rid) to the new
    request, which ended at once with finish_reason abort and the old prompt's length."""
    tm = engine.tokenizer_manager
    old_ids = tm.tokenize("def fibonacci(n):\n    " * 4)
    new_ids = tm.tokenize("import os\n")

    async def race(i: int) -> dict:
        rid = f"reused-{i}"
        old = tm.make_request(
            old_ids, {"max_new_tokens": 200, "ignore_eos": True}, rid=rid, stream=True
        )
        gen = tm.generate_one(old)
        await gen.__anext__()  # the first token: the old request is running
        await gen.aclose()  # its client leaves
        new = tm.make_request(new_ids, {"max_new_tokens": 3, "temperature": 0}, rid=rid)
        return await _last(tm, new)

    for i in range(ROUNDS):
        meta = _run(engine, race(i))["meta_info"]
        assert meta["finish_reason"]["type"] == "length", (i, meta)
        assert meta["prompt_tokens"] == len(new_ids) and meta["completion_tokens"] == 3
        assert meta["id"] == f"reused-{i}"
    assert _run(engine, tm.internal_state())["num_running_reqs"] == 0


def test_abort_by_rid_and_the_shutdown_message(engine):
    tm = engine.tokenizer_manager
    ids = tm.tokenize("class Stack:\n")

    async def abort_while_running(message: str | None) -> dict:
        req = tm.make_request(
            ids, {"max_new_tokens": 500, "ignore_eos": True}, rid="victim", stream=True
        )
        gen = tm.generate_one(req)
        await gen.__anext__()
        tm.abort("no-such-rid")  # aborts nothing
        if message is None:
            tm.abort("victim")
        else:
            tm.abort("", message)
        last = None
        async for out in gen:
            last = out
        return last["meta_info"]

    meta = _run(engine, abort_while_running(None))
    assert meta["finish_reason"] == {"type": "abort", "message": "aborted by the client"}
    assert meta["completion_tokens"] < 500
    meta = _run(engine, abort_while_running(SERVER_SHUTTING_DOWN))
    assert meta["finish_reason"]["message"] == SERVER_SHUTTING_DOWN


def test_a_shut_down_engine_leaves_no_thread_or_child(model_path):
    """Engines started and shut down one after another in a process (notebooks, test suites)
    must not pile up: every thread an Engine started has ended after `shutdown` (the grammar
    lanes' threads outlived it, two per Engine), and of its grammar children at most one is
    left, idle, which the next Engine takes instead of importing xgrammar anew."""
    threads_before = {t.ident for t in threading.enumerate()}
    children_before = set(grammar_children())
    kept = None
    for _ in range(2):
        e = Engine(
            model_path=model_path, dtype="float32", max_total_tokens=1024, disable_cuda_graph=True
        )
        if kept is not None:  # the one left by the Engine before, taken
            assert e.tokenizer_manager.grammars._small._child[0].pid == kept
        e.generate("def f(", {"max_new_tokens": 2, "temperature": 0})
        e.generate("def f(", {"max_new_tokens": 2, "temperature": 0, "regex": "[a-z]+"})
        assert set(grammar_children()) - children_before
        e.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            # tqdm's monitor thread belongs to tqdm (started by the first progress bar, shared)
            left = [
                t.name
                for t in threading.enumerate()
                if t.ident not in threads_before and t.name != "tqdm_monitor"
            ]
            if not left:
                break
            time.sleep(0.1)
        assert not left, left
        children = set(grammar_children()) - children_before
        assert len(children) <= 1, children
        assert e.loop.is_closed()
        kept = compile_worker._spare[0].pid
        assert children <= {kept}


def test_engine_takes_sglang_sampling_parameter_names(engine):
    """sglang.Engine's callers pass `sampling_seed` (SGLang's name for the seed) and nulls
    for unset fields; /generate took them, Engine.generate refused them."""
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "top_k": None}
    seeded = engine.generate("def f(", {**sp, "seed": 1234})["output_ids"]
    assert engine.generate("def f(", {**sp, "sampling_seed": 1234})["output_ids"] == seeded
    assert engine.generate("def f(", {**sp, "seed": 4321})["output_ids"] != seeded
    with pytest.raises(ValueError, match="beam_width"):
        engine.generate("def f(", {**sp, "beam_width": 2})


def test_engine_streams_and_awaits_as_sglang_engine(engine):
    """sglang.Engine's calls: `stream=True` yields every step (cumulative text, the last
    one the whole answer), `async_generate` from the caller's own event loop, `rid` and
    `cache_salt`, and logprob entries as [logprob, token_id, None]."""
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = engine.generate("def f(", sp, return_logprob=True, top_logprobs_num=2)
    meta = whole["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == whole["output_ids"]
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])
    assert all(len(top) == 2 and len(top[0]) == 3 for top in meta["output_top_logprobs"])
    steps = list(engine.generate("def f(", sp, stream=True, rid="streamed"))
    assert len(steps) > 1 and steps[-1]["output_ids"] == whole["output_ids"]
    assert steps[-1]["text"] == whole["text"] and steps[-1]["meta_info"]["id"] == "streamed"
    assert all(a["text"] == b["text"][: len(a["text"])] for a, b in zip(steps, steps[1:]))
    batch = list(engine.generate(["def f(", "x ="], sp, stream=True))
    assert {s["index"] for s in batch} == {0, 1}
    last = {s["index"]: s for s in batch}
    assert last[0]["output_ids"] == whole["output_ids"]

    async def main():
        out = await engine.async_generate("def f(", sp, cache_salt="tenant-a")
        chunks = [c async for c in await engine.async_generate("def f(", sp, stream=True)]
        return out, chunks

    out, chunks = asyncio.run(main())
    assert out["output_ids"] == chunks[-1]["output_ids"] == whole["output_ids"]
    assert out["meta_info"]["cached_tokens"] == 0  # another tenant's prefix is not shared


def test_engine_stream_left_early_aborts_its_request(engine):
    """Leaving a streamed generation early aborts it: it stops within a few steps of 400
    (the prefix cache takes what it had: far fewer tokens than the whole answer)."""
    sp = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    prompt = "def left_early("
    before = engine.get_internal_state()["cached_tokens_in_tree"]
    stream = engine.generate(prompt, sp, stream=True)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 60
    while engine.get_internal_state()["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = engine.get_internal_state()
    assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0, state
    assert state["cached_tokens_in_tree"] - before < 200, (before, state)


def test_engine_async_stream_cancelled_mid_step_is_cancelled(engine):
    """A task iterating `async_generate(stream=True)` over several generations, cancelled
    while it waits for a step (asyncio.wait_for, a web handler whose client left), ends
    cancelled and its requests are aborted. The stream closed its generator while the
    Engine's loop was still running the cancelled step: the task raised RuntimeError
    ("aclose(): asynchronous generator is already running") instead."""
    sp = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def cancel_mid_step() -> str:
        first = asyncio.Event()

        async def consume():
            async for _ in await engine.async_generate(["def a(", "def b("], sp, stream=True):
                first.set()  # then at once waits for the next step (the tokens keep coming)

        task = asyncio.ensure_future(consume())
        await first.wait()
        await asyncio.sleep(0.1)  # the Engine's loop is in the middle of a step by now
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        except RuntimeError as e:
            return repr(e)
        return "finished"

    for _ in range(3):  # a cancel between two steps did not show it
        assert asyncio.run(cancel_mid_step()) == "cancelled"
        deadline = time.monotonic() + 60
        while engine.get_internal_state()["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.get_internal_state()["num_running_reqs"] == 0


def test_engine_generate_that_fails_leaves_no_request_running(engine):
    """One generation of a `generate` call refused (its rid is running already) fails the
    call, and the call's other generations are aborted with it: they ran on to
    max_new_tokens, unseen. A rid given twice in one call is refused before any runs."""
    sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}

    def running() -> int:
        state = engine.get_internal_state()
        return state["num_running_reqs"] + state["num_queue_reqs"]

    busy = engine.generate("def busy(", {**sp, "max_new_tokens": 400}, stream=True, rid="busy")
    next(busy)
    with pytest.raises(ValueError, match="duplicate request id 'busy'"):
        engine.generate(["def a(", "def b("], sp, rid=["other", "busy"])
    busy.close()
    deadline = time.monotonic() + 5  # a few steps; 1500 tokens take far longer
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0
    with pytest.raises(ValueError, match="request ids in one batch must be distinct"):
        engine.generate(["def a(", "def b("], sp, rid=["twice", "twice"])
    assert running() == 0


def test_closing_serving_stream_all_aborts_its_requests_at_once(engine):
    """`Serving.stream_all` (/generate's and the OpenAI routes' streams) closed early aborts
    its requests before `aclose` returns, one stream or several: the stream it iterates
    (`merge_streams`) was left open for the garbage collector's finalizer to close later."""
    from srt_ascend.entrypoints.serving import Serving

    sp = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    serving = Serving(engine.tokenizer_manager, engine.server_args)
    ids = engine.tokenizer_manager.tokenize("def closed_early(")

    async def close_after_one_output(rids: list[str]) -> list[bool]:
        gen = serving.stream_all([serving.make_request(ids, sp, rid=r) for r in rids])
        await gen.__anext__()
        await gen.aclose()
        return [engine.tokenizer_manager.has_request(r) for r in rids]

    assert _run(engine, close_after_one_output(["one"])) == [False]
    assert _run(engine, close_after_one_output(["two-a", "two-b"])) == [False, False]
