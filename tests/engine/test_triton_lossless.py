"""The new MLA attention kernel (FlashMLA's schedule) served end to end: float32 greedy
outputs are token-identical with MTP on (both verify layouts) and off, all with the triton
attention backend forced on CPU (the kernel under Triton's interpreter), on the shipped
checkpoint. Two prompts (the interpreter is slow), the second extending the first (a radix
hit)."""

from __future__ import annotations

from lossless import PROMPTS, assert_same_greedy, run

from tests.unit.triton_interpreter import import_interpreted

attn_triton = import_interpreted()[0]  # before anything imports triton: CPU tensors run

TRITON = {"attention_backend": "triton"}
MTP = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}


def test_triton_attention_mtp_is_lossless(model_path, monkeypatch):
    launches = []
    kernel = attn_triton.mla_attention

    def counted(*args, **kwargs):
        launches.append(kwargs["max_q_len"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attn_triton, "mla_attention", counted)
    prompts = PROMPTS[3:5]  # PROMPTS[4] extends PROMPTS[3]
    assert prompts[1].startswith(prompts[0])
    baseline, _ = run(model_path, prompts, **TRITON)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in baseline)
    for verify in ("expand", "fia"):
        launches.clear()
        outs, state = run(model_path, prompts, **TRITON, **MTP, speculative_verify=verify)
        assert_same_greedy(f"triton mtp {verify}", outs, baseline)
        assert state["avg_spec_accept_length"] > 1.0  # drafts were really accepted
        assert launches, "the triton kernel served nothing"
        if verify == "fia":  # multi-query verify: rows of K + 1 = 3 queries
            assert 3 in launches
