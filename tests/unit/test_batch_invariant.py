"""Batch-invariant mode (--enable-deterministic-inference, issue 32): each op's result for a row
is bit-identical whatever else the call holds. Per op: linear and bmm over fixed row tiles, the
MoE layer (one path, experts summed in id order), the batch-invariant attention backend
(decode, a multi-query row, a padded batch); and the flag's plumbing and refusals.

Controls: the same comparisons without the mode find differing rows on this CPU (oneDNN's bf16
kernels follow the row count); where a CPU's kernels happen to agree the control is skipped,
not passed."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers import linear as gemm
from srt_ascend.layers import row_plan
from srt_ascend.layers.attention.batch_invariant import (
    KV_TILE,
    BatchInvariantMLABackend,
    batch_invariant_backend,
)
from srt_ascend.mem_cache import MLATokenToKVPool, ReqToTokenPool
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs, prepare_server_args

BF16 = torch.bfloat16


@pytest.fixture
def tiles(gemm_mode):
    """Batch-invariant mode on (16-row tiles, small-GEMM routing as on the CPU platform)."""
    gemm_mode(1 << 18, gemm.DETERMINISTIC_ROW_TILE)


@pytest.fixture
def plain():
    before = (gemm.small_gemm_limit(), gemm.row_tile())
    gemm.configure(1 << 18)
    yield
    gemm.configure(*before)


def rand(*shape, seed=0, dtype=BF16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def linear_windows() -> list[tuple[int, int]]:
    """Row windows of a 2228-row batch: the 102 rows at 536 (a prompt inside a batched prefill,
    where oneDNN's plain product differed), a single row, short and odd windows."""
    return [(536, 102), (3, 1), (100, 37), (7, 5), (2000, 228)]


def differing_linear_rows() -> int:
    """Rows of windows whose product differs from the same rows inside the whole batch."""
    bad = 0
    for n_in, n_out in ((768, 256), (256, 1536), (256, 208)):
        w, x = rand(n_out, n_in, seed=n_in) / 16, rand(2228, n_in, seed=n_out)
        whole = gemm.linear(x, w)
        for start, n in linear_windows():
            part = gemm.linear(x[start : start + n], w)
            bad += int((part != whole[start : start + n]).any(-1).sum())
    return bad


def test_linear_rows_bit_identical_in_any_batch(tiles):
    assert differing_linear_rows() == 0
    x, w = rand(2, 3, 256, seed=1), rand(512, 256, seed=2)
    assert gemm.linear(x, w).shape == (2, 3, 512)  # leading dims kept
    f32 = gemm.linear(x.float()[0], w.float())  # float32 (the MoE router) is tiled too
    assert torch.equal(f32[1:2], gemm.linear(x.float()[0, 1:2], w.float()))


def test_control_linear_rows_differ_without_tiles(plain):
    if differing_linear_rows() == 0:
        pytest.skip("this CPU's oneDNN kernels do not follow the row count: no control")


def test_bmm_rows_bit_identical_in_any_batch(tiles):
    """The absorbed-MLA per-head products [H, T, d] @ [H, d, R]."""
    a, b = rand(8, 2228, 32, seed=3), rand(8, 32, 64, seed=4)
    whole = gemm.bmm(a, b)
    for start, n in linear_windows():
        assert torch.equal(gemm.bmm(a[:, start : start + n], b), whole[:, start : start + n])


@pytest.fixture(scope="module")
def moe():
    from srt_ascend.models.loader import load_model

    model, _ = load_model(SHIPPED_MODEL, dtype=BF16, load_mtp=False)
    layer = model.model.layers[1].mlp  # routed experts + one shared expert
    layer.fuse_weights()
    return layer


def differing_moe_rows(layer) -> list[tuple[int, bool]]:
    x = rand(40, 256, seed=5)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
        return [
            (n, static)
            for n in (2, 3, 5, 8, 16, 40)
            for static in (False, True)
            if not torch.equal(layer(x[:n], static_shapes=static), alone[:n])
        ]


def test_moe_rows_bit_identical_in_any_batch(moe, tiles):
    """Eager (sparse/dense by size) and graph (gathered/dense) shapes alike."""
    assert differing_moe_rows(moe) == []


def test_control_moe_rows_differ_without_mode(moe, plain):
    if not differing_moe_rows(moe):
        pytest.skip("the MoE paths agreed on this CPU: no control")


@pytest.fixture(scope="module")
def many_experts():
    """64 experts, 6 chosen per token (DeepSeek-V3's shape scaled down: 256 and 8)."""
    from srt_ascend.layers.moe import RoutedExperts

    layer = RoutedExperts(64, 256, 64)
    with torch.no_grad():
        layer.w13.copy_(rand(64, 128, 256, seed=11) / 16)
        layer.w2.copy_(rand(64, 256, 64, seed=12) / 8)
    return layer.to(BF16).eval()


def test_many_experts_rows_bit_identical_and_only_chosen_experts_run(many_experts, tiles):
    """The eager path runs only the experts a batch chose (not all 64 over every token), and a
    token's output is the same bits alone, in any batch, and on the fixed-shape path."""
    g = torch.Generator().manual_seed(13)
    ids = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(40)])
    weights = torch.rand(40, 6, generator=g)
    x = rand(40, 256, seed=14)
    ran = []
    expert = many_experts._expert
    many_experts._expert = lambda *a: ran.append(1) or expert(*a)
    try:
        with torch.inference_mode():
            alone = torch.cat(
                [many_experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(40)]
            )
            assert len(ran) == 40 * 6  # one expert call per choice, none for the rest
            for n in (2, 3, 17, 40):
                for static in (False, True):
                    out = many_experts(x[:n], weights[:n], ids[:n], static_shapes=static)
                    assert torch.equal(out, alone[:n]), (n, static)
    finally:
        del many_experts._expert


R, P, H = 64, 16, 8


class KVWorld:
    """One request row of 300 tokens with fixed per-slot latents (slots in shuffled order),
    and two more rows; forwards write a token's own latent, so any order of forwards leaves
    the pool the same."""

    def __init__(self) -> None:
        self.pool = MLATokenToKVPool(1024, 1, BF16, R, P, layer_num=1)
        self.req = ReqToTokenPool(size=4, max_context_len=512)
        self.c_kv, self.k_pe = rand(1025, R, seed=6), rand(1025, P, seed=7)
        perm = torch.randperm(1000, generator=torch.Generator().manual_seed(8)) + 1
        for row in (1, 2, 3):
            self.req.req_to_token[row, :300] = perm[(row - 1) * 300 : row * 300]
        self.pool.set_mla_kv_buffer(0, perm[:900], self.c_kv[perm[:900]], self.k_pe[perm[:900]])
        self.q, self.q_pe = rand(512, H, R, seed=9), rand(512, H, P, seed=10)  # by position

    def run(self, backend, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """rows: (request row, seq_len, q_len); returns [T, H, R] for the packed queries."""
        loc = torch.cat([self.req.req_to_token[r, s - q : s] for r, s, q in rows])
        pos = torch.cat([torch.arange(s - q, s) for _, s, q in rows])
        mode = ForwardMode.DECODE if all(q == 1 for *_, q in rows) else ForwardMode.EXTEND
        fb = ForwardBatch.build(
            mode, torch.zeros(len(loc), dtype=torch.int64), [r for r, _, _ in rows],
            [s for _, s, _ in rows], [q for *_, q in rows], loc, self.req, self.pool, backend,
        )  # fmt: skip
        return backend.forward(
            self.q[pos], self.q_pe[pos], self.c_kv[loc], self.k_pe[loc], 0, 0.2, fb
        )


def test_attention_query_bit_identical_in_any_batch():
    """Query at position 150 of row 1: decoded alone; inside a 20-query row (verify / a
    prefill chunk); decoded next to a 300-key row (KV padded past several tiles) and an
    extend row; at a multiple of the KV tile."""
    world, backend = KVWorld(), BatchInvariantMLABackend()
    alone = world.run(backend, [(1, 151, 1)])[0]
    assert torch.equal(world.run(backend, [(1, 160, 20)])[10], alone)
    assert torch.equal(world.run(backend, [(2, 300, 1), (1, 151, 1), (3, 40, 7)])[1], alone)
    assert torch.equal(world.run(backend, [(3, 299, 3), (1, 151, 1)])[3], alone)
    tile = world.run(backend, [(1, KV_TILE, 1)])[0]
    assert torch.equal(world.run(backend, [(1, KV_TILE + 5, 6), (2, 9, 9)])[0], tile)
    assert alone.abs().sum() > 0


def test_flag_parses_and_refuses_what_it_cannot_hold():
    assert prepare_server_args(["--enable-deterministic-inference"]).enable_deterministic_inference
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        ServerArgs(enable_deterministic_inference=True, enable_torch_compile=True)
    assert batch_invariant_backend("torch_native") == "torch_native_batch_invariant"
    assert batch_invariant_backend("triton", "cuda") == "triton_batch_invariant"
    with pytest.raises(ValueError, match="--attention-backend triton has no .* on cpu"):
        batch_invariant_backend("triton")
    # torch_native's variant reduces with cuBLAS on CUDA: not batch-invariant there
    with pytest.raises(ValueError, match="torch_native has no .* on cuda .available: triton"):
        batch_invariant_backend("torch_native", "cuda")


def test_platforms_serve_the_flag_or_name_the_op_they_lack():
    from srt_ascend.platforms.cpu import CpuPlatform
    from srt_ascend.platforms.cuda import CudaPlatform
    from srt_ascend.platforms.npu import NpuPlatform

    assert CpuPlatform.deterministic_unavailable(None) is None
    assert CudaPlatform.deterministic_unavailable(None) is None  # the Triton kernels
    assert "npu_fused_infer_attention_score" in NpuPlatform.deterministic_unavailable(None)


def test_model_runner_refuses_on_a_platform_without_kernels():
    from srt_ascend.model_executor.model_runner import ModelRunner
    from srt_ascend.platforms.cpu import CpuPlatform

    class NoKernels(CpuPlatform):
        def deterministic_unavailable(self) -> str | None:
            return "op X has no fixed-order variant"

    args = ServerArgs(enable_deterministic_inference=True, device="cpu")
    with pytest.raises(ValueError, match="not available on cpu: op X"):
        ModelRunner(args, NoKernels())


def differing_router_rows(router) -> int:
    """Rows of the router's scores over 1..40-row batches that differ from the row alone."""
    x = rand(2000, 256, seed=11)
    with torch.inference_mode():
        alone = torch.cat([router(x[i : i + 1])[0] for i in range(200)])
        got = torch.cat([router(x[i : i + n])[0] for i in range(0, 200, 5) for n in [5]])
        odd = torch.cat([router(x[i : i + 3])[0] for i in range(0, 198, 3)])
    return int((got != alone).any(-1).sum() + (odd != alone[:198]).any(-1).sum())


def test_router_weights_bit_identical_in_any_batch(moe, tiles):
    """The sigmoid of 8 scores per row: PyTorch computes a few trailing elements of a tensor
    with scalar code, the rest with vector code, and they differ in the last bit."""
    assert differing_router_rows(moe.gate) == 0


def test_control_router_weights_differ_without_padding(moe, tiles, monkeypatch):
    monkeypatch.setattr("srt_ascend.layers.moe.elementwise", lambda fn, x: fn(x))
    if differing_router_rows(moe.gate) == 0:
        pytest.skip("vector and scalar sigmoid agreed on these rows: no control")


# Row plans (layers/row_plan.py): the probe's verdict on kernels whose row invariance is known
# by construction, and the plans chosen for this CPU's real kernels checked call size by size.


def per_row(w: torch.Tensor):
    """A kernel that is row-invariant by construction: each row is its own one-row call."""
    return lambda rows: torch.cat([torch.nn.functional.linear(r[None], w) for r in rows])


def order_changes(w: torch.Tensor, when):
    """A kernel that adds a row's products in reversed order when `when(rows, position)`."""

    def fn(rows: torch.Tensor) -> torch.Tensor:
        out = per_row(w)(rows)
        for i in range(rows.shape[0]):
            if when(rows.shape[0], i):
                out[i] = torch.nn.functional.linear(rows[i].flip(-1), w.flip(-1))
        return out

    return fn


def test_probe_verdicts_on_kernels_of_known_invariance():
    w = row_plan.cancelling((24, 256), torch.float32, 1)
    x = row_plan.cancelling((64, 256), torch.float32, 2)
    wide, narrow = row_plan.RowPlan(1, 64), row_plan.RowPlan(1, 8)
    assert row_plan.holds(wide, per_row(w), x, 0)
    # another order past 8 rows: the wide plan fails, calls of at most 8 rows hold
    past_eight = order_changes(w, lambda n, i: n > 8)
    assert not row_plan.holds(wide, past_eight, x, 0)
    assert row_plan.holds(narrow, past_eight, x[:8], 0)
    # one row position of one call size: only every size at every position finds it
    one_spot = order_changes(w, lambda n, i: n == 37 and i == 29)
    assert not row_plan.holds(wide, one_spot, x, 0)
    # padded to 16 rows, a kernel that differs below 16 rows is never seen differing
    below_tile = order_changes(w, lambda n, i: n < 16)
    assert row_plan.holds(row_plan.FIXED_TILE, below_tile, x[:16], 0)


def test_choose_takes_the_widest_plan_that_holds_else_the_fixed_tile():
    w = row_plan.cancelling((24, 256), torch.float32, 3)

    def probe(threshold):
        x = row_plan.cancelling((64, 256), torch.float32, 4)
        kernel = order_changes(w, lambda n, i: n > threshold)
        return lambda rows: (kernel, x[:rows], 0)

    assert row_plan.choose(("test", 20), probe(20)) == row_plan.RowPlan(1, 16)
    assert row_plan.choose(("test", 40), probe(40)) == row_plan.RowPlan(1, 32)
    assert row_plan.choose(("test", 4), probe(4)) == row_plan.FIXED_TILE
    assert row_plan.choose(("test", 4), probe(64)) == row_plan.FIXED_TILE  # cached per key


def every_call_size_matches(fn, x: torch.Tensor, dim: int) -> bool:
    """Every call size 1..x rows, at the start and at the end of x, equals x's rows alone."""
    n = x.shape[dim]
    alone = torch.cat([fn(x.narrow(dim, i, 1)) for i in range(n)], dim)
    return all(
        torch.equal(fn(x.narrow(dim, start, size)), alone.narrow(dim, start, size))
        for size in range(1, n + 1)
        for start in {0, n - size}
    )


@pytest.mark.parametrize(
    "n_out,n_in,dtype",
    [(208, 256, BF16), (384, 128, BF16), (4608, 256, BF16), (8, 256, torch.float32)],
)
def test_chosen_linear_plan_is_row_invariant_at_every_call_size(tiles, n_out, n_in, dtype):
    """The shipped checkpoint's layouts (q_a+kv_a, q_b, the stacked experts, the float32
    router): whatever plan the probe chose on this CPU, linear's rows match at 1..80 rows
    (past the widest plan: several calls)."""
    w = rand(n_out, n_in, seed=n_in, dtype=dtype)
    x = row_plan.cancelling((80, n_in), dtype, 6)
    assert every_call_size_matches(lambda rows: gemm.linear(rows, w), x, 0)
    plan = row_plan.linear_plan(x, w, None)
    assert plan in (*row_plan.CANDIDATES, row_plan.FIXED_TILE)


def test_chosen_bmm_plans_are_row_invariant_at_every_call_size(tiles):
    """q_nope x W_UK and the MoE's down projections (a transposed view), bf16."""
    for a_shape, b in (
        ((8, 80, 32), rand(8, 32, 64, seed=7)),
        ((9, 70, 256), rand(9, 256, 256, seed=8).transpose(1, 2)),
    ):
        a = row_plan.cancelling(a_shape, BF16, 9)
        assert every_call_size_matches(lambda rows, b=b: gemm.bmm(rows, b), a, 1)


def test_batch_invariant_mode_never_switches_onednn(tiles, monkeypatch):
    """oneDNN's switch is process-wide: a toggle would change another thread's kernel."""

    def refuse(*_):
        raise AssertionError("oneDNN toggled in batch-invariant mode")

    monkeypatch.setattr(gemm, "_without_onednn", refuse)
    x, w = rand(3, 256, seed=1), rand(256, 256, seed=2)  # 3*256*256 MACs: MKL-sized
    gemm.linear(x, w)
    gemm.bmm(rand(8, 1, 32, seed=3), rand(8, 32, 64, seed=4))


def test_weights_past_the_probe_bound_keep_the_fixed_tile():
    def probe(rows):
        raise AssertionError("a weight past PROBE_MAX_WEIGHT was probed")

    big = row_plan.PROBE_MAX_WEIGHT + 1
    assert row_plan.choose(("test", "big"), probe, big) == row_plan.FIXED_TILE
