"""The decoding interface: one decode step over the running batch, plain or speculative.

The scheduler runs whichever decoder `--speculative-algorithm` registers and never branches on
speculation. A decoder gets narrow handles (DecoderHandles): the model runner, a KV
bookkeeping handle (allocate / free positions; it owns the page size) and a commit callback;
it never sees the scheduler, its queues or its outputs.

Contract of one step, for the running batch `reqs`:
1. allocate the KV positions the step writes through `kv.alloc_running` (which may retract
   requests to make room: only the requests it returns take part in the step);
2. run the forward(s) and choose tokens;
3. commit each request's tokens through `commit` (which appends them one by one and stops at
   the first that finishes the request) and set `req.kv_len` to the positions that now hold
   valid KV, freeing any allocated beyond them with `kv.free_positions`;
4. return the requests that took part. The caller releases the finished ones.

Overlapped (the default; `--disable-overlap-schedule` keeps to `step`): a decoder that can
(`can_overlap`) splits a step in two. `launch` allocates the step's KV (without retracting:
None when it does not fit), advances `kv_len` over the positions it may write, and submits
the device work to the handles' DeviceWorker; its inputs are the previous launched step's
tokens, which stay on the device. `finish` reads the step's tokens (the one host read) and
commits them, skipping requests that finished meanwhile (found one step late, or aborted):
their tokens of this step are dropped. The scheduler launches step N+1 before it finishes
step N, and a request it finds finished rolls `kv_len` back to its start in step N+1
(`LaunchedStep.start_of`) before releasing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from srt_ascend.layers.sampler import TokenLogprobs
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms.device_worker import DeviceWorker, InlineWorker
from srt_ascend.registry import Registry
from srt_ascend.sampling.sample_step import (
    SamplingRequest,
    generated_counts,
    greedy_without_logprobs,
    sample_rows,
)
from srt_ascend.sampling.static_sampling import decode_block, needs_filter, plain_sampling
from srt_ascend.server_args import ServerArgs
from srt_ascend.utils import HOST_READS


class StepRequest(SamplingRequest, Protocol):
    """What a decoder reads and writes of a running request (the scheduler's Req)."""

    rid: str
    req_pool_idx: int | None
    kv_len: int  # positions 0..kv_len-1 hold valid KV
    decoder_state: Any  # owned by the decoder that runs the request (None until it sets it)

    @property
    def all_ids(self) -> list[int]: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def last_id(self) -> int: ...  # all_ids[-1]

    @property
    def finished(self) -> bool: ...


class KVHandle(Protocol):
    """The scheduler's KV bookkeeping as a decoder sees it."""

    @property
    def page_size(self) -> int: ...

    def alloc_running(
        self, reqs: list[StepRequest], n: int
    ) -> tuple[list[StepRequest], torch.Tensor]:
        """n new slots per request for positions kv_len .. kv_len+n-1, written into
        req_to_token; evicts from the prefix cache, then retracts requests (latest admitted
        first) until it fits. Returns the requests kept and their slots [len(kept) * n]."""
        ...

    def try_alloc_running(self, reqs: list[StepRequest], n: int | list[int]) -> torch.Tensor | None:
        """`alloc_running` without retracting (n slots per request, or n[i] for request i):
        the slots, or None (nothing allocated) when they do not fit after evicting from the
        prefix cache."""
        ...

    def free_positions(self, req: StepRequest, lo: int, hi: int) -> None:
        """Frees the request's slots of positions [lo, hi) (whole pages only)."""
        ...

    def free_positions_many(self, reqs: list[StepRequest], los: list[int], his: list[int]) -> None:
        """`free_positions` for each request, the slots freed in one allocator call."""
        ...


# (req, tokens, their logprobs or None) -> None: appends the tokens to the request's output
# one by one, stopping at the first that finishes it (req.finished).
CommitFn = Callable[[StepRequest, list[int], TokenLogprobs | None], None]


@dataclass
class DecoderHandles:
    runner: ModelRunner  # forwards, logits, pools
    kv: KVHandle
    commit: CommitFn
    eos_ids: list[int]  # stop tokens, for the min-new-tokens mask
    worker: DeviceWorker = field(default_factory=InlineWorker)  # where launched steps run

    @property
    def req_to_token(self) -> torch.Tensor:  # [rows, max_context] slot table
        return self.runner.req_to_token_pool.req_to_token


@dataclass
class LaunchedStep:
    """A decode step whose device work is submitted and whose tokens are not read yet."""

    reqs: list[StepRequest]
    starts: list[int]  # each request's kv_len before the step: where it rolls back to
    result: Future  # -> the decoder's step output: tokens on the device and on their way
    # to the host (a HostCopy, which `finish` waits on alone)
    index: dict[int, int] = field(init=False)  # id(req) -> its row

    def __post_init__(self) -> None:
        self.index = {id(r): i for i, r in enumerate(self.reqs)}

    def start_of(self, req: StepRequest) -> int | None:
        i = self.index.get(id(req))
        return None if i is None else self.starts[i]


class Decoder(ABC):
    # whether `launch` / `finish` are implemented (overlap scheduling); a decoder without them
    # runs `step` in the serial loop whatever --disable-overlap-schedule says
    overlaps = False

    def __init__(self, args: ServerArgs, handles: DecoderHandles) -> None:
        self.args = args
        self.h = handles
        self.runner = handles.runner
        self.vocab = handles.runner.vocab_size

    def decode_kind(self) -> GraphKind:
        """One token per request through the main model."""
        return GraphKind("decode", ForwardMode.DECODE, 1, 1, self.runner.attn_backend)

    def greedy_decode_kind(self) -> GraphKind:
        """`decode_kind` ending with the greedy argmax over the vocabulary: forward and
        sampling in one graph, for batches `greedy_without_logprobs` accepts."""
        return GraphKind(
            "decode_greedy",
            ForwardMode.DECODE,
            1,
            1,
            self.runner.attn_backend,
            argmax_vocab=self.vocab,
        )

    def sampled_decode_kinds(self) -> dict[bool, GraphKind]:
        """`decode_kind` ending with sampling (temperature, min-p; `True`: top-k / top-p too,
        a sort per row; seeded uniforms drawn on the host: sampling/static_sampling): forward
        and sampling in one graph, for batches `plain_sampling` accepts with a sampled row."""
        return {
            filtered: GraphKind(
                "decode_filtered" if filtered else "decode_sampled",
                ForwardMode.DECODE,
                1,
                1,
                self.runner.attn_backend,
                argmax_vocab=self.vocab,
                sampled=True,
                filtered=filtered,
            )
            for filtered in (False, True)
        }

    def graph_kinds(self) -> list[GraphKind]:
        """The forwards this decoder runs that graphs may capture."""
        return [self.decode_kind()]

    def after_prefill(  # noqa: B027 - optional hook
        self,
        reqs: list[StepRequest],
        starts: list[int],  # first position each request computed in the EXTEND pass
        lens: list[int],  # positions computed
        hidden: torch.Tensor,  # [sum(lens), D] main-model hidden states of those positions
        done: list[bool],  # whose prompt is now complete
        next_batch: int,  # requests the next decode step is expected to run (these too)
    ) -> None:
        """Called after every EXTEND forward, once the first tokens are committed."""

    def leaving(self, reqs: list[StepRequest]) -> None:  # noqa: B027 - optional hook
        """Called before running requests give their KV to the prefix cache unfinished
        (aborted, retracted), on the device worker: a decoder that defers work over
        committed positions finishes it here."""

    def calibrate(self) -> None:  # noqa: B027 - optional hook
        """Called once the graphs are captured, before the first request: a decoder that
        times its forwards does it here."""

    def agree(self, tokens: list) -> list:
        """`tokens`, this step's host read of what it commits, as the first rank of the
        attention group read it: with tensor parallelism the other ranks take it over the gloo
        group (one small object per step), so every rank commits alike and the ranks stay in
        lockstep even where their own draws differed (logits apart in the last bit, a uniform
        on a boundary). Without it, `tokens` itself."""
        return self.runner.tp.attn_group.broadcast_object(tokens)

    def sample_and_commit(self, reqs: list[StepRequest], logits: torch.Tensor) -> None:
        """One token per request from its row of `logits` [B, V] (penalties, sampling
        settings, logprobs as asked; the tokens `agree`d across ranks), committed through
        the handle."""
        res = sample_rows(logits, reqs, self.vocab, self.h.eos_ids)
        self.commit_tokens(reqs, res.token_ids, res.logprobs)

    def commit_tokens(self, reqs: list[StepRequest], token_ids: list[int], logprobs) -> None:
        """Request i's token `token_ids[i]` (this rank's host read, `agree`d across ranks) and
        its row of `logprobs` (None: not asked), committed through the handle."""
        token_ids = self.agree(token_ids)
        for i, r in enumerate(reqs):
            lps = None if logprobs is None else logprobs.rows(i, i + 1)
            self.h.commit(r, [token_ids[i]], lps)

    def decode_and_commit(
        self,
        reqs: list[StepRequest],
        loc: torch.Tensor,
        kind: GraphKind,
        greedy_kind: GraphKind | None = None,
        sampled_kinds: dict[bool, GraphKind] | None = None,
    ) -> torch.Tensor:
        """A plain decode step over requests whose slots `loc` [B] are allocated: each one's
        last token through the main model (graph `kind` where captured; `greedy_kind`, whose
        graph ends with the argmax, for a batch `greedy_without_logprobs` accepts;
        `sampled_kinds`, ending with sampling, for the other batches `plain_sampling`
        accepts), its KV counted, the next token sampled and committed. Returns the hidden
        states [B, D]."""
        fb = self.runner.build_forward_batch(
            ForwardMode.DECODE,
            [r.last_id for r in reqs],
            [r.req_pool_idx for r in reqs],
            [r.kv_len + 1 for r in reqs],
            [1] * len(reqs),
            loc,
        )
        out = self.sampling_replay(fb, reqs, greedy_kind, sampled_kinds)
        if out is None:
            hidden, logits = self.runner.forward_logits(fb, kind)
        else:
            hidden, tokens = out
        for r in reqs:
            r.kv_len += 1
        if out is not None:
            self.commit_tokens(reqs, HOST_READS.read(tokens), None)
        else:
            self.sample_and_commit(reqs, logits)
        return hidden

    def sampling_replay(
        self,
        fb: ForwardBatch,
        reqs: list[StepRequest],
        greedy_kind: GraphKind | None,
        sampled_kinds: dict[bool, GraphKind] | None,
        generated: list[int] | None = None,  # tokens each generated (None: committed ones)
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, tokens) of a decode forward whose graph ends with sampling: `greedy_kind`
        for a batch `greedy_without_logprobs` accepts, else `sampled_decode` over
        `sampled_kinds`; None where neither serves (the caller samples from the logits)."""
        if greedy_kind is not None and greedy_without_logprobs(reqs, generated):
            return self.runner.forward_greedy(fb, greedy_kind)
        if sampled_kinds is not None:
            return self.sampled_decode(fb, reqs, sampled_kinds, generated)
        return None

    def sampled_decode(
        self,
        fb: ForwardBatch,
        reqs: list[StepRequest],
        kinds: dict[bool, GraphKind],
        generated: list[int] | None = None,  # tokens each generated (None: committed ones)
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, tokens) of a replay of `kinds` (`sampled_decode_kinds`) for a batch
        `plain_sampling` accepts, its uniforms the streams of the counts `generated`
        (`decode_block`); None elsewhere (no graph holds it, or it needs the logits)."""
        generated = generated_counts(reqs, generated)
        if not plain_sampling(reqs, generated):
            return None
        block = lambda: decode_block(reqs, generated, self.vocab)  # noqa: E731
        kind = kinds[needs_filter(reqs, self.vocab)]
        return self.runner.forward_sampled(fb, kind, block)

    @abstractmethod
    def step(self, reqs: list[StepRequest]) -> list[StepRequest]:
        """One decode step over the running batch (contract in the module docstring). A step
        left with no request (all retracted) runs `idle_step` instead."""

    def can_overlap(self, reqs: list[StepRequest]) -> bool:
        """Whether this batch may run as `launch` + `finish` (module docstring)."""
        return False

    def launch(self, reqs: list[StepRequest], prev: LaunchedStep | None) -> LaunchedStep | None:
        """Submits a step whose inputs follow `prev` (the launched step not finished yet, if
        any; every request here took part in it). None, with nothing changed, when it cannot
        launch (its KV does not fit without retracting)."""
        return None

    def finish(self, step: LaunchedStep) -> list[StepRequest]:
        """Reads a launched step's results and commits them (module docstring). Returns the
        requests committed (the caller releases the finished ones)."""
        raise NotImplementedError

    def idle_prefill(self) -> None:
        """The model forwards of a prefill step (EXTEND, then `after_prefill`'s), over no
        tokens: what a data-parallel attention group without a prefill batch runs while
        another group prefills (ModelRunner.forward_idle; nothing without DP attention)."""
        self.runner.forward_idle()

    def idle_step(self) -> None:
        """The model forwards of `step`, over no tokens (see `idle_prefill`)."""
        self.runner.forward_idle()

    def stats(self) -> dict:
        """Counters reported in the scheduler's internal state."""
        return {}


DECODERS: Registry[Decoder] = Registry("speculative algorithm")
PLAIN = "NONE"  # SGLang's name for no speculation


def decoder_class(args: ServerArgs) -> type[Decoder]:
    return DECODERS.get(args.speculative_algorithm or PLAIN)


def create_decoder(args: ServerArgs, handles: DecoderHandles) -> Decoder:
    return decoder_class(args)(args, handles)
