"""A block-FP8 model's GEMM variants are all compiled at start: `warm_up_kernels` reaches the
fp8 GEMM of every quantized linear and expert (the MTP layer's included), even with an
attention backend that compiles nothing, and serving's forwards add no variant.

The shipped checkpoint is quantized by the tool (`fp8_block`, MTP layer too); for this module
CPU tensors take the interpreted Triton GEMM, as CUDA tensors would, and each launch is
recorded by its CUDA cache key (test_kernel_variants.VariantRecorder).
"""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.ops import quant_matmul as qm
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.kernel_warmup import warm_up_kernels, warm_up_runs
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs
from srt_ascend.tools.quantize import Calibration, quantize_checkpoint
from tests.unit.test_kernel_variants import VariantRecorder, eager_forwards
from tests.unit.triton_interpreter import import_interpreted

import_interpreted()
from srt_ascend.layers.ops import fp8_matmul_triton  # noqa: E402 (interpreted)

K = 2  # draft tokens per MTP round


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    every_layer = Calibration(sequences=2, smooth_alpha=None, memory_ratio=None)
    path = quantize_checkpoint(
        SHIPPED_MODEL, str(tmp_path_factory.mktemp("fp8")), "fp8_block", True, every_layer
    )
    qm._FP8_BLOCK_KERNELS["cpu"] = lambda: fp8_matmul_triton.fp8_block_linear
    try:
        args = ServerArgs(
            model_path=path,
            dtype="float32",
            context_length=128,
            max_running_requests=2,
            max_total_tokens=512,
            speculative_algorithm="MTP",
            speculative_num_steps=K,
            disable_cuda_graph=True,
        )
        yield ModelRunner(args, get_platform("cpu"))
    finally:
        del qm._FP8_BLOCK_KERNELS["cpu"]


def _serve(runner: ModelRunner) -> None:
    """Eager forwards as serving issues them: a 2-row decode, a 5-token extend over a cached
    prefix, and the MTP draft extend after each (the row count is never specialised, so
    verifies and longer prefills are the same variants; the interpreter runs each program
    in Python, so few rows keep this quick)."""
    plans = [(ForwardMode.DECODE, [1, 1], [30, 17]), (ForwardMode.EXTEND, [5], [20])]
    eager_forwards(runner, plans, 2, 40)


@torch.inference_mode()
def test_warm_up_compiles_every_fp8_gemm_variant(runner):
    assert runner.attn_backend.warm_up_lengths(8, 128) == []  # attention compiles nothing
    assert ("extend", (1, 1)) in warm_up_runs(runner)
    recorder = VariantRecorder()
    uninstall = recorder.install()
    try:
        assert warm_up_kernels(runner, progress=False) == len(warm_up_runs(runner))
        warm = set(recorder.keys)
        recorder.keys.clear()
        _serve(runner)
        serving = set(recorder.keys)
    finally:
        uninstall()
    fp8 = {"_quantize_groups_kernel", "_fp8_block_kernel"}  # the activation's, the GEMM
    assert {name for name, _ in warm} == fp8
    assert {name for name, _ in serving} == fp8, "nothing was served"
    assert not serving - warm, f"variants first launched while serving: {serving - warm}"
