"""Speculation stays lossless against a quantized target: for each scheme written by
`srt_ascend.tools.quantize` from the shipped checkpoint (the MTP layer quantized too, its
calibration, smoothing and sensitivity fallback cut to few windows), float32-activation greedy
outputs are token-identical with MTP on and off, graphs included. ModelSlim's int8 layers
serve --enable-deterministic-inference (bit-identical alone or batched, MTP on or off);
block FP8 is a start error with it."""

from __future__ import annotations

import pytest
from lossless import GREEDY, PROMPTS, assert_same_greedy, run

from srt_ascend import Engine
from srt_ascend.server_args import SHIPPED_MODEL
from srt_ascend.tools.quantize import Calibration, quantize_checkpoint

SCHEMES = ("w8a8", "w8a8_dynamic", "fp8_block")
SUBSET = PROMPTS[:20]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    quick = Calibration(sequences=2, sensitivity_sequences=1)
    return {s: quantize_checkpoint(SHIPPED_MODEL, str(root / s), s, True, quick) for s in SCHEMES}


# Logprob tolerance per scheme. Activations are quantised per token (per tensor for W8A8): a
# last-bit difference between a decode and a verify forward's float parts (attention, the fp8
# path's float GEMM) can move a value across a rounding step, which e4m3's 3 mantissa bits
# make larger than float32's noise.
TOLERANCE = {"w8a8": 1e-3, "w8a8_dynamic": 1e-3, "fp8_block": 3e-2}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_identical_with_mtp(quantized, scheme):
    base, _ = run(quantized[scheme], SUBSET)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in base)
    spec = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
    outs, state = run(quantized[scheme], SUBSET, **spec)
    assert_same_greedy(f"{scheme} mtp", outs, base, TOLERANCE[scheme])
    assert 1.3 < state["avg_spec_accept_length"] <= 3
    if scheme == "w8a8_dynamic":  # captured decode / verify / draft forwards (CPU replay)
        graphs, _ = run(quantized[scheme], SUBSET, enable_cpu_graph=True, **spec)
        assert_same_greedy(f"{scheme} mtp graphs", graphs, base, TOLERANCE[scheme])


def test_refused_combination_is_a_start_error(quantized):
    with pytest.raises(ValueError, match=r"quantized checkpoint \(fp8\) with --enable-torch"):
        Engine(model_path=quantized["fp8_block"], enable_torch_compile=True)
    with pytest.raises(ValueError, match=r"\(fp8\) with --enable-deterministic-inference .*FP8"):
        Engine(model_path=quantized["fp8_block"], enable_deterministic_inference=True)


def _bits(outs):
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    return [
        (o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]) for o in outs
    ]


def test_deterministic_with_int8_layers(quantized):
    """W8A8 (static linears, dynamic experts): bf16 greedy outputs and logprobs bit-identical
    one request at a time (MTP off) and 12 at once with MTP K = 2; the server reports its
    weight memory."""
    det = {"dtype": "bfloat16", "enable_deterministic_inference": True}
    prompts = PROMPTS[:12]
    engine = Engine(model_path=quantized["w8a8"], **det)
    try:
        alone = [engine.generate(p, GREEDY, return_logprob=True) for p in prompts]
    finally:
        engine.shutdown()
    spec = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
    engine = Engine(model_path=quantized["w8a8"], **det, **spec)
    try:
        batched = engine.generate(prompts, GREEDY, return_logprob=True)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    # the running bf16 server's weight memory (main + MTP layer): the quantized scope, float
    # fallback layers included, within the quantizer's budget
    held, bf16 = state["quantized_weight_bytes"], state["quantized_weight_bytes_as_bf16"]
    assert 0.5 < held / bf16 <= 0.55 and state["weight_bytes"] > held
    assert sum(o["meta_info"]["spec_verify_ct"] for o in batched) > 0
    assert _bits(batched) == _bits(alone)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a8_dynamic"])
def test_fused_cpu_int8_ops_serve_the_torch_ops_bits(quantized, scheme):
    """The served bf16 outputs and logprobs with the fused CPU int8 ops (layers/ops/cpu_int8)
    are the torch-op path's bits (8 prompts at once: the GEMV's 1-4 rows and oneDNN's more)."""
    from srt_ascend.layers.ops import cpu_int8

    prompts = PROMPTS[:8]
    outs = {}
    try:
        for fused in (True, False):
            cpu_int8.configure(fused)
            engine = Engine(model_path=quantized[scheme], dtype="bfloat16")
            try:
                batched = engine.generate(prompts, GREEDY, return_logprob=True)
                alone = engine.generate(prompts[0], GREEDY, return_logprob=True)
                outs[fused] = _bits(batched) + _bits([alone])
            finally:
                engine.shutdown()
    finally:
        cpu_int8.configure(True)
    assert cpu_int8.ops() is not None
    assert outs[True] == outs[False]
