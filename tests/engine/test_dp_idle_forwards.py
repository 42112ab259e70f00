"""The DP-idle rule, in one process: under data-parallel attention a DP group without requests
runs `Decoder.idle_prefill` / `idle_step` while another group prefills / decodes, and the two
must run the same model forwards in the same order (main model: one MLP collective per layer;
MTP module: one), or the groups' MLP collectives stop pairing up. Here every real prefill and
decode step's forwards are recorded and compared with what the idle variants run."""

from __future__ import annotations

import pytest

from srt_ascend import Engine

MTP = {"speculative_algorithm": "MTP"}
CONFIGS = {
    "plain": {},
    "mtp-k2-expand": {**MTP, "speculative_num_steps": 2, "speculative_verify": "expand"},
    "mtp-k3-fia": {**MTP, "speculative_num_steps": 3, "speculative_verify": "fia"},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_idle_forwards_mirror_real_steps(config, monkeypatch, model_path):
    # data-parallel attention runs several ranks, so its steps are serial (no overlap): the
    # idle variants mirror the serial step
    engine = Engine(
        model_path=model_path,
        device="cpu",
        dtype="float32",
        disable_overlap_schedule=True,
        **CONFIGS[config],
    )
    try:
        scheduler = engine.tokenizer_manager.scheduler
        runner, decoder = scheduler.runner, scheduler.decoder
        calls: list[str] = []
        forward_eager = runner.forward_eager

        def recorded(fb, mtp_step=None, hidden=None):
            calls.append("main" if mtp_step is None else f"mtp{mtp_step}")
            return forward_eager(fb, mtp_step, hidden)

        monkeypatch.setattr(runner, "forward_eager", recorded)
        monkeypatch.setattr(
            runner, "forward_idle", lambda mtp_step=None: recorded_idle(calls, mtp_step)
        )
        seen = {"prefill": [], "decode": []}
        for name, phase in (("_run_prefill", "prefill"), ("_run_decode", "decode")):
            monkeypatch.setattr(
                scheduler, name, _recording(getattr(scheduler, name), calls, seen[phase])
            )
        params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        engine.generate(["def fibonacci(n):\n", "import os\n", "class Stack:"], params)
        assert seen["prefill"] and seen["decode"]
        # The scheduler thread now waits for messages: the idle variants run here.
        calls.clear()
        decoder.idle_prefill()
        assert all(s == calls for s in seen["prefill"]), (seen["prefill"], calls)
        calls.clear()
        decoder.idle_step()
        assert all(s == calls for s in seen["decode"]), (seen["decode"], calls)
    finally:
        engine.shutdown()


def recorded_idle(calls: list[str], mtp_step: int | None) -> None:
    """What ModelRunner.forward_idle runs under DP attention: one forward of that kind."""
    calls.append("main" if mtp_step is None else f"mtp{mtp_step}")


def _recording(method, calls: list[str], into: list):
    def run(*args):
        calls.clear()
        out = method(*args)
        into.append(list(calls))
        return out

    return run
