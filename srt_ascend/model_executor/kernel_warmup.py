"""Every kernel variant a server can launch, launched once before it says ready.

Triton compiles a kernel variant at its first launch (or loads it from its cache,
`TRITON_CACHE_DIR`, ~/.triton/cache by default: a later start with the same sources, Triton
and GPU compiles nothing). A variant is the kernel's launch constants plus the specialisation
of its arguments; the ops keep every value that follows a batch's lengths a plain,
unspecialised argument (query blocks, KV parts, row counts, index views), so what is left
is a small fixed set per server: the attention tile's height (a bucket of the longest query,
`q_len_buckets`), whether the KV is split, the model's dtypes and shapes, and the draft
lengths of acceptance. `warm_up_kernels` launches each of them through the real forward
path - so every op a forward reaches (KV store, attention, the deterministic GEMM, block
FP8's GEMM in every quantized linear and expert; at least one forward runs, whatever the
attention backend) meets the argument layouts serving gives it - and the ops outside
forwards (acceptance, request-table writes), over the padding row and slot. A request's
lengths then pick a variant, never create one (tests/unit/test_kernel_variants.py checks it
under the interpreter; tests/unit/test_fp8_warmup.py for a block-FP8 model).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from srt_ascend.layers.ops import spec_accept
from srt_ascend.model_executor.forward_batch import ForwardMode

# `runner` below is the ModelRunner that calls in (model_runner imports this module).


def warm_up_runs(runner) -> list[tuple[str, tuple]]:
    """What `warm_up_kernels` runs: ("extend", (query length, KV length)) per attention
    variant (one 1-token extend where attention has none), ("accept", (K,)) per draft
    length acceptance can run with, ("write", ())."""
    cfg = runner.config
    heads = cfg.num_attention_heads // runner.server_args.attn_tp_size
    lengths = runner.attn_backend.warm_up_lengths(heads, runner.context_len)
    runs = [("extend", (q, kv)) for q, kv in lengths if kv <= runner.context_len]
    if not runs:  # attention compiles nothing: one forward still reaches every linear's
        runs.append(("extend", (1, 1)))  # kernel (block FP8's GEMM, the same for any M)
    if runner.mtp is not None:  # adaptive K runs any 0..num_steps
        runs += [("accept", (k,)) for k in range(runner.server_args.speculative_num_steps + 1)]
    runs.append(("write", ()))
    return runs


@torch.inference_mode()
def warm_up_kernels(runner, progress: bool = True) -> int:
    """Launches every run of `warm_up_runs` (a tqdm bar on stderr) and waits for the device;
    returns how many ran. Writes only the padding slot 0 and request row 0's first
    position, which no request owns before the server starts."""
    runs = warm_up_runs(runner)
    for kind, args in tqdm(runs, desc="Compiling kernels", disable=not progress):
        if kind == "extend":
            _extend(runner, *args)
        elif kind == "accept":
            _accept(runner, *args)
        else:
            runner.req_to_token_pool.write([0], [0], torch.zeros(1, dtype=torch.int64), [1])
    runner.platform.synchronize()
    return len(runs)


def _extend(runner, q_len: int, kv_len: int) -> None:
    """One row extending `q_len` tokens at the end of `kv_len` positions (row 0, slot 0
    throughout), then each MTP layer over the same positions, and the LM head."""
    zeros = torch.zeros(q_len, dtype=torch.int64)
    fb = runner.build_forward_batch(ForwardMode.EXTEND, zeros, [0], [kv_len], [q_len], zeros)
    hidden = runner.forward_eager(fb)
    runner.compute_logits(hidden[-1:])
    for step in range(runner.mtp.num_layers if runner.mtp is not None else 0):
        draft = runner.build_forward_batch(
            ForwardMode.DRAFT_EXTEND, zeros, [0], [kv_len], [q_len], zeros
        )
        runner.compute_logits(runner.forward_eager(draft, step, hidden)[-1:])


def _accept(runner, k: int) -> None:
    """Both acceptance ops over one request with `k` drafts (float32 distributions)."""
    dev, vocab = runner.device, runner.vocab_size
    drafts = torch.zeros(1, k, dtype=torch.int64, device=dev)
    targets = torch.zeros(1, k + 1, dtype=torch.int64, device=dev)
    spec_accept.greedy_accept(drafts, targets)
    probs = torch.full((1, k + 1, vocab), 1.0 / vocab, device=dev)
    uniforms = torch.zeros(1, k + 1, device=dev)
    spec_accept.rejection_sample(drafts, probs[:, :k], probs, uniforms)


def compiled_variants() -> int:
    """Kernel variants compiled (or loaded from Triton's cache) in this process so far, over
    every Triton kernel of `layers/ops` imported: what a device check reads before and after
    serving (equal: nothing compiled after ready). 0 where no kernel module was imported or
    the kernels are interpreted."""
    import sys

    from srt_ascend.layers.ops import KERNEL_MODULES

    total = 0
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        for fn in vars(module).values() if module is not None else ():
            for caches in getattr(fn, "device_caches", {}).values():
                total += len(caches[0])  # (kernels by key, target, backend, binder)
    return total
