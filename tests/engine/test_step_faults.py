"""A fault inside a step (an injected exception in a forward) ends that step's requests with an
abort finish, frees everything they held, and the server keeps serving: prefill, decode,
verify and draft, MTP off and on."""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from srt_ascend import Engine
from srt_ascend.model_executor.forward_batch import ForwardMode

GREEDY = {"max_new_tokens": 12, "temperature": 0}


class Fault:
    """Makes owner.<attr> raise on its `at`-th call with a batch in `mode`, once."""

    def __init__(self, owner, attr: str, mode: ForwardMode, at: int = 2) -> None:
        self.owner, self.attr, self.mode, self.left = owner, attr, mode, at
        self.fired = False
        self.real = getattr(owner, attr)

    def __enter__(self) -> Fault:
        def faulty(fb, *args, **kwargs):
            if fb.forward_mode == self.mode and not self.fired:
                self.left -= 1
                if self.left == 0:
                    self.fired = True
                    raise RuntimeError(f"injected fault in {self.attr} {self.mode.name}")
            return self.real(fb, *args, **kwargs)

        setattr(self.owner, self.attr, faulty)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.attr, self.real)


SITES = {
    "plain": [
        ("forward", ForwardMode.EXTEND),
        ("forward", ForwardMode.DECODE),
    ],
    "mtp": [
        ("forward", ForwardMode.EXTEND),
        ("forward", ForwardMode.TARGET_VERIFY),
        ("draft", ForwardMode.DECODE),  # draft steps 2..K
        ("draft", ForwardMode.DRAFT_EXTEND),  # the pass after verify / prefill
    ],
}
SPEC = {"speculative_algorithm": "MTP", "speculative_num_steps": 2, "speculative_verify": "expand"}


@pytest.mark.parametrize("name", ["plain", "mtp"])
def test_a_failed_step_fails_its_requests_only_and_frees_everything(model_path, name):
    kwargs = {"model_path": model_path, "dtype": "float32", "max_total_tokens": 4096}
    engine = Engine(**kwargs, **(SPEC if name == "mtp" else {}))
    try:
        sched = engine.tokenizer_manager.scheduler
        clean = [o["output_ids"] for o in engine.generate(PROMPTS[:4], GREEDY)]
        for attr, mode in SITES[name]:
            at = 1 if mode == ForwardMode.EXTEND else 2  # one prefill batch (cached prompts)
            # the draft worker holds the MTP forward with its logits as a handle of its own;
            # the main model's forwards (with or without logits) all go through `_run`
            owner, attr = (
                (sched.decoder.worker.h, "forward_logits")
                if attr == "draft"
                else (sched.runner, "_run")
            )
            with Fault(owner, attr, mode, at) as fault:
                outs = engine.generate(PROMPTS[:4], GREEDY)
            assert fault.fired, (attr, mode)
            reasons = [o["meta_info"]["finish_reason"] for o in outs]
            failed = [r for r in reasons if r["type"] == "abort"]
            assert failed, (attr, mode, reasons)
            assert all("internal error" in r["message"] for r in failed)
            for o, ref in zip(outs, clean):  # the others are untouched; failed ones a prefix
                assert o["output_ids"] == ref[: len(o["output_ids"])]
            assert sched.idle_invariant_problem() is None, (attr, mode)
            again = [o["output_ids"] for o in engine.generate(PROMPTS[:4], GREEDY)]
            assert again == clean, (attr, mode)
    finally:
        engine.shutdown()
