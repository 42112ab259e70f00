"""The scheduler's KV bookkeeping: allocation with eviction and retraction, freeing, release.

A mixin of Scheduler (it uses the scheduler's allocator, req_to_token table, tree and running
list); kept apart so the scheduling loop reads on its own.
"""

from __future__ import annotations

import logging

import torch

from srt_ascend.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)


class KVMemoryMixin:
    def _alloc_extend(self, reqs: list[Req], lens: list[int]) -> torch.Tensor:
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + n for r, n in zip(reqs, lens)]
        last = [
            int(self.req_to_token[r.req_pool_idx, r.kv_len - 1]) if r.kv_len else -1 for r in reqs
        ]
        loc = self.allocator.alloc_extend(prefix, seq, last)
        if loc is None:
            self.tree.evict(sum(lens) + len(reqs) * self.page_size)
            loc = self.allocator.alloc_extend(prefix, seq, last)
        if loc is None:
            raise RuntimeError("KV allocation failed after admission control (accounting bug)")
        off = 0
        for r, n in zip(reqs, lens):
            self.req_to_token[r.req_pool_idx, r.kv_len : r.kv_len + n] = loc[off : off + n]
            off += n
        return loc

    def alloc_running(self, n: int) -> torch.Tensor:
        """n new slots per running request (positions kv_len .. kv_len+n-1, written into
        req_to_token), evicting from the tree and then retracting requests until it fits.
        Returns the slots [B * n] in request order; `self.running` may have shrunk."""
        while True:
            reqs = self.running
            prefix = [r.kv_len for r in reqs]
            seq = [r.kv_len + n for r in reqs]
            last = [int(self.req_to_token[r.req_pool_idx, r.kv_len - 1]) for r in reqs]
            loc = self.allocator.alloc_extend(prefix, seq, last)
            if loc is None:
                self.tree.evict(len(reqs) * (n + self.page_size))
                loc = self.allocator.alloc_extend(prefix, seq, last)
            if loc is not None:
                for i, r in enumerate(reqs):
                    self.req_to_token[r.req_pool_idx, r.kv_len : r.kv_len + n] = loc[
                        i * n : (i + 1) * n
                    ]
                return loc
            self._retract_one()
            if not self.running:
                return torch.zeros(0, dtype=torch.int64)

    def free_positions(self, req: Req, lo: int, hi: int) -> None:
        """Frees the request's slots for positions [lo, hi), whole pages only: a page that
        also holds position lo-1 stays with the request (its next allocation continues it)."""
        first = -(-lo // self.page_size) * self.page_size
        if hi > first:
            self.allocator.free(self.req_to_token[req.req_pool_idx, first:hi].clone())

    def _retract_one(self) -> None:
        """Sends the most recently admitted request back to the queue, keeping its outputs."""
        victim = self.running.pop()
        if not self.running and not self.waiting and self.tree.evictable_size() == 0:
            # Nothing else holds memory: it can never fit.
            self._finish(victim, FinishReason("abort", message="KV cache pool too small"))
            return
        self.release(victim)
        victim.retracted += 1
        self.num_retractions += 1
        self.waiting.insert(0, victim)
        logger.info("retracted request %s (KV pool full)", victim.rid)

    def release(self, req: Req) -> None:
        """Gives the request's KV to the tree (or frees it) and returns its row."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        self.tree.cache_finished_req(req.all_ids, row, req.prefix_len, req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = None, 0, 0, None
