"""Kernel timings: Triton paged MLA attention vs the torch-native backend's math, and a captured
decode graph vs eager launches, at batch 1 / 8 / 32 and KV 512 / 4096 (DeepSeek-V3 shapes:
128 heads, kv_lora_rank 512, rope 64, bf16).

    python benchmark/kernels.py            # CUDA: kernels vs references, then timings
    python benchmark/kernels.py --check    # CPU: a tiny interpreter correctness pass
    python benchmark/kernels.py --cpu-gemm [--rows 1 2 4 8] [--json-out FILE]

On CPU the kernels run only under Triton's interpreter, so there are no timings to take:
the script checks the kernels against the references and says that timings need a GPU.
`benchmark/device_check.py` runs `check` and `bench_cuda` as part of the device check.

`--cpu-gemm`: the CPU's bf16 GEMM backends per shape of the shipped checkpoint (linear layers
and the absorbed-MLA / dense-MoE batched matmuls) at `rows` token rows: microseconds per call
with oneDNN (PyTorch's default for bf16) and with it disabled (`torch.backends.mkldnn`: MKL).
What `--cpu-small-gemm auto` (layers/linear.py) chooses between; rerun on a new CPU before
moving its 2^18 multiply-add threshold. The served A/B is `serving.py --configs off off@onednn`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

H, R, P = 128, 512, 64


def make_decode(batch: int, kv: int, device, dtype, h=H, r=R, p=P, q=1):
    """Rows of `kv` positions whose last `q` are queries (q > 1: verify rows of K = q - 1)."""
    slots = batch * kv + 64
    buf = torch.randn(slots, 1, r + p, device=device, dtype=dtype)
    r2t = torch.arange(64, slots, device=device).view(batch, kv)
    q_lat = torch.randn(batch * q, h, r, device=device, dtype=dtype)
    q_pe = torch.randn(batch * q, h, p, device=device, dtype=dtype)
    q_lens = torch.full((batch,), q, dtype=torch.int64, device=device)
    return (q_lat, q_pe, buf[..., :r], buf[..., r:], r2t, torch.arange(batch, device=device),
            torch.full((batch,), kv, device=device), q_lens,
            torch.arange(batch, device=device) * q, r ** -0.5)  # fmt: skip


H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOP_PER_S = 989e12  # dense bf16 tensor-core peak


def attention_floors_us(
    batch: int, kv: int, q: int = 1, h: int = H, r: int = R, p: int = P, elem_bytes: int = 2
) -> tuple[float, float]:
    """(HBM floor, compute floor) of MLA decode / verify attention in us on an H200: the KV
    cache read once per request (kv x (r + p) elements per row), and the two dots' multiply-adds
    (scores over r + p, the weighted sum over r) for every query token and head at bf16 peak."""
    hbm = batch * kv * (r + p) * elem_bytes / H200_HBM_BYTES_PER_S
    flops = 2 * batch * q * h * kv * ((r + p) + r)
    return hbm * 1e6, flops / H200_BF16_FLOP_PER_S * 1e6


def attention_splits(batch: int, kv: int, q: int = 1) -> int:
    """The KV parts the triton backend plans for `batch` rows of `kv` keys at DeepSeek-V3's
    heads (as in serving)."""
    from srt_ascend.layers.ops import mla_attention_triton as tri
    from srt_ascend.layers.ops.mla_attention import plan_kv_splits

    block_q, block_h = tri.tile_shape(H, q)
    return plan_kv_splits(batch, -(-q // block_q), -(-H // block_h), kv)


def cuda_time(fn, iters=50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # us


def bench_cuda() -> list[dict]:
    """Per (batch, KV length): Triton vs torch-native math, the HBM floor, graph vs eager (us)."""
    from srt_ascend.layers.ops import mla_attention_triton as tri

    rows = []
    for batch in (1, 8, 32):
        for kv in (512, 4096):
            args = make_decode(batch, kv, "cuda", torch.bfloat16)
            splits = attention_splits(batch, kv)
            buf = torch.cat([args[2], args[3]], dim=-1)

            def tri_fn(args=args, splits=splits):
                return tri.mla_attention(*args, max_q_len=1, num_kv_splits=splits)

            def torch_fn(args=args, buf=buf):  # torch_native's math: gather, bmm, softmax, bmm
                kvs = buf[args[4]].squeeze(2).float()
                q = torch.cat([args[0], args[1]], -1).float()
                s = torch.softmax(torch.bmm(q, kvs.transpose(1, 2)) * args[9], -1)
                return torch.bmm(s, kvs[..., :R]).to(args[0].dtype)

            t_tri, t_torch = cuda_time(tri_fn), cuda_time(torch_fn)
            graph = torch.cuda.CUDAGraph()
            tri_fn()
            with torch.cuda.graph(graph):
                tri_fn()
            hbm, compute = attention_floors_us(batch, kv)
            rows.append({
                "batch": batch, "kv": kv, "splits": splits, "triton_us": t_tri,
                "torch_us": t_torch, "hbm_floor_us": hbm, "compute_floor_us": compute,
                "vs_floor": t_tri / max(hbm, compute), "graph_us": cuda_time(graph.replay),
            })  # fmt: skip
    return rows


def check(device: str) -> list[dict]:
    """The decode kernel against its reference on `device`: small fp32 shapes (on CPU under
    Triton's interpreter, which must be chosen before the kernel module is first imported),
    and on CUDA also DeepSeek-V3's shapes in bf16 with split KV."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from srt_ascend.layers.ops import mla_attention_triton as tri
    from srt_ascend.layers.ops.mla_attention import mla_attention_reference

    cases = [(1, 100, torch.float32, dict(h=4, r=32, p=8), 2, 1e-5)]
    cases += [(3, 40, torch.float32, dict(h=4, r=32, p=8, q=3), 1, 1e-5)]
    if device == "cuda":
        cases += [(8, 3000, torch.bfloat16, {}, 8, 2e-2)]
        # fp32 at DeepSeek-V3's shapes: true float32 dots (input_precision "ieee") stay within
        # 1e-5 of the reference; TF32 dots (10 mantissa bits) miss it by ~1e-3. Verify rows
        # (K = 3: 4 queries, one query per program at 128 heads) check the query blocks.
        cases += [(4, 1000, torch.float32, {}, 2, 1e-5)]
        cases += [(4, 1000, torch.float32, dict(q=4), 1, 1e-5)]
        cases += [(4, 1000, torch.bfloat16, dict(q=4), 2, 2e-2)]
    rows = []
    for batch, kv, dtype, shape, splits, tol in cases:
        args = make_decode(batch, kv, device, dtype, **shape)
        q = shape.get("q", 1)
        out = tri.mla_attention(*args, max_q_len=q, num_kv_splits=splits)
        err = (out.float() - mla_attention_reference(*args).float()).abs().max().item()
        kind = "decode" if q == 1 else f"verify q{q}"
        name = f"{kind} b{batch} kv{kv} {str(dtype)[6:]} splits {splits}"
        rows.append({"case": name, "max_abs_err": err, "ok": err < tol})
    return rows


def check_batch_invariant(device: str) -> list[dict]:
    """`--enable-deterministic-inference`'s kernels on `device` (CPU: the interpreter, small
    shapes): the fixed-tile GEMM (`matmul_triton`) and the attention kernel with fixed KV parts
    give a row (a query) the same bits inside products (batches) of other sizes and layouts;
    each also against its reference. Rows with ok None are controls (cuBLAS, torch's
    rms_norm / log_softmax on this device): they report whether the op the flag avoids or
    relies on is batch-invariant here. Row: case, max_abs_err (vs reference; 0 for controls),
    differing (rows whose bits change with the batch), ok."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.nn.functional as F

    from srt_ascend.layers.ops import matmul_triton as mm
    from srt_ascend.layers.ops import mla_attention_triton as tri
    from srt_ascend.layers.ops.mla_attention import mla_attention_reference

    gen = torch.Generator().manual_seed(0)
    k, n, m = (2048, 1536, 300) if device == "cuda" else (96, 80, 70)
    rows = []

    def windows(fn, x) -> int:
        """Rows of x whose fn differs alone / in a short window from inside the whole x."""
        whole = fn(x)
        bad = 0
        for r in (0, 1, 7, m // 2, m - 1):
            bad += not torch.equal(fn(x[r : r + 1])[0], whole[r])
            lo = max(0, r - 2)
            bad += not torch.equal(fn(x[lo : lo + 5])[r - lo], whole[r])
        return bad

    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-1)):
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        err = (mm.linear(x, w).float() - F.linear(x.float(), w.float())).abs().max().item()
        bad = windows(lambda v, w=w: mm.linear(v, w), x)
        name = f"triton linear {str(dtype)[6:]} [{m}, {k}] x [{n}, {k}]"
        rows.append(
            {"case": name, "max_abs_err": err, "differing": bad, "ok": not bad and err < tol}
        )
        wt = w.view(4, n // 4, k).transpose(1, 2)
        xb = x.view(1, m, k).expand(4, m, k)
        err = (mm.bmm(xb, wt).float() - torch.bmm(xb.float(), wt.float())).abs().max().item()
        bad = windows(lambda v, wt=wt: mm.bmm(v.unsqueeze(0).expand(4, -1, -1), wt)[1], x)
        name = f"triton bmm {str(dtype)[6:]} 4 x [{m}, {k}] x [{k}, {n // 4}]"
        rows.append(
            {"case": name, "max_abs_err": err, "differing": bad, "ok": not bad and err < tol}
        )
        if device == "cuda":  # controls: what the flag replaces / relies on
            for op, fn in (
                ("cuBLAS F.linear", lambda v, w=w: F.linear(v, w)),
                ("torch rms_norm", lambda v: F.rms_norm(v.float(), (k,), eps=1e-6)),
                ("torch log_softmax", lambda v: torch.log_softmax(v.float(), -1)),
            ):
                bad = windows(fn, x)
                name = f"control {op} {str(dtype)[6:]}"
                rows.append({"case": name, "max_abs_err": 0.0, "differing": bad, "ok": None})

    # attention: the last q queries of a kv-key row as a verify row among others, as one-query
    # rows (expanded verify), each alone as a decode, and second in another batch
    shape = dict(h=16, r=512, p=64) if device == "cuda" else dict(h=4, r=32, p=8)
    kv, q = (1500, 4) if device == "cuda" else (150, 3)
    for dtype in (torch.float32, torch.bfloat16):
        args = list(make_decode(3, kv, device, dtype, q=q, **shape))
        args[6] = torch.tensor([kv, kv // 2, kv - 7], device=device)
        size = 256 if device == "cuda" else 64

        def run(batch, args=args, size=size):
            """batch: (request row, seq_len, its query indices) per batch row."""
            qi = torch.tensor([i for _, _, idx in batch for i in idx], device=device)
            ql = torch.tensor([len(idx) for _, _, idx in batch], device=device)
            seq_lens = [n for _, n, _ in batch]
            call = (args[0][qi], args[1][qi], args[2], args[3], args[4],
                    torch.tensor([r for r, _, _ in batch], device=device),
                    torch.tensor(seq_lens, device=device), ql, torch.cumsum(ql, 0) - ql,
                    args[9])  # fmt: skip
            out = tri.mla_attention(
                *call, max_q_len=int(ql.max()), kv_split_size=size,
                num_kv_splits=tri.invariant_kv_splits(max(seq_lens), size),
            )  # fmt: skip
            return out, (out.float() - mla_attention_reference(*call).float()).abs().max().item()

        lens = args[6].tolist()
        own = [list(range(r * q, r * q + q)) for r in range(3)]  # row r's queries
        verify, err = run([(r, lens[r], own[r]) for r in range(3)])
        subject = verify[:q]
        expand, _ = run([(0, kv - q + 1 + i, [i]) for i in range(q)])
        alone = torch.cat([run([(0, kv - q + 1 + i, [i])])[0] for i in range(q)])
        longer, _ = run([(1, lens[1], own[1]), (0, kv, own[0])])
        bad = sum(not torch.equal(o, subject) for o in (expand, alone, longer[q:]))
        name = f"triton attention fixed parts {str(dtype)[6:]} kv{kv} verify/expand/decode"
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        rows.append(
            {"case": name, "max_abs_err": err, "differing": bad, "ok": not bad and err < tol}
        )
    return rows


def resources() -> list[dict]:
    """Shared memory, registers and spills of every attention kernel compiled so far in this
    process (run `check` and `bench_cuda` first); ok: within sm_90's block limit, no spills."""
    from srt_ascend.layers.ops import mla_attention_triton as tri

    rows = tri.compiled_resources()
    for r in rows:
        shared, spills = r["shared_bytes"], r["spills"]
        r["ok"] = None if shared is None else shared <= tri.SHARED_MEMORY_BUDGET and not spills
    return rows


def host_cost(capability: int = 90, calls: int = 100, rounds: int = 7) -> list[dict]:
    """Host work of one eager attention call (us): the launch function's whole Python path
    (plan, buffers, argument binding, the merge's launch where the KV is split) at
    DeepSeek-V3's shapes in bf16, measured on CPU through `triton_offline.compiling_for` (each
    variant compiles for `capability` once; launches then run everything but the device's
    work). CPU time of this thread, the best of `rounds` rounds of `calls` calls (robust to
    other processes sharing the cores). Rows: batch, kv, splits, us per call."""
    from srt_ascend.layers.ops import mla_attention_triton as tri
    from srt_ascend.layers.ops import triton_offline

    rows = []
    with triton_offline.compiling_for(capability, triton_offline.jit_kernels([tri])):
        for batch, kv, splits in ((1, 4096, 1), (1, 4096, 4), (32, 4096, 1), (32, 4096, 4)):
            args = make_decode(batch, kv, "cpu", torch.bfloat16)
            call = lambda a=args, s=splits: tri.mla_attention(*a, max_q_len=1, num_kv_splits=s)  # noqa: E731
            for _ in range(10):
                call()
            best = float("inf")
            for _ in range(rounds):
                t0 = time.thread_time()
                for _ in range(calls):
                    call()
                best = min(best, (time.thread_time() - t0) / calls * 1e6)
            rows.append(dict(batch=batch, kv=kv, splits=splits, us=best))
    return rows


def gemm_shapes(cfg) -> dict[str, tuple]:
    """name -> ("linear", N, K) or ("bmm", batch, K, N) for one decoder layer, MTP, LM head."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    e = cfg.n_routed_experts + 1  # + the stacked shared expert
    inter = cfg.moe_intermediate_size
    return {
        "q_a+kv_a": ("linear", cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        "q_b": ("linear", heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank),
        "w_kc (bmm)": ("bmm", heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
        "w_vc (bmm)": ("bmm", heads, cfg.kv_lora_rank, cfg.v_head_dim),
        "o_proj": ("linear", h, heads * cfg.v_head_dim),
        "expert gate+up": ("linear", 2 * inter, h),
        "expert down": ("linear", h, inter),
        "dense MoE gate+up": ("linear", e * 2 * inter, h),
        "dense MoE down (bmm)": ("bmm", e, inter, h),
        "eh_proj": ("linear", h, 2 * h),
        "lm_head": ("linear", cfg.vocab_size, h),
    }


def per_call_us(fn, n: int = 300) -> float:
    """Mean wall time of fn in us over n calls, after 20 warm-up calls."""
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def shape_table(cfg, rows: list[int]) -> list[dict]:
    """Per GEMM shape and row count: us per call with oneDNN and with MKL (bf16)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for name, spec in gemm_shapes(cfg).items():
        for m in rows:
            if spec[0] == "linear":
                _, n, k = spec
                x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
                x, w = x.bfloat16(), w.bfloat16()
                fn = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
            else:
                _, b, k, n = spec
                x = torch.randn(b, m, k, generator=gen).bfloat16()
                w = torch.randn(b, k, n, generator=gen).bfloat16()
                fn = lambda x=x, w=w: torch.bmm(x, w)  # noqa: E731
            times = {}
            for onednn in (True, False):
                with torch.backends.mkldnn.flags(enabled=onednn):
                    times[onednn] = per_call_us(fn)
            out.append(
                dict(
                    gemm=name,
                    rows=m,
                    onednn_us=round(times[True], 1),
                    mkl_us=round(times[False], 1),
                )
            )
    return out


def cpu_gemm(model_path: str, rows: list[int], json_out: str | None) -> None:
    from srt_ascend.models.loader import load_config

    torch.set_grad_enabled(False)
    shapes = shape_table(load_config(model_path), rows)
    print("| GEMM | rows | oneDNN us | MKL us |\n| --- | --- | --- | --- |")
    for r in shapes:
        print(f"| {r['gemm']} | {r['rows']} | {r['onednn_us']} | {r['mkl_us']} |")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(shapes=shapes), f, indent=1)


def main() -> int:
    from srt_ascend.server_args import SHIPPED_MODEL

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="CPU interpreter check only")
    parser.add_argument("--host-cost", action="store_true", help="attention launch host us")
    parser.add_argument("--cpu-gemm", action="store_true", help="CPU bf16 GEMMs: oneDNN vs MKL")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="--cpu-gemm")
    parser.add_argument("--model-path", default=SHIPPED_MODEL, help="--cpu-gemm's shapes")
    parser.add_argument("--json-out", default=None, help="--cpu-gemm's table")
    a = parser.parse_args()
    if a.host_cost:
        for r in host_cost():
            print(f"batch {r['batch']} kv {r['kv']} splits {r['splits']}: {r['us']:.1f} us/call")
        return 0
    if a.cpu_gemm:
        cpu_gemm(a.model_path, a.rows, a.json_out)
        return 0
    device = "cpu" if a.check or not torch.cuda.is_available() else "cuda"
    checks = check(device)
    for row in checks:
        print(
            f"{row['case']}: max abs err {row['max_abs_err']:.2e} {'ok' if row['ok'] else 'FAIL'}"
        )
    if device == "cpu":
        print("timings need a CUDA GPU: run `python benchmark/kernels.py` there")
    else:
        print("batch  kv    triton_us  torch_us  ratio  hbm_floor  compute_floor  vs_floor  "
              "graph_us  graph_vs_eager")  # fmt: skip
        for r in bench_cuda():
            print(f"{r['batch']:5d} {r['kv']:5d} {r['triton_us']:10.1f} {r['torch_us']:9.1f} "
                  f"{r['torch_us'] / r['triton_us']:6.2f} {r['hbm_floor_us']:10.1f} "
                  f"{r['compute_floor_us']:14.1f} {r['vs_floor']:9.2f} "
                  f"{r['graph_us']:9.1f} {r['triton_us'] / r['graph_us']:14.2f}")  # fmt: skip
        for r in resources():
            print(f"{r['tile']}: shared {r['shared_bytes']} B, {r['registers']} registers, "
                  f"{r['spills']} spills {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
