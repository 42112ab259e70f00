"""MTP draft worker: drafts K tokens per request with the DeepSeek-V3 MTP module.

The worker holds narrow handles only: the MTP forward (eager or a graph replay) and its LM head,
a ForwardBatch builder over the shared paged pool (the MTP layers are extra layers of it) and
the request-to-token table. The decoder owns allocation and commits.

Per request it keeps a SpecState (Req.decoder_state): `draft_tokens` d_1..d_K, `draft_probs`
(the processed draft distribution each was sampled from), and `hidden` (the module's last
output hidden, which feeds the next application when K > number of MTP layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from srt_ascend.decoding.base import StepRequest
from srt_ascend.layers.sampler import processed_probs, sample_from_probs
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.model_executor.graph_runner import GraphKind
from srt_ascend.sampling.sample_step import all_plain_greedy, penalised_logits
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo
from srt_ascend.speculative.spec_state import SpecState

# Seeded requests draw their drafts from streams apart from their target samples: the draft
# of output position p comes from the stream (seed, DRAFT_SEED_OFFSET + p), so every draft of
# a chain has its own stream (a stream is reused only for a position whose earlier draft was
# never examined by the acceptance test, which keeps the emitted tokens independent of it).
DRAFT_SEED_OFFSET = 1_000_003

# (fb, h_t, draft step, graph kind or None) -> output hidden
MtpForward = Callable[[ForwardBatch, torch.Tensor, int, "GraphKind | None"], torch.Tensor]


@dataclass
class DraftHandles:
    forward: MtpForward
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    build_forward_batch: Callable[..., ForwardBatch]  # (mode, ids, rows, seq, ext, loc)
    req_to_token: torch.Tensor  # [rows, max_context] slot table
    vocab_size: int
    eos_ids: list[int]


def state_of(req: StepRequest) -> SpecState:
    if req.decoder_state is None:
        req.decoder_state = SpecState()
    return req.decoder_state


class MTPWorker:
    def __init__(
        self,
        handles: DraftHandles,
        num_steps: int,
        extend_kind: GraphKind,  # the pass after verify: 1+K tokens per request
        step_kinds: dict[int, GraphKind],  # draft step j (1..K-1): 1 token per request
    ) -> None:
        self.h = handles
        self.k = num_steps
        self.extend_kind, self.step_kinds = extend_kind, step_kinds

    @torch.inference_mode()
    def draft_extend(
        self,
        reqs: list[StepRequest],
        starts: list[int],  # first position of each request's new range
        lens: list[int],  # positions computed this pass
        hidden: torch.Tensor,  # [sum(lens), D] main-model hidden at those positions
        next_tokens: list[list[int]],  # token at p+1 for each position p (len = lens[i])
        draft_rows: list[bool],  # whose last position's output drafts d_1
    ) -> None:
        """DRAFT_EXTEND: MTP over (h_p, token p+1) at positions p, writing the MTP layer's KV
        into the same slots as the main model's; the last output drafts d_1."""
        ids = [t for toks in next_tokens for t in toks]
        rows = [r.req_pool_idx for r in reqs]
        seq = [s + n for s, n in zip(starts, lens)]
        loc = torch.cat(
            [self.h.req_to_token[r.req_pool_idx, s : s + n] for r, s, n in zip(reqs, starts, lens)]
        )
        fb = self.h.build_forward_batch(ForwardMode.DRAFT_EXTEND, ids, rows, seq, lens, loc)
        out = self.h.forward(fb, hidden, 0, self.extend_kind)
        ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        self._draft_first(reqs, out, ends, draft_rows)

    @torch.inference_mode()
    def draft_after_verify(
        self,
        reqs: list[StepRequest],
        starts: list[int],  # position of each request's verify input token
        loc: torch.Tensor,  # [B, K+1] slots of positions start .. start+K
        hidden: torch.Tensor,  # [B*(K+1), D] the verify forward's target hidden states
        next_tokens: list[list[int]],  # [B][K+1]: token at p+1 where committed, else padding
        accepted: list[int],  # committed positions per request (>= 1)
        draft_rows: list[bool],
    ) -> None:
        """DRAFT_EXTEND after a verify, always over all 1+K positions per request (a fixed
        shape a graph can replay): rows past a request's committed positions see only their
        own prefix causally and write MTP KV into rejected slots, which are freed afterwards.
        The output at each request's last committed position drafts its next d_1."""
        k1 = loc.shape[1]
        fb = self.h.build_forward_batch(
            ForwardMode.DRAFT_EXTEND,
            [t for toks in next_tokens for t in toks],
            [r.req_pool_idx for r in reqs],
            [s + k1 for s in starts],
            [k1] * len(reqs),
            loc.reshape(-1),
        )
        out = self.h.forward(fb, hidden, 0, self.extend_kind)
        self._draft_first(reqs, out, [i * k1 + n - 1 for i, n in enumerate(accepted)], draft_rows)

    def _draft_first(
        self, reqs, out: torch.Tensor, last_rows: list[int], draft_rows: list[bool]
    ) -> None:
        chosen = [i for i, d in enumerate(draft_rows) if d]
        if chosen:
            rows = torch.tensor([last_rows[i] for i in chosen], device=out.device)
            self._draft_step([reqs[i] for i in chosen], out.index_select(0, rows), first=True)

    @torch.inference_mode()
    def draft_chain(self, reqs: list[StepRequest], loc: torch.Tensor) -> None:
        """Draft steps 2..K: the module applied again to (its own output, its own token) at
        positions L-1 .. L+K-3 (L = committed length), writing MTP KV into the verify slots
        `loc` [B, K+1] allocated for positions L-1 .. L-1+K (overwritten after verify)."""
        states = [state_of(r) for r in reqs]
        for j in range(1, self.k):
            fb = self.h.build_forward_batch(
                ForwardMode.DECODE,
                [s.draft_tokens[j - 1] for s in states],
                [r.req_pool_idx for r in reqs],
                [r.seq_len - 1 + j for r in reqs],  # KV positions 0 .. L-2+j
                [1] * len(reqs),
                loc[:, j - 1],
            )
            hidden = torch.stack([s.hidden for s in states])
            out = self.h.forward(fb, hidden, j, self.step_kinds[j])
            self._draft_step(reqs, out, first=False)

    def _draft_step(self, reqs: list[StepRequest], out_hidden: torch.Tensor, first: bool) -> None:
        logits = self.h.compute_logits(out_hidden)[:, : self.h.vocab_size]
        states = [state_of(r) for r in reqs]
        if first:
            for s in states:
                s.restart()
        if all_plain_greedy(reqs):
            self._record(states, out_hidden, logits.argmax(dim=-1).tolist(), None)
            return
        n_drafted = len(states[0].draft_tokens)  # the same for every row of a step
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            self.h.vocab_size,
            logits.device,
            seed_offsets=[DRAFT_SEED_OFFSET + len(r.output_ids) + n_drafted for r in reqs],
        )
        extra = [s.draft_tokens for s in states]
        logits = penalised_logits(logits, reqs, info, self.h.eos_ids, extra)
        if info.is_all_greedy:  # greedy verification needs the draft tokens only
            probs, tokens = None, logits.argmax(dim=-1).tolist()
        else:
            probs = processed_probs(logits, info)  # [B, V]
            tokens = sample_from_probs(probs, info).tolist()
        self._record(states, out_hidden, tokens, probs)

    @staticmethod
    def _record(states: Sequence[SpecState], out_hidden, tokens: list[int], probs) -> None:
        for i, s in enumerate(states):
            s.draft_tokens.append(tokens[i])
            s.draft_probs.append(None if probs is None else probs[i])
            s.hidden = out_hidden[i]
