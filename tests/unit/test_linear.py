"""layers.linear: which matmuls skip oneDNN, that they compute the same product, and that
oneDNN's process-wide switch is always restored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.layers import linear as gemm  # the module, not the function
from srt_ascend.platforms import get_platform
from srt_ascend.platforms.cpu import SMALL_GEMM_MACS
from srt_ascend.server_args import ServerArgs


@pytest.fixture
def routed(monkeypatch):
    """Small-GEMM routing on; returns the list of (op name, oneDNN switch during the call)."""
    before = gemm.small_gemm_limit()
    gemm.configure(SMALL_GEMM_MACS)
    calls: list[tuple[str, bool]] = []
    real = gemm._without_onednn

    def spy(fn, *args):
        def probe(*a):
            calls.append((fn.__name__, torch.backends.mkldnn.enabled))
            return fn(*a)

        return real(probe, *args)

    monkeypatch.setattr(gemm, "_without_onednn", spy)
    yield calls
    gemm.configure(before)


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def test_small_half_precision_cpu_matmuls_skip_onednn(routed):
    x, w = rand(2, 256), rand(208, 256)
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), rtol=1e-2, atol=1e-2)
    a, b = rand(8, 1, 32), rand(8, 32, 64)
    torch.testing.assert_close(gemm.bmm(a, b), torch.bmm(a, b), rtol=1e-2, atol=1e-2)
    assert routed == [("linear", False), ("bmm", False)]
    assert torch.backends.mkldnn.enabled


def test_large_float32_and_multi_row_bmm_keep_the_default(routed):
    gemm.linear(rand(8, 256), rand(512, 256))  # 2^20 multiply-adds
    gemm.linear(rand(1, 256), rand(8192, 256))  # the LM head
    gemm.linear(rand(2, 256, dtype=torch.float32), rand(208, 256, dtype=torch.float32))
    gemm.bmm(rand(8, 2, 32), rand(8, 32, 64))  # two rows per matrix
    gemm.bmm(rand(9, 1, 256), rand(9, 256, 256))  # the dense-MoE down projections
    assert routed == []


def test_limit_is_inclusive_and_counts_all_rows(routed):
    gemm.linear(rand(2, 2, 256), rand(256, 256))  # 4 rows x 256 x 256 = 2^18
    gemm.linear(rand(5, 256), rand(256, 256))
    assert [name for name, _ in routed] == ["linear"]


def test_switch_restored_when_the_matmul_raises(routed):
    with pytest.raises(RuntimeError):
        gemm.linear(rand(1, 256), rand(64, 128))  # mismatched inner dims
    assert routed == [("linear", False)]
    assert torch.backends.mkldnn.enabled


def test_off_by_default_is_plain_torch():
    before = gemm.small_gemm_limit()
    gemm.configure(None)
    try:
        x, w, b = rand(1, 64), rand(32, 64), rand(32)
        assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
    finally:
        gemm.configure(before)


def test_linear_module_keeps_nn_linear_parameters():
    torch.manual_seed(0)
    ours, ref = gemm.Linear(16, 8, bias=True), nn.Linear(16, 8, bias=True)
    ref.load_state_dict(ours.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 16)
    assert torch.equal(ours(x), ref(x))


def test_platform_and_flag():
    cpu = get_platform("cpu")
    assert cpu.small_gemm_macs("off") is None
    assert cpu.small_gemm_macs("on") == SMALL_GEMM_MACS
    expected = SMALL_GEMM_MACS if torch.backends.mkl.is_available() else None
    assert cpu.small_gemm_macs("auto") == expected
    assert ServerArgs(cpu_small_gemm="off").cpu_small_gemm == "off"
    with pytest.raises(ValueError, match="--cpu-small-gemm must be auto, on or off"):
        ServerArgs(cpu_small_gemm="maybe")
