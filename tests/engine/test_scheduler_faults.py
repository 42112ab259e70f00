"""Scheduling limits and faults around the step: a failed step spares the requests it had
retracted, the decode batch stays within --max-running-requests while a prefill is chunked,
and a fault while handling a message (not in a step) is contained: the request it concerns
ends with an abort finish and the scheduler keeps serving."""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from srt_ascend import Engine
from srt_ascend.model_executor.forward_batch import ForwardMode

MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def _engine(model_path, **kw) -> Engine:
    return Engine(model_path=model_path, dtype="float32", num_threads=2, **kw)


def test_a_failed_step_keeps_the_requests_it_retracted(model_path):
    """The pool holds fewer tokens than the batch needs, so decode steps retract; the first
    decode forward after a retraction raises. The retracted request was back in the queue
    and never ran in that step: it must finish normally, as in the clean run."""
    engine = _engine(model_path, max_total_tokens=160, chunked_prefill_size=32)
    try:
        sched = engine.tokenizer_manager.scheduler
        clean = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        assert engine.get_internal_state()["num_retractions"] > 0
        retracted: list[str] = []
        real_retract, real_forward = sched.kv.retract, sched.runner._run

        def retract(victim, staying):
            real_retract(victim, staying)
            retracted.append(victim.rid)

        def forward(fb, *args, **kwargs):
            if retracted and fb.forward_mode == ForwardMode.DECODE and not fired:
                fired.append(True)
                raise RuntimeError("injected fault after a retraction")
            return real_forward(fb, *args, **kwargs)

        fired: list[bool] = []
        sched.kv.retract, sched.runner._run = retract, forward  # under forward and forward_logits
        try:
            outs = engine.generate(PROMPTS, GREEDY)
        finally:
            sched.kv.retract, sched.runner._run = real_retract, real_forward
        assert fired and retracted
        tm_rids = [o["meta_info"]["id"] for o in outs]
        # the scheduler knows a submission as "<rid>#<n>" (tokenizer_manager)
        victim = tm_rids.index(retracted[0].rsplit("#", 1)[0])
        assert outs[victim]["meta_info"]["finish_reason"]["type"] == "length", outs[victim]
        assert outs[victim]["output_ids"] == clean[victim]
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        assert "abort" in reasons  # the step's other requests did fail
        assert sched.idle_invariant_problem() is None
    finally:
        engine.shutdown()


def test_running_batch_stays_within_max_running_requests(model_path):
    """Short and long prompts with --max-running-requests 2 and small prefill chunks: a
    request whose last chunk runs beside a new one must not make the decode batch 3."""
    engine = _engine(model_path, max_running_requests=2, chunked_prefill_size=16)
    try:
        sched = engine.tokenizer_manager.scheduler
        sizes: list[int] = []
        real_step = sched.decoder.step

        def step(reqs):
            sizes.append(len(reqs))
            return real_step(reqs)

        sched.decoder.step = step
        tok = engine.tokenizer_manager.tokenizer
        short = tok.encode("x = 1")[:4]
        long = (tok.encode(PROMPTS[2]) * 3)[:20]
        prompts = [short, long, short[:3]] * 3
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 6})
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert sizes and max(sizes) <= 2, sizes
    finally:
        engine.shutdown()


@pytest.mark.parametrize("site", ["add_request", "abort", "flush", "state"])
def test_a_fault_handling_a_message_is_contained(model_path, site):
    """A message whose handling raises (with --tp-size 1) must not end the scheduler thread:
    a request that could not be added ends with an abort finish, a failed abort still ends
    its request, a failed flush or state query fails its caller; then the engine serves."""
    engine = _engine(model_path)
    try:
        tm = engine.tokenizer_manager
        sched = tm.scheduler
        ref = engine.generate(PROMPTS[0], GREEDY)["output_ids"]

        def boom(*args, **kwargs):
            raise RuntimeError(f"injected fault in {site}")

        if site == "add_request":
            real = sched._grammar_of
            sched._grammar_of = boom
            out = engine.generate(PROMPTS[1], GREEDY)
            sched._grammar_of = real
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "internal error" in reason["message"], reason
        elif site == "abort":
            real = sched.kv.release

            def release(req):  # frees, then raises: the fault is after the bookkeeping
                real(req)
                raise RuntimeError("injected fault in abort")

            long = {**GREEDY, "max_new_tokens": 200}
            req = tm.make_request(tm.tokenize(PROMPTS[1]), long, stream=True)

            async def run_and_abort():
                outs = []
                async for out in tm.generate_one(req):
                    outs.append(out)
                    if len(outs) == 1:
                        sched.kv.release = release
                        tm.abort(req.rid)
                return outs[-1]

            try:
                last = engine._run(run_and_abort())
            finally:
                sched.kv.release = real
            assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
        elif site == "flush":
            real = sched.tree.reset
            sched.tree.reset = boom
            with pytest.raises(RuntimeError, match="injected"):
                engine.flush_cache()
            sched.tree.reset = real
        else:
            real = sched.internal_state
            sched.internal_state = boom
            with pytest.raises(RuntimeError, match="injected"):
                engine.get_internal_state()
            sched.internal_state = real
        assert engine.tokenizer_manager.thread.is_alive()
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == ref
        assert sched.idle_invariant_problem() is None
    finally:
        engine.shutdown()


FATAL_SCRIPT = """
import sys
import time
from srt_ascend import Engine
engine = Engine(model_path=sys.argv[1], dtype="float32", kv_invariant_check="fatal")
engine.tokenizer_manager.scheduler.idle_invariant_problem = lambda: "injected leak"
engine.generate("x", {"max_new_tokens": 2})
time.sleep(60)  # the idle check runs right after the answer: the process ends before this
print("still running", flush=True)
"""


def test_a_fault_the_scheduler_cannot_contain_ends_the_process(model_path, tmp_path):
    """--kv-invariant-check fatal with a broken invariant (with --tp-size 1): the process
    ends with exit code 1 and an error line naming the fault, instead of a dead scheduler
    thread behind a server that answers /health and hangs every request."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", FATAL_SCRIPT, model_path],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if "the scheduler stopped" in line]
    assert len(errors) == 1 and "injected leak" in errors[0], proc.stderr[-2000:]
