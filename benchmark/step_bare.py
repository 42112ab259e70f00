"""The bare decode forward that `step_overhead.py` sets beside the served step: a ModelRunner
with the server's settings in a child process's main thread, replaying the step's forwards back
to back (plain: the decode forward and the least step around it; MTP: one round's forwards)."""

from __future__ import annotations

import multiprocessing
import statistics
import time

import torch


def server_flags(a) -> list[str]:
    """The server's flags for a run at concurrencies `a.buckets` (graphs at each of them;
    `a.compile`: compiled; `a.mtp_k`: MTP with that many drafts; `a.overlap` False:
    --disable-overlap-schedule, True: --enable-overlap-schedule, which eager CPU forwards
    need, None: the platform's default), then `a.server_flags`."""
    buckets = [str(c) for c in a.buckets]
    flags = ["--context-length", str(a.context_length)]
    flags += ["--max-running-requests", str(max(4, *a.buckets))]
    flags += ["--cuda-graph-bs", *buckets, "--enable-cpu-graph"]
    if a.compile:
        flags += ["--enable-torch-compile", "--torch-compile-max-bs", str(max(a.buckets))]
    if a.mtp_k:
        flags += ["--speculative-algorithm", "MTP", "--speculative-num-steps", str(a.mtp_k)]
    if a.overlap is not None:
        flags += ["--enable-overlap-schedule" if a.overlap else "--disable-overlap-schedule"]
    return flags + a.server_flags


# ---- bare forward --------------------------------------------------------------------------


def bare(a) -> dict:
    """Per concurrency C in `a.buckets`: ms of the step's forwards back to back in this
    process's main thread (graph replays). Plain: one decode forward over C requests with KV
    of the served mean length, and the least step around it (batch build + forward + argmax
    read); compiled, also the forward without dynamo's guard evaluation. MTP: one round's
    forwards (`MTPDecoder._padding_step`: the K-1 draft steps, the verify forward with its
    logits, the MTP pass and its drafting head) over C padding requests whose context is the
    served mean length."""
    import srt_ascend.speculative.mtp_decoder  # noqa: F401  (registers "MTP")
    from srt_ascend.decoding import DecoderHandles, create_decoder
    from srt_ascend.model_executor.model_runner import ModelRunner
    from srt_ascend.platforms import get_platform
    from srt_ascend.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", a.model, *server_flags(a)])
    args = args.for_device("cpu")
    platform = get_platform("cpu")
    # the server's thread count (tp_ranks.build_scheduler's rule: a lone rank leaves a core
    # to its other threads), not this process's default: on a loaded host two spinning
    # intra-op threads make the bare forward many times the served one
    threads = args.num_threads or platform.default_threads(1)
    if threads:
        torch.set_num_threads(threads)
    runner = ModelRunner(args, platform)
    decoder = create_decoder(args, DecoderHandles(runner, None, None, []))
    prefix = a.input_len + a.output_len // 2  # the served mean KV length
    t0 = time.perf_counter()
    runner.capture_graphs(decoder.graph_kinds(), smallest_kv_window=_pow2_at_least(prefix + 1))
    while runner.compile_next_graph():
        pass
    out = {"compile_s": round(time.perf_counter() - t0, 1)}
    # built and compiled outside inference mode, as the server does (a runner whose pool and
    # buffers are inference tensors cannot be packaged); the forwards run inside it
    with torch.inference_mode():
        return _bare_forwards(a, runner, decoder, prefix, out)


def _bare_forwards(a, runner, decoder, prefix: int, out: dict) -> dict:
    """`bare`'s timings over a built runner, in inference mode."""
    from srt_ascend.model_executor.forward_batch import ForwardMode

    if a.mtp_k:
        from srt_ascend.speculative import mtp_start

        mtp_start.PROFILE_CONTEXT = prefix
        for n in a.buckets:
            step = lambda n=n: decoder._padding_step(n, a.mtp_k)  # noqa: E731
            out[n] = {
                "forward_ms": median_ms(step, a.iters),
                "forward_cpu_ms": median_ms(step, a.iters, time.thread_time),
            }
        return out
    kind = decoder.kind
    g = torch.Generator().manual_seed(0)
    pool = runner.kv_pool
    all_rows = runner.req_to_token_pool.alloc(max(a.buckets))
    all_locs = []
    for row in all_rows:
        slots = runner.allocator.alloc(prefix + 1)
        runner.req_to_token_pool.write([row], [0], slots, [prefix + 1])
        for layer in range(runner.num_layers):
            c = torch.randn(prefix, pool.kv_lora_rank, generator=g)
            k_pe = torch.randn(prefix, pool.qk_rope_head_dim, generator=g)
            pool.set_mla_kv_buffer(layer, slots[:prefix], c, k_pe)
        all_locs.append(slots[prefix:])
    for n in a.buckets:
        rows, loc = all_rows[:n], torch.cat(all_locs[:n])

        def batch(rows=rows, loc=loc, n=n):
            return runner.build_forward_batch(
                ForwardMode.DECODE, [5] * n, rows, [prefix + 1] * n, [1] * n, loc
            )

        fb = batch()

        def forward(fb=fb):  # the graph's LM head included
            runner.forward_logits(fb, kind)

        def least_step(batch=batch):
            _, logits = runner.forward_logits(batch(), kind)
            logits.argmax(dim=-1).tolist()

        res = {
            name: median_ms(fn, a.iters)
            for name, fn in (("forward_ms", forward), ("least_step_ms", least_step))
        }
        res["forward_cpu_ms"] = median_ms(forward, a.iters, time.thread_time)
        if a.compile and not a.matrix:  # dynamo's guards: the forward without them, then with
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                res["forward_no_guards_ms"] = median_ms(forward, a.iters)
            res["forward_again_ms"] = median_ms(forward, a.iters)
        out[n] = res
    return out


def bare_child(a, queue) -> None:
    """`bare` in a fresh process's main thread (each configuration its own process: no
    compiled state or thread setting carries over); the result (or the error) to `queue`."""
    try:
        queue.put(bare(a))
    except BaseException as e:
        queue.put({"error": repr(e)})
        raise


def bare_in_child(a) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=bare_child, args=(a, queue))
    proc.start()
    res = queue.get()
    proc.join()
    if "error" in res:
        raise RuntimeError(f"bare run failed: {res['error']}")
    return res


def _pow2_at_least(n: int) -> int:
    w = 64
    while w < n:
        w *= 2
    return w


def median_ms(fn, iters: int, clock=time.perf_counter) -> float:
    """Median time of `fn` in ms over `iters` calls, after 10 warm-up calls: wall time, or
    with `clock=time.thread_time` this thread's CPU time (what a loaded host's descheduling
    does not inflate; the forward's whole CPU time where its ops run on one intra-op
    thread, the server's default on 2 cores)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return round(statistics.median(times) * 1e3, 3)
