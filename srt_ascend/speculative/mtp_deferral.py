"""The MTP passes that K = 0 steps skip (--speculative-adaptive, or a request asking 0 drafts
beside none that draft): each request keeps the target hidden of its skipped positions
(`defer`, in chunks) and the passes run in one forward at its next step with drafts
(`catch_up`), or without drafting as it finishes or leaves, so the prefix cache takes its
slots with their MTP KV written. And the KV-only part of every MTP pass (`_write_kv`): a
position whose MTP output no draft reads gets only its MTP KV. `DeferralMixin` is a part of
MTPWorker: it reads the worker's handles and later layers and calls its `draft_extend` and
`_extend_batch`."""

from __future__ import annotations

import itertools
import time

import torch

from srt_ascend.decoding.base import StepRequest
from srt_ascend.speculative.spec_state import SpecState, state_of
from srt_ascend.utils import to_device

# Deferred MTP passes a request keeps (K = 0 steps in a row); older positions are dropped:
# their MTP-layer KV is never written, which only makes later drafts worse (the drafts'
# attention reads whatever the slot held), never the outputs.
MAX_DEFERRED = 64


def _drop_deferred(state: SpecState, n: int) -> None:
    """Forgets the `n` oldest deferred positions of `state` (views: no copy)."""
    state.deferred_start += n
    state.deferred_len -= n
    while n:
        head = state.deferred[0]
        if head.shape[0] <= n:
            n -= head.shape[0]
            del state.deferred[0]
        else:
            state.deferred[0], n = head[n:], 0


class DeferralMixin:
    # steps with drafts that first ran deferred passes (`counted_catch_up`), their positions
    # and host seconds
    catch_ups = 0
    caught_up_positions = 0
    catch_up_seconds = 0.0

    def _write_kv(self, reqs, starts, lens, hidden, next_tokens, draft_rows) -> list[int]:
        """`draft_extend`'s KV-only part: every MTP layer's KV at each request's positions
        but a drafting request's last (`write_kv`: the ops and bits of the layer's forward).
        Returns the indices of the drafting requests."""
        only = [n - 1 if d else n for n, d in zip(lens, draft_rows)]  # KV-only positions
        at = [i for i, m in enumerate(only) if m]
        if at:
            fb = self._extend_batch(
                [reqs[i] for i in at],
                [starts[i] for i in at],
                [only[i] for i in at],
                [next_tokens[i][: only[i]] for i in at],
            )()
            if sum(only) < hidden.shape[0]:
                offsets = [0, *itertools.accumulate(lens)]
                rows = [offsets[i] + j for i in at for j in range(only[i])]
                hidden = hidden.index_select(0, to_device(rows, hidden.device))
            for layer in [0, *self.later_layers]:
                self.h.write_kv(fb, hidden, layer)
        return [i for i, d in enumerate(draft_rows) if d]

    @staticmethod
    def _last_positions(picked, reqs, starts, lens, hidden, next_tokens):
        """The `picked` requests with their last position only: (requests, its position,
        its hidden row, its next token)."""
        ends = list(itertools.accumulate(lens))
        rows = to_device([ends[i] - 1 for i in picked], hidden.device)
        return (
            [reqs[i] for i in picked],
            [starts[i] + lens[i] - 1 for i in picked],
            hidden.index_select(0, rows),
            [next_tokens[i][-1:] for i in picked],
        )

    def defer(
        self,
        reqs: list[StepRequest],
        starts: list[int],  # first position of each request's range
        lens: list[int],  # positions of each request's range
        hidden: torch.Tensor,  # [sum(lens), D] the target hidden at those positions
    ) -> None:
        """The MTP pass over these positions waits for `catch_up` (after a K = 0 step, one
        position per request; after a prefill, the prompt's): the step costs what it costs
        without MTP. Each unfinished request keeps its last MAX_DEFERRED positions' hidden,
        copied once for the batch (a graph replay's output buffer is reused). A finished
        request has no later step to catch up at (a prompt-only prefill, as `n > 1` sends
        first; a request that stopped at this step): its pass, over every position it has
        waiting and this range, runs now without drafting, so the prefix cache takes its
        slots with their MTP KV written."""
        ends = itertools.accumulate(lens)
        keep = [
            (r, start + n - m, end - m, m)
            for r, start, n, end in zip(reqs, starts, lens, ends)
            if (m := n if r.finished else min(n, MAX_DEFERRED))
        ]
        if not keep:
            return
        rows = [row for _, _, first, m in keep for row in range(first, first + m)]
        if len(rows) == hidden.shape[0]:  # every row (a K = 0 step's): a copy, no gather
            kept = hidden.clone()
        else:
            kept = hidden.index_select(0, to_device(rows, hidden.device))
        owned = list(kept.split([m for *_, m in keep]))
        self.keep_deferred([r for r, *_ in keep], [start for _, start, *_ in keep], owned)
        self.catch_up([r for r, *_ in keep if r.finished], draft=False)

    @staticmethod
    def keep_deferred(
        reqs: list[StepRequest],
        starts: list[int],  # position of each request's first deferred row
        hidden: list[torch.Tensor],  # [m, D] each: copies the request may keep
    ) -> None:
        """`defer`'s bookkeeping, without a device op: each request's deferred positions grow
        by its rows (the latest MAX_DEFERRED kept while it runs) and its d_1 is dropped (it
        is drafted from the latest position). An overlapped K = 0 round (MTPDecoder.finish)
        calls it from the scheduler's thread, with its rows copied on the device worker."""
        for r, start, rows in zip(reqs, starts, hidden):
            s = state_of(r)
            if not s.deferred:
                s.deferred_start, s.deferred_len = start, 0
            s.deferred.append(rows)
            s.deferred_len += rows.shape[0]
            s.token = s.probs = s.hidden = None  # d_1 is drafted from the latest position
            if s.deferred_len > MAX_DEFERRED and not r.finished:
                _drop_deferred(s, s.deferred_len - MAX_DEFERRED)

    def counted_catch_up(self, reqs: list[StepRequest]) -> float:
        """`catch_up` before a step drafts, counted: its host seconds (on a device, its
        launches), what drafting again after plain steps costs."""
        deferred = sum(state_of(r).deferred_len for r in reqs)
        if not deferred:
            return 0.0
        started = time.perf_counter()
        self.catch_up(reqs)
        seconds = time.perf_counter() - started
        self.catch_ups += 1
        self.caught_up_positions += deferred
        self.catch_up_seconds += seconds
        return seconds

    @torch.inference_mode()
    def catch_up(self, reqs: list[StepRequest], draft: bool = True) -> None:
        """Runs the MTP passes deferred by K = 0 steps, for every request that has some, as
        one DRAFT_EXTEND over their positions (what the skipped passes would have written and
        drafted: MTP KV at each position, d_1 from the last, unless `draft` is False), before
        a step drafts. A position without a next token (a prompt's last, when nothing was
        sampled) gets KV keyed by padding, which the bigram-keyed prefix cache never keeps."""
        stale = [r for r in reqs if state_of(r).deferred]
        if not stale:
            return
        states = [state_of(r) for r in stale]
        starts = [s.deferred_start for s in states]
        lens = [s.deferred_len for s in states]
        hidden = torch.cat([h for s in states for h in s.deferred])
        for s in states:
            s.deferred, s.deferred_len = [], 0
        next_tokens = [
            (r.all_ids[st + 1 : st + 1 + n] + [0] * n)[:n] for r, st, n in zip(stale, starts, lens)
        ]
        self.draft_extend(stale, starts, lens, hidden, next_tokens, [draft] * len(stale))
