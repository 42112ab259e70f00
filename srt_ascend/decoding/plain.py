"""Plain decoding: one token per request per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt_ascend.decoding.base import DECODERS, PLAIN, Decoder, LaunchedStep, StepRequest
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.platforms.device_worker import HostCopy
from srt_ascend.sampling.penalty_state import has_penalties
from srt_ascend.sampling.sample_step import SampledTokens, sample_tokens
from srt_ascend.utils import HOST_READS, to_device


@dataclass
class LaunchedOut:
    """What a launched step's closure leaves: the sampled tokens on the device (the next
    step's inputs) and their copy on the way to the host (its finish's read)."""

    sampled: SampledTokens
    tokens: HostCopy  # [B] int64


@DECODERS.register(PLAIN)
class PlainDecoder(Decoder):
    overlaps = True

    def __init__(self, args, handles) -> None:
        super().__init__(args, handles)
        self.kind = self.decode_kind()
        # all-greedy, no-logprob batches replay forward + argmax as one graph; compiled
        # forwards keep to one decode kind (the LM head is compiled in already, and a second
        # kind would double the decode shapes to compile before the server is ready)
        self.greedy_kind = None if args.enable_torch_compile else self.greedy_decode_kind()
        # and sampled batches without logprobs (nor anything modifying the logits) forward +
        # sampling as one graph, their settings and uniforms copied in as one block
        self.sampled_kinds = None if args.enable_torch_compile else self.sampled_decode_kinds()

    def graph_kinds(self) -> list[GraphKind]:
        """The decode forward, and (uncompiled) the same ending with the greedy argmax for
        batches `greedy_without_logprobs` accepts, and ending with sampling for the other
        batches `plain_sampling` accepts."""
        sampled = [] if self.sampled_kinds is None else list(self.sampled_kinds.values())
        return [self.kind, *([self.greedy_kind] if self.greedy_kind else []), *sampled]

    def step(self, reqs: list[StepRequest]) -> list[StepRequest]:
        reqs, loc = self.h.kv.alloc_running(reqs, 1)
        if not reqs:
            self.idle_step()
            return []
        self.decode_and_commit(reqs, loc, self.kind, self.greedy_kind, self.sampled_kinds)
        return reqs

    def can_overlap(self, reqs: list[StepRequest]) -> bool:
        """Not with a grammar (its mask for step N+1 needs step N's token on the host, and its
        matcher advances at every commit) nor with penalties (their token statistics are
        updated from the committed tokens): such a batch runs `step`, serially."""
        return self.runner.tp.size == 1 and not any(
            r.grammar is not None or has_penalties(r.sampling_params) for r in reqs
        )

    def launch(self, reqs: list[StepRequest], prev: LaunchedStep | None) -> LaunchedStep | None:
        """One token per request. Its input is the token `prev` sampled for it (gathered on the
        device inside the submitted closure, once `prev`'s has run), or its last committed one
        when nothing is in flight. Sampling counts `prev`'s token as generated (seeds,
        min_new_tokens) without reading `output_ids`, which the scheduler's thread appends to
        meanwhile."""
        if prev is not None and any(prev.start_of(r) is None for r in reqs):
            return None
        loc = self.h.kv.try_alloc_running(reqs, 1)
        if loc is None:
            return None
        device, ahead = self.runner.device, 0 if prev is None else 1
        if prev is None:
            inputs = to_device([r.last_id for r in reqs], device)
            rows = None
        else:
            inputs = torch.empty(len(reqs), dtype=torch.int64, device=device)
            order = [prev.index[id(r)] for r in reqs]
            rows = None if order == list(range(len(prev.reqs))) else to_device(order, device)
        fb = self.runner.build_forward_batch(
            ForwardMode.DECODE,
            inputs,
            [r.req_pool_idx for r in reqs],
            [r.kv_len + 1 for r in reqs],
            [1] * len(reqs),
            loc,
        )
        starts = [r.kv_len for r in reqs]
        for r in reqs:
            r.kv_len += 1
        generated = [len(r.output_ids) + ahead for r in reqs]
        batch = list(reqs)

        @torch.inference_mode()
        def run():
            if prev is not None:  # the future-token gather: prev's tokens, still on the device
                tokens = prev.result.result().sampled.token_ids
                inputs.copy_(tokens if rows is None else tokens.index_select(0, rows))
            out = self.sampling_replay(fb, batch, self.greedy_kind, self.sampled_kinds, generated)
            if out is not None:  # forward + sampling in one graph
                sampled = SampledTokens(out[1], None)
            else:
                _, logits = self.runner.forward_logits(fb, self.kind)  # a graph's own LM head
                sampled = sample_tokens(logits, batch, self.vocab, self.h.eos_ids, generated)
            # enqueued now, before the next step's forward: its finish waits for this alone
            return LaunchedOut(sampled, self.runner.platform.copy_to_host(sampled.token_ids))

        return LaunchedStep(batch, starts, self.h.worker.submit(run))

    def finish(self, step: LaunchedStep) -> list[StepRequest]:
        """Reads the step's tokens - waiting for its own copy only, while the step launched
        after it runs - and commits them."""
        out: LaunchedOut = step.result.result()
        res = out.sampled
        token_ids = HOST_READS.read(out.tokens.wait())
        committed = []
        for i, r in enumerate(step.reqs):
            if r.finished:  # finished one step late or aborted: this step's token is dropped
                continue
            lps = None if res.logprobs is None else res.logprobs.rows(i, i + 1)
            self.h.commit(r, [token_ids[i]], lps)
            committed.append(r)
        return committed
