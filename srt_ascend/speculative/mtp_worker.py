"""MTP draft worker: drafts K tokens per request with the DeepSeek-V3 MTP module.

The worker holds narrow handles only: the MTP forward (eager or a graph replay) and its LM head,
a ForwardBatch builder over the shared paged pool (the MTP layers are extra layers of it) and
the request-to-token table. The scheduler owns allocation and commits.

Per request it keeps (on the Req): `draft_tokens` d_1..d_K, `draft_probs` [K, V] (the
processed draft distribution each was sampled from), and `mtp_hidden` (the module's last output
hidden, which feeds the next application when K > number of MTP layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from srt_ascend.layers.sampler import processed_probs, sample_from_probs
from srt_ascend.managers.sample_step import all_plain_greedy, penalised_logits
from srt_ascend.managers.schedule_batch import Req
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.sampling.sampling_batch_info import SamplingBatchInfo

# Seeded requests draw their draft samples from a stream apart from their target samples.
DRAFT_SEED_OFFSET = 1_000_003


@dataclass
class DraftHandles:
    forward: Callable[[ForwardBatch, torch.Tensor, int], torch.Tensor]  # (fb, h_t, step) -> h
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    build_forward_batch: Callable[..., ForwardBatch]  # (mode, ids, rows, seq, ext, loc)
    req_to_token: torch.Tensor  # [rows, max_context] slot table
    vocab_size: int
    eos_ids: list[int]


class MTPWorker:
    def __init__(self, handles: DraftHandles, num_steps: int) -> None:
        self.h = handles
        self.k = num_steps

    @torch.inference_mode()
    def draft_extend(
        self,
        reqs: list[Req],
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
        out = self.h.forward(fb, hidden, 0)
        self._draft_first(reqs, out, fb.last_token_index, draft_rows)

    @torch.inference_mode()
    def draft_after_verify(
        self,
        reqs: list[Req],
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
        out = self.h.forward(fb, hidden, 0)
        picks = torch.tensor([i * k1 + n - 1 for i, n in enumerate(accepted)])
        self._draft_first(reqs, out, picks, draft_rows)

    def _draft_first(self, reqs, out, rows_index: torch.Tensor, draft_rows: list[bool]) -> None:
        chosen = [i for i, d in enumerate(draft_rows) if d]
        if chosen:
            self._draft_step([reqs[i] for i in chosen], out[rows_index[chosen]], first=True)

    @torch.inference_mode()
    def draft_chain(self, reqs: list[Req], loc: torch.Tensor) -> None:
        """Draft steps 2..K: the module applied again to (its own output, its own token) at
        positions L-1 .. L+K-3 (L = committed length), writing MTP KV into the verify slots
        `loc` [B, K+1] allocated for positions L-1 .. L-1+K (overwritten after verify)."""
        for j in range(1, self.k):
            ids = [r.draft_tokens[j - 1] for r in reqs]
            seq = [r.seq_len - 1 + j for r in reqs]  # KV positions 0 .. L-2+j
            fb = self.h.build_forward_batch(
                ForwardMode.DECODE,
                ids,
                [r.req_pool_idx for r in reqs],
                seq,
                [1] * len(reqs),
                loc[:, j - 1],
            )
            hidden = torch.stack([r.mtp_hidden for r in reqs])
            out = self.h.forward(fb, hidden, j)
            self._draft_step(reqs, out, first=False)

    def _draft_step(self, reqs: list[Req], out_hidden: torch.Tensor, first: bool) -> None:
        logits = self.h.compute_logits(out_hidden)[:, : self.h.vocab_size]
        if all_plain_greedy(reqs):
            self._record(reqs, out_hidden, logits.argmax(dim=-1).tolist(), None, first)
            return
        info = SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs],
            self.h.vocab_size,
            logits.device,
            seed_offsets=[DRAFT_SEED_OFFSET + len(r.output_ids) for r in reqs],
        )
        extra = [[] if first else list(r.draft_tokens) for r in reqs]
        logits = penalised_logits(logits, reqs, info, self.h.eos_ids, extra)
        if info.is_all_greedy:  # greedy verification needs the draft tokens only
            probs, tokens = None, logits.argmax(dim=-1).tolist()
        else:
            probs = processed_probs(logits, info)  # [B, V]
            tokens = sample_from_probs(probs, info).tolist()
        self._record(reqs, out_hidden, tokens, probs, first)

    @staticmethod
    def _record(reqs, out_hidden, tokens: list[int], probs, first: bool) -> None:
        for i, r in enumerate(reqs):
            if first:
                r.draft_tokens, r.draft_probs = [], []
            r.draft_tokens.append(tokens[i])
            r.draft_probs.append(None if probs is None else probs[i])
            r.mtp_hidden = out_hidden[i]
