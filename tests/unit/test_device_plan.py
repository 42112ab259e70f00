"""The start-up decision of verify path, KV layout and page size per device and model shape."""

from __future__ import annotations

import math

import pytest
import torch

from srt_ascend.launch_server import resolve_device_settings
from srt_ascend.layers.attention.device_plan import (
    AttentionPlan,
    UnsupportedOnDevice,
    default_page_size,
    resolve_attention_plan,
)
from srt_ascend.layers.attention.fia_backend import paged_cache
from srt_ascend.layers.attention.fia_reference import (
    build_compressed_causal_mask,
    mla_npu_shape_problems,
    npu_fused_infer_attention_score,
    to_cumulative,
)
from srt_ascend.mem_cache import MLATokenToKVPool
from srt_ascend.models.loader import load_config
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs, prepare_server_args

V3 = dict(kv_lora_rank=512, rope_dim=64)  # DeepSeek-V3's MLA: 128 heads, latent 512, rope 64
TINY = dict(num_heads=8, kv_lora_rank=64, rope_dim=16)  # the shipped checkpoint


def plan(device, verify=None, page_size=128, **shape) -> AttentionPlan:
    return resolve_attention_plan(
        device,
        shape["num_heads"],
        shape["kv_lora_rank"],
        shape["rope_dim"],
        page_size,
        verify,
    )


@pytest.mark.parametrize("tp", [1, 2, 4, 16])
def test_deepseek_v3_on_npu_uses_fia_where_heads_per_rank_fit(tp):
    heads = 128 // tp
    p = plan("npu", num_heads=heads, **V3)
    if tp == 16:  # 8 heads per rank: FIA's MLA path takes 32, 64 or 128
        assert p.verify == "expand" and "query heads must be 32, 64 or 128, got 8" in p.fallback
        with pytest.raises(UnsupportedOnDevice, match="got 8; use --speculative-verify expand"):
            plan("npu", "fia", num_heads=heads, **V3)
    else:
        assert p == AttentionPlan("fia", "separate", 128)
        assert plan("npu", "expand", num_heads=heads, **V3).verify == "expand"


def test_page_size_the_op_refuses_is_decided_at_start():
    p = plan("npu", page_size=1, num_heads=128, **V3)
    assert p.verify == "expand" and "block_size must be 16 or 128, got 1" in p.fallback
    assert plan("npu", page_size=16, num_heads=128, **V3).verify == "fia"
    with pytest.raises(UnsupportedOnDevice) as e:
        plan("npu", "fia", page_size=64, num_heads=128, **V3)
    assert "\n" not in str(e.value) and "page size 64" in str(e.value)


def test_shipped_checkpoint_shape():
    cfg = load_config(SHIPPED_MODEL)
    shape = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    assert shape == tuple(TINY.values())
    npu = plan("npu", **TINY)
    assert (npu.verify, npu.kv_layout) == ("expand", "separate")
    for problem in ("got 8", "D must be 512, got 64", "D must be 64, got 16"):
        assert problem in npu.fallback
    with pytest.raises(UnsupportedOnDevice, match="cannot run this model on npu"):
        plan("npu", "fia", **TINY)
    # Off NPU the reference runs every shape: the request (default fia) stands.
    for device in ("cpu", "cuda"):
        assert plan(device, page_size=1, **TINY) == AttentionPlan("fia", "interleaved", 1)
        assert plan(device, "expand", page_size=1, **TINY).verify == "expand"
    with pytest.raises(UnsupportedOnDevice, match="must be one of expand, fia"):
        plan("cpu", "tree", **TINY)


@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_npu_plan_is_fia_exactly_where_the_shape_rules_allow(heads, page_size):
    for rank, rope in ((512, 64), (256, 64), (512, 32)):
        ok = not mla_npu_shape_problems(heads, rank, rope, page_size)
        p = resolve_attention_plan("npu", heads, rank, rope, page_size, None)
        assert (p.verify == "fia") == ok and (p.fallback is None) == ok


def test_a_fia_plan_runs_through_the_reference_with_its_layout_and_page_size():
    """The NPU plan for 32 heads (DeepSeek-V3 at TP 4): the op's arguments built from a
    separate-layout pool with the plan's page size give dense attention's result."""
    p = plan("npu", num_heads=32, **V3)
    assert p.verify == "fia" and p.kv_layout == "separate"
    g = torch.Generator().manual_seed(0)
    ps, q_lens, kv_lens = p.page_size, [2, 3], [130, 7]
    pool = MLATokenToKVPool(4 * ps, ps, torch.float32, 512, 64, 1, layout=p.kv_layout)
    pages = [[3, 1], [4]]  # page ids of each request (page 0 is the padding page)
    slots = [torch.cat([torch.arange(pg * ps, (pg + 1) * ps) for pg in ids]) for ids in pages]
    c_kv, k_pe = torch.randn(pool.size + ps, 512, generator=g), torch.randn(pool.size + ps, 64)
    pool.set_mla_kv_buffer(0, torch.arange(pool.size + ps), c_kv, k_pe)
    q, q_pe = torch.randn(5, 32, 512, generator=g), torch.randn(5, 32, 64, generator=g)
    table = torch.tensor([[3, 1], [4, 0]], dtype=torch.int32)
    latent = paged_cache(pool.get_c_kv(0), ps, torch.float32)
    out, _ = npu_fused_infer_attention_score(
        q,
        latent,
        latent,
        query_rope=q_pe,
        key_rope=paged_cache(pool.get_k_pe(0), ps, torch.float32),
        num_heads=32,
        num_key_value_heads=1,
        input_layout="TND",
        atten_mask=build_compressed_causal_mask(),
        sparse_mode=3,
        scale=1 / math.sqrt(576),
        block_table=table,
        block_size=ps,
        actual_seq_lengths=to_cumulative(q_lens),
        actual_seq_lengths_kv=kv_lens,
    )
    start = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        keys = slots[b][:kl]
        for i in range(ql):
            seen = keys[: kl - ql + i + 1]
            s = q[start + i] @ c_kv[seen].T + q_pe[start + i] @ k_pe[seen].T  # [32, seen]
            want = torch.softmax(s / math.sqrt(576), -1) @ c_kv[seen]
            torch.testing.assert_close(out[start + i], want, atol=1e-4, rtol=1e-4)
        start += ql


def test_server_args_resolve_page_size_and_verify_per_device():
    args = ServerArgs(speculative_algorithm="MTP")
    assert args.page_size is None and args.speculative_verify is None
    assert default_page_size("npu") == 128 and default_page_size("cpu") == 1
    npu, cpu = args.for_device("npu"), args.for_device("cpu")
    assert (npu.page_size, npu.speculative_verify) == (128, None)  # the shape decides on NPU
    assert (cpu.page_size, cpu.speculative_verify) == (1, "fia")
    assert args.for_device("cuda").page_size == 1
    assert [args.for_device(d).attention_backend for d in ("cpu", "cuda", "npu")] == [
        "torch_native", "triton", "torch_native",
    ]  # fmt: skip
    given = ServerArgs(page_size=16, speculative_verify="expand", attention_backend="torch_native")
    assert given.for_device("npu") == given == given.for_device("cpu")
    with pytest.raises(ValueError, match="--chunked-prefill-size"):
        ServerArgs(chunked_prefill_size=64).for_device("npu")
    ns = prepare_server_args([])
    assert ns.page_size is None and ns.speculative_verify is None


def test_launcher_decides_at_start(capsys):
    """`resolve_device_settings` runs before the model loads: a device type is all it needs."""
    spec = ServerArgs(speculative_algorithm="MTP")
    npu = resolve_device_settings(spec, "npu")
    assert npu.page_size == 128 and npu.speculative_verify is None
    assert resolve_device_settings(spec, "cpu").speculative_verify == "fia"
    with pytest.raises(SystemExit) as e:
        resolve_device_settings(
            ServerArgs(speculative_algorithm="MTP", speculative_verify="fia"), "npu"
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("srt_ascend.launch_server: error: --speculative-verify fia cannot run")
    # Without speculation the verify flag is unused: nothing to refuse.
    plain = ServerArgs(speculative_verify="fia")
    assert resolve_device_settings(plain, "npu").page_size == 128
