"""The device layer: platform choice and its one-line errors, the graph interface (CPU eager
replay), when graphs are on, and that nothing outside the device layer branches on the
device."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import srt_ascend
from srt_ascend.platforms import DeviceUnavailable, EagerReplayGraph, get_platform
from srt_ascend.server_args import ServerArgs, prepare_server_args


def test_auto_picks_cpu_here_and_reports_memory():
    p = get_platform("auto")
    assert p.name == "cpu" and p.device == torch.device("cpu")
    free, total = p.mem_get_info()
    assert 0 < free <= total == p.total_memory_bytes()


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="NPU stack here")
def test_missing_npu_is_one_clear_line():
    with pytest.raises(DeviceUnavailable) as e:
        get_platform("npu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--device npu: torch_npu")
    assert 'pip install "srt-ascend[npu]"' in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here")
def test_missing_cuda_and_unknown_device():
    with pytest.raises(DeviceUnavailable, match="--device cuda: no CUDA device"):
        get_platform("cuda")
    with pytest.raises(DeviceUnavailable, match="unknown device 'tpu'"):
        get_platform("tpu")


def test_eager_replay_reruns_the_captured_function_over_static_buffers():
    buf = torch.tensor([1.0, 2.0])
    g = get_platform("cpu").new_graph()
    assert isinstance(g, EagerReplayGraph) and g.supports_host_params
    calls = []

    def body():
        calls.append(1)
        return buf * 2

    g.capture(body, pool=None, stream=None)
    assert not calls  # nothing runs at capture
    assert g.replay().tolist() == [2.0, 4.0]
    buf.copy_(torch.tensor([5.0, 7.0]))
    assert g.replay().tolist() == [10.0, 14.0] and len(calls) == 2


def test_graphs_default_off_on_cpu_and_the_flags_win():
    cpu = get_platform("cpu")
    assert not ServerArgs().graphs_enabled(cpu)
    assert ServerArgs(enable_cpu_graph=True).graphs_enabled(cpu)
    assert not ServerArgs(enable_cpu_graph=True, disable_cuda_graph=True).graphs_enabled(cpu)
    args = prepare_server_args(["--graph-batch-sizes", "1", "4", "--cuda-graph-max-bs", "4"])
    assert args.cuda_graph_bs == (1, 4) and args.cuda_graph_max_bs == 4
    assert prepare_server_args(["--cuda-graph-bs", "2"]).cuda_graph_bs == (2,)


def test_nothing_outside_the_device_layer_branches_on_the_device():
    """torch.cuda / torch.npu / torch_npu appear only in srt_ascend/platforms and in the one
    op dispatcher that picks the NPU kernel for NPU tensors."""
    root = Path(srt_ascend.__file__).parent
    allowed = {root / "layers" / "attention" / "npu_ops.py"}
    pattern = re.compile(r"torch\.cuda|torch\.npu|^\s*import torch_npu|is_available\(\)", re.M)
    offenders = [
        str(f.relative_to(root))
        for f in root.rglob("*.py")
        if "platforms" not in f.parts and f not in allowed and pattern.search(f.read_text())
    ]
    assert not offenders
