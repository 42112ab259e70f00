"""Device discipline of the step path, checked without an accelerator.

Under `FakeTensorMode` the model, its KV pools and the request table live on an accelerator
that does not exist here (the `lazy` device type: unlike a fake `cuda` device it needs no CUDA
runtime for in-place ops): every op runs on shapes only, a host tensor meeting a device tensor
raises `FakeTensorDeviceMismatchError`, and any read of a device value (`.tolist()`, `.item()`,
`bool(t)`) raises as well. `Strict` also refuses the host syncs fake tensors allow: a blocking
host-to-device copy (`torch.tensor(x, device=...)`, `.to(device)`) and a host index tensor into
a device tensor. The only read the step path may make goes through `utils.HOST_READS`, which
the test answers with zeros and counts. Prefill, the MTP draft pass after it, plain decode, the
draft chain, both verify layouts and the acceptance rules (greedy, rejection sampling and block
verification, with penalties, seeds and logprobs; adaptive K, 0 included) run this way (an
MTP round issues every forward, the next d_1's included, before its one read), and
so does the MoE all-to-all dispatch (`--moe-a2a-backend all_to_all`) on one rank. The
scheduler's own steps run the same way over the real KV bookkeeping (`RealHost` runs host-only
ops for real), with prompts of different lengths in one prefill.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from srt_ascend.decoding.base import DecoderHandles, create_decoder
from srt_ascend.distributed import SINGLE
from srt_ascend.layers.moe_all_to_all import AllToAllDispatch
from srt_ascend.managers.io_struct import TokenizedGenerateReq
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.managers.scheduler import Scheduler
from srt_ascend.managers.stop_checker import StopChecker
from srt_ascend.model_executor import model_runner as model_runner_module
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.models import loader
from srt_ascend.platforms.base import Platform
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import SHIPPED_MODEL, ServerArgs
from srt_ascend.speculative import draft_length, mtp_decoder  # noqa: F401  (registers "MTP")
from srt_ascend.utils import HOST_READS, to_device

DEVICE = torch.device("lazy", 0)


class Strict(TorchDispatchMode):
    """Refuses blocking host-to-device copies and host tensors indexing device tensors.
    Real host tensors (seeded draws come from real CPU generators) enter as fakes."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args, kwargs = tree_map_only(
            torch.Tensor,
            lambda t: t if isinstance(t, FakeTensor) else self.fake.from_tensor(t),
            (args, kwargs),
        )
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._to_copy.default:
            src, dst = args[0].device, kwargs.get("device")
            if src.type == "cpu" and dst is not None and dst.type != "cpu":
                assert kwargs.get("non_blocking"), f"blocking host-to-device copy in {func}"
        elif any(t.device == DEVICE for t in tensors):
            host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            assert not host, f"host tensor {tuple(host[0].shape)} meets the device in {func}"
        return func(*args, **kwargs)


class FakeCuda(Platform):
    """A CUDA device as FakeTensorMode models it: graphs off, a fixed memory size."""

    name = "cuda"
    graphs_by_default = False

    @staticmethod
    def is_available() -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return DEVICE

    def mem_get_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 30


def _load_then_place(model_path, dtype, device, load_mtp, config, tp, quantization=None):
    """The real loader reads the checkpoint on the host (outside the fake mode), then the
    weights are placed on the fake device the way load_model places them."""
    with unset_fake_temporarily():
        model, mtp = loader.load_model(model_path, dtype, "cpu", load_mtp, config, tp, quantization)
    for m in (model, mtp):
        if m is not None:
            m.to(device)
            loader.fuse_weights(m)
    return model, mtp


class Counted:
    """HOST_READS.read for fake tensors, counted. An acceptance verdict (`MTPDecoder._read`:
    [B, K+2] int64, the accepted drafts then the emitted tokens, -1 past them) is answered
    with accept lengths 0..K that vary by row and read, so multi-token commits, their logprobs
    and the freeing of fewer rejected slots run; every other read is answered with zeros."""

    def __init__(self) -> None:
        self.count = 0
        self.accepted = 0  # drafts accepted in the verdicts answered
        self.events: list[str] = []  # "read", and "forward" where a test logs the forwards

    def __call__(self, t: torch.Tensor) -> list:
        self.count += 1
        self.events.append("read")
        if t.dtype == torch.int64 and t.dim() == 2 and t.shape[1] >= 3:
            return self._verdict(*t.shape)
        return _zeros(list(t.shape))

    def _verdict(self, batch: int, width: int) -> list[list[int]]:
        k, rows = width - 2, []
        for i in range(batch):
            n = (self.count + i) % (k + 1)
            self.accepted += n
            rows.append([n] + [11 + j for j in range(n + 1)] + [-1] * (k - n))
        return rows


def _zeros(shape: list[int]):
    return [0 if len(shape) == 1 else _zeros(shape[1:]) for _ in range(shape[0])]


class TableKV:
    """A KVHandle over the runner's request table: slots from a counter (the real KVBook does
    the same writes through ReqToTokenPool.write; its bookkeeping is host-only)."""

    page_size = 1

    def __init__(self, pool) -> None:
        self.pool, self.next = pool, 1

    def alloc_running(self, reqs, n):
        loc = torch.arange(self.next, self.next + n * len(reqs))
        self.next += n * len(reqs)
        self.pool.write(
            [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], loc, [n] * len(reqs)
        )
        for r in reqs:
            r.alloc_len = r.kv_len + n
        return reqs, loc

    def free_positions(self, req, lo, hi) -> None:
        pass

    def free_positions_many(self, reqs, los, his) -> None:
        pass


def _requests() -> list[Req]:
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=64),
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=64),
        SamplingParams(temperature=1.0, top_k=5, seed=7, max_new_tokens=64),
        SamplingParams(
            temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3, min_new_tokens=9
        ),
    ]
    reqs = []
    for i, p in enumerate(params):
        p.normalize()
        reqs.append(
            Req(
                f"r{i}",
                [5 + i, 17, 33, 81 + i, 2],
                p,
                return_logprob=i % 2 == 1,
                top_logprobs_num=3 * (i % 2),
            )
        )
    return reqs


def _commit(req, tokens, logprobs=None) -> None:
    req.output_ids.extend(tokens)


def _fake_cuda_args(**kw) -> ServerArgs:
    """Checked server args of the shipped checkpoint on the fake CUDA device (float32, the
    torch_native attention, 8 requests over 512 KV tokens, context 128), plus `kw`."""
    args = ServerArgs(
        model_path=SHIPPED_MODEL,
        dtype="float32",
        device="cuda",
        attention_backend="torch_native",
        max_running_requests=8,
        max_total_tokens=512,
        context_length=128,
        **kw,
    )
    args.check()
    return args


@pytest.mark.parametrize(
    "algorithm, verify, k, extra",
    [
        ("NONE", None, 0, {}),
        ("MTP", "expand", 1, {}),
        ("MTP", "expand", 3, {}),
        ("MTP", "fia", 2, {}),
        (
            "MTP",
            "fia",
            3,
            # adaptive K profiles every (bucket, K) first: one bucket, the batch's, is enough
            {
                "speculative_accept_method": "block",
                "speculative_adaptive": True,
                "cuda_graph_bs": (4,),
            },
        ),
    ],
)
def test_step_path_stays_on_device(monkeypatch, algorithm, verify, k, extra):
    monkeypatch.setattr(model_runner_module, "load_model", _load_then_place)
    if extra.get("speculative_adaptive"):
        _fix_profiled_costs(monkeypatch)
    reads = Counted()
    monkeypatch.setattr(HOST_READS, "read", reads)
    spec = algorithm == "MTP"
    args = _fake_cuda_args(
        speculative_algorithm=algorithm if spec else None,
        speculative_num_steps=max(k, 1),
        speculative_verify=verify,
        disable_cuda_graph=True,
        **extra,
    )
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:  # the checkpoint is read on the host
        runner = model_runner_module.ModelRunner(args, FakeCuda())
        assert next(runner.model.parameters()).device == DEVICE
        with Strict(fake):
            _run_steps(runner, args, reads)


def _run_steps(runner, args, reads: Counted) -> None:
    decoder = create_decoder(
        args, DecoderHandles(runner, TableKV(runner.req_to_token_pool), _commit, [1])
    )
    decoder.calibrate()  # adaptive K: the step forwards it profiles, over padding requests
    reqs = _requests()
    _prefill(runner, decoder, reqs)
    # decode steps: exactly one read each, plus one when some request returns logprobs
    committed = sum(len(r.output_ids) for r in reqs)
    for _ in range(3):
        before = reads.count
        stepped = decoder.step(reqs)
        assert stepped == reqs
        assert reads.count - before == 2
    for r in reqs:
        r.return_logprob = False
    before = reads.count
    decoder.step(reqs)
    assert reads.count - before == 1
    committed = sum(len(r.output_ids) for r in reqs) - committed
    assert committed == 4 * len(reqs) + reads.accepted  # verdicts of several tokens committed
    if args.speculative_algorithm == "MTP":
        assert reads.accepted > 0
        _check_round_order(decoder, runner, reqs, reads)


def _fix_profiled_costs(monkeypatch) -> None:
    """Adaptive K's start profile runs its forwards (their discipline is checked), but the
    times it measures over fake tensors follow the machine's load, and a profile in which
    drafts did not pay chose K = 0 throughout (nothing accepted). Its table is replaced by
    one where they pay, far above any real step: observed steps then scale every entry by
    the same floor, and the choice no longer depends on timing."""
    real = draft_length.profile_costs

    def profile(buckets, max_k, run_step_forwards, synchronize):
        real(buckets, max_k, run_step_forwards, synchronize)
        return {(b, k): 1.0 + 0.25 * k for b in buckets for k in range(max_k + 1)}

    monkeypatch.setattr(draft_length, "profile_costs", profile)


def _check_round_order(decoder, runner, reqs, reads: Counted) -> None:
    """An MTP round is device-resident: every forward of a step (the draft chain, the verify,
    the MTP pass after it that drafts the next d_1) is issued before its one host read, so
    nothing from the verify to the next round's d_1 waits for the host. A batch with a
    penalised request drafts its d_1 after the commit (the penalty counts are the committed
    tokens'): a forward follows the read there."""
    run = runner._run

    def logged(*args, **kwargs):
        reads.events.append("forward")
        return run(*args, **kwargs)

    runner._run = logged
    try:
        for penalised in (True, False):
            if not penalised:  # the last penalised request loses its penalties
                for r in reqs:
                    r.sampling_params.repetition_penalty = 1.0
                    r.sampling_params.frequency_penalty = 0.0
            for _ in range(2):
                reads.events.clear()
                drafts = decoder.num_drafts
                decoder.step(reqs)
                events = reads.events
                assert events.count("read") == 1
                after = events[events.index("read") :]
                if not penalised:
                    assert "forward" not in after, events
                elif decoder.num_drafts > drafts:  # a round with drafts (adaptive K: not 0)
                    assert "forward" in after, events
    finally:
        runner._run = run


def test_all_to_all_dispatch_reads_only_its_split_sizes(monkeypatch):
    """`--moe-a2a-backend all_to_all`'s dispatch and combine on device tensors make one host
    read, the split sizes. (A group of one rank: its all-to-alls are the identity, so what
    runs is the bookkeeping around them: counts, order, expert ids, the weighted combine.)"""
    reads = Counted()
    monkeypatch.setattr(HOST_READS, "read", reads)
    dispatch = AllToAllDispatch(SINGLE, 8)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, Strict(fake):
        x = torch.randn(5, 16, device=DEVICE)
        weights = torch.rand(5, 2, device=DEVICE)
        ids = torch.randint(0, 8, (5, 2), device=DEVICE)
        out = dispatch.run(x, weights, ids, lambda rows, local: rows * local.unsqueeze(1))
    assert out.shape == (5, 16) and out.device == DEVICE
    assert reads.count == 1


class RealHost(Strict):
    """`Strict` over the device, while ops over host tensors only run for real: the host
    bookkeeping (the allocator, the request table's host mirror, the radix tree, the
    scheduler's lists) keeps real values it can read, as it does beside a real device.
    `checking` is off while the runner is built (loading places weights with blocking
    copies, which serving never runs)."""

    checking = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        devices.add(torch.device(kwargs.get("device", "cpu")).type)
        if devices == {"cpu"} and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if not self.checking:
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


RAGGED_PROMPTS = ([5, 17, 33, 81, 2, 9, 40], [6, 17], [7, 17, 33, 82, 2], [8] + [3] * 8)


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("NONE", {}),
        ("NONE", {"disable_overlap_schedule": True}),
        ("MTP", {"speculative_num_steps": 2, "speculative_verify": "expand"}),
        ("MTP", {"speculative_num_steps": 3, "speculative_verify": "fia"}),
        ("MTP", {"speculative_num_steps": 2, "disable_overlap_schedule": True}),
    ],
)
def test_scheduler_steps_stay_on_device(monkeypatch, algorithm, extra):
    """The scheduler's own steps over the real KV bookkeeping (KVBook, the allocator, the
    radix cache, the request table's host mirror): a prefill of prompts of four different
    lengths (ragged query rows; a chunk of the last one, whose rest prefills next), the first
    tokens and the MTP pass, then decode steps, each making only its counted host reads.
    Overlapped (the default), a step launches the next decode step (an MTP round: its
    positions, lengths and slots gathered on the device from the round in flight, and a
    seeded request's streams picked there by its accept length) before it reads the one in
    flight: still one read per step, the first launch none, the last read when the step in
    flight is finished."""
    monkeypatch.setattr(model_runner_module, "load_model", _load_then_place)
    if extra.get("speculative_adaptive"):
        _fix_profiled_costs(monkeypatch)
    reads = Counted()
    monkeypatch.setattr(HOST_READS, "read", reads)
    args = _fake_cuda_args(
        speculative_algorithm=None if algorithm == "NONE" else algorithm,
        chunked_prefill_size=20,
        disable_cuda_graph=True,
        **extra,
    )
    outputs = []
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, RealHost(fake) as strict:
        runner = model_runner_module.ModelRunner(args, FakeCuda())
        assert not isinstance(runner.req_to_token_pool.host, FakeTensor)
        strict.checking = True
        scheduler = Scheduler(args, runner, StopChecker(None, [1]), outputs.extend)
        for i, prompt in enumerate(RAGGED_PROMPTS):
            params = SamplingParams(temperature=0.0, max_new_tokens=6)
            if i == 1:  # seeded sampling: an overlapped round picks its streams on the device
                params = SamplingParams(temperature=0.9, top_k=5, seed=3, max_new_tokens=6)
            params.normalize()
            scheduler.handle(TokenizedGenerateReq(f"r{i}", prompt, params))
        while scheduler.chunked_req is not None or scheduler.waiting:
            before = reads.count
            scheduler.step()  # prefill: one read, the first tokens
            assert reads.count - before <= 1
        assert len(scheduler.running) == len(RAGGED_PROMPTS)
        overlapped = not args.disable_overlap_schedule
        for i in range(3):
            before = reads.count
            scheduler.step()
            assert (scheduler._launched is not None) == overlapped
            assert reads.count - before == (0 if overlapped and i == 0 else 1)
        if overlapped:
            before = reads.count
            scheduler._finish_launched()
            assert reads.count - before == 1


@pytest.mark.parametrize(
    "verify, k, sampled", [("expand", 2, False), ("fia", 3, False), ("expand", 2, True)]
)
def test_mtp_round_graph_stays_on_device(monkeypatch, verify, k, sampled):
    """Greedy requests without logprobs replay each MTP round as one graph (the platform's
    eager graph class over static device buffers; three requests pad bucket 4): every op of
    the round (the slots of its positions gathered from the request table, the draft chain,
    the verify, the greedy acceptance, the MTP pass and the next d_1 gathered at each row's
    accept length) stays on the device, and each step makes its one read after the whole
    round, no forward following it; the per-forward verify graph never replays. `sampled`:
    two seeded sampled requests (top-k, top-p) beside a greedy one replay the sampled
    variant (draft sampling, rejection sampling, the next d_1 drawn inside, its uniforms
    copied in with the settings block) under the same rules."""
    monkeypatch.setattr(model_runner_module, "load_model", _load_then_place)
    reads = Counted()
    monkeypatch.setattr(HOST_READS, "read", reads)
    args = _fake_cuda_args(
        speculative_algorithm="MTP",
        speculative_num_steps=k,
        speculative_verify=verify,
        enable_cpu_graph=True,
        cuda_graph_bs=(2, 4),
    )
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        runner = model_runner_module.ModelRunner(args, FakeCuda())
        with Strict(fake):
            decoder = create_decoder(
                args, DecoderHandles(runner, TableKV(runner.req_to_token_pool), _commit, [1])
            )
            runner.capture_graphs(decoder.graph_kinds())
            decoder.calibrate()  # captures the round graphs
            reqs = _requests()[:3]
            for i, r in enumerate(reqs):
                r.sampling_params = SamplingParams(temperature=0.0, max_new_tokens=64)
                if sampled and i:
                    r.sampling_params = SamplingParams(
                        temperature=0.9, top_k=5, top_p=0.9, seed=i, max_new_tokens=64
                    )
                r.sampling_params.normalize()
                r.return_logprob = False
            _prefill(runner, decoder, reqs)
            forward = runner._forward

            def logged(*a, **kw):
                reads.events.append("forward")
                return forward(*a, **kw)

            runner._forward = logged
            for _ in range(3):
                reads.events.clear()
                decoder.step(reqs)
                events = reads.events
                assert events.count("read") == 1 and events[-1] == "read", events
    assert decoder.rounds is not None and decoder.rounds.replays[k] == 3
    assert decoder.rounds.sampled_replays[k] == (3 if sampled else 0)
    assert not runner.graph_runner.replays.get(decoder.verifies[k].kind.name)
    assert reads.accepted > 0


def _prefill(runner, decoder, reqs) -> None:
    """One EXTEND forward over `reqs`, their first tokens and the MTP pass drafting d_1."""
    rows = runner.req_to_token_pool.alloc(len(reqs))
    for r, row in zip(reqs, rows):
        r.req_pool_idx = row
    lens = [len(r.origin_input_ids) for r in reqs]
    _, loc = decoder.h.kv.alloc_running(reqs, lens[0])
    fb = runner.build_forward_batch(
        ForwardMode.EXTEND, [t for r in reqs for t in r.origin_input_ids], rows, lens, lens, loc
    )
    hidden = runner.forward(fb)
    for r, n in zip(reqs, lens):
        r.kv_len = n
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
    decoder.sample_and_commit(reqs, runner.compute_logits(hidden[to_device(last, DEVICE)]))
    decoder.after_prefill(reqs, [0] * len(reqs), lens, hidden, [True] * len(reqs), len(reqs))
