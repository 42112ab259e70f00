"""Returned logprobs are the same with MTP on and off (float32): the same penalised target
logits at every verified position (penalties and the min-new-tokens mask see the drafts
before it), the same top lists."""

from __future__ import annotations

import math

from engine_prompts import PROMPTS

from srt_ascend import Engine

ASKED = [3, 17, 2]  # token_ids_logprob: reported at every position with MTP on and off
PARAMS = {"max_new_tokens": 10, "temperature": 0, "repetition_penalty": 1.3, "min_new_tokens": 3}


def run(model_path: str, **spec) -> list[dict]:
    engine = Engine(model_path=model_path, dtype="float32", **spec)
    try:
        return engine.generate(
            PROMPTS[:4], PARAMS, return_logprob=True, top_logprobs_num=20, token_ids_logprob=ASKED
        )
    finally:
        engine.shutdown()


def test_logprobs_are_the_same_with_mtp_on_and_off(model_path):
    off = run(model_path)
    on = run(model_path, speculative_algorithm="MTP", speculative_num_steps=2)
    for a, b in zip(off, on):
        assert a["output_ids"] == b["output_ids"]
        ma, mb = a["meta_info"], b["meta_info"]
        assert mb["spec_verify_ct"] > 0
        la, lb = ma["output_token_logprobs"], mb["output_token_logprobs"]
        assert [t[1] for t in la] == [t[1] for t in lb] == a["output_ids"]
        for x, y in zip(la, lb):
            assert math.isclose(x[0], y[0], rel_tol=1e-4, abs_tol=1e-4)
        ta, tb = ma["output_top_logprobs"], mb["output_top_logprobs"]
        assert all(len(t) == 20 for t in ta + tb)
        for xa, xb in zip(ta, tb):
            assert [t[1] for t in xa[:5]] == [t[1] for t in xb[:5]]
            for p, q in zip(xa, xb):
                assert math.isclose(p[0], q[0], rel_tol=1e-4, abs_tol=1e-4)
        ia, ib = ma["output_token_ids_logprobs"], mb["output_token_ids_logprobs"]
        assert len(ia) == len(ib) == len(a["output_ids"])
        for xa, xb, top in zip(ia, ib, ta):
            assert [t[1] for t in xa] == [t[1] for t in xb] == ASKED
            top_of = {t[1]: t[0] for t in top}
            for p, q in zip(xa, xb):
                assert math.isclose(p[0], q[0], rel_tol=1e-4, abs_tol=1e-4)
                if p[1] in top_of:
                    assert math.isclose(p[0], top_of[p[1]], rel_tol=1e-5, abs_tol=1e-5)
