"""KV bookkeeping of running requests: allocation with eviction and retraction, freeing,
release into the prefix cache. It owns no memory itself: the slots come from the allocator
(which owns the page size), the rows from the ReqToTokenPool, cached prefixes from the tree.

Per request it keeps two lengths: `kv_len` (positions with valid KV) and `alloc_len`
(positions whose slots the request holds, >= kv_len), so a request released at any point, a
failed step included, gives back everything it holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from srt_ascend.managers.schedule_batch import Req
from srt_ascend.mem_cache import BasePrefixCache, ReqToTokenPool, TokenToKVPoolAllocator


class KVBook:
    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        req_to_token_pool: ReqToTokenPool,
        tree: BasePrefixCache,
        retract: Callable[[Req, list[Req]], None],  # (victim, requests staying) -> None
    ) -> None:
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.host = req_to_token_pool.host  # bookkeeping reads the host copy: no device sync
        self.tree = tree
        self.retract = retract

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def _alloc(self, reqs: list[Req], lens: list[int]) -> torch.Tensor | None:
        """Slots for positions kv_len .. kv_len+n-1 of each request (evicting once), written
        into req_to_token; None when they do not fit. Slots are host tensors: allocation is
        host bookkeeping, the device table gets them with one async copy."""
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + n for r, n in zip(reqs, lens)]
        rows = [r.req_pool_idx for r in reqs]
        loc = self._take_slots(rows, prefix, seq)
        if loc is None:
            self.tree.evict(sum(lens) + len(reqs) * self.page_size)
            loc = self._take_slots(rows, prefix, seq)
        if loc is None:
            return None
        self.req_to_token_pool.write(rows, prefix, loc, lens)
        for r, n in zip(reqs, lens):
            r.alloc_len = r.kv_len + n
        return loc

    def _take_slots(self, rows: list[int], prefix: list[int], seq: list[int]):
        """The allocator's slots for positions prefix..seq-1 of each row, or None. One new
        position per request after KV it has (a plain decode step) takes the allocator's
        decode path, with the last slots read in one host gather: a step's bookkeeping is a
        handful of host ops, not a dozen per request; so is an MTP step's (K+1 positions per
        request after KV it has), through the extend path."""
        if all(p > 0 for p in prefix):  # every row has KV: its last slots in one gather
            last = self.host[rows, [p - 1 for p in prefix]]
            if all(s - p == 1 for p, s in zip(prefix, seq)):
                return self.allocator.alloc_decode(seq, last)
            return self.allocator.alloc_extend(prefix, seq, last.tolist())
        last = [int(self.host[r, p - 1]) if p else -1 for r, p in zip(rows, prefix)]
        return self.allocator.alloc_extend(prefix, seq, last)

    def alloc_extend(self, reqs: list[Req], lens: list[int]) -> torch.Tensor:
        """Slots for an admitted prefill batch (admission already counted them)."""
        loc = self._alloc(reqs, lens)
        if loc is None:
            raise RuntimeError("KV allocation failed after admission control (accounting bug)")
        return loc

    def alloc_positions(self, req: Req, n: int) -> bool:
        """n slots for positions kv_len .. kv_len+n-1 of one request (evicting from the
        prefix cache if needed), written into req_to_token; False (nothing taken) when they
        do not fit."""
        return self._alloc([req], [n]) is not None

    def alloc_running(self, reqs: list[Req], n: int) -> tuple[list[Req], torch.Tensor]:
        """n new slots per request (positions kv_len .. kv_len+n-1, written into
        req_to_token), evicting from the tree and then retracting requests, latest admitted
        first, until it fits. Returns the requests kept and their slots [len(kept) * n]."""
        reqs = list(reqs)
        while reqs:
            loc = self._alloc(reqs, [n] * len(reqs))
            if loc is not None:
                return reqs, loc
            victim = reqs.pop()
            self.retract(victim, reqs)
        return [], torch.zeros(0, dtype=torch.int64)

    def try_alloc_running(self, reqs: list[Req], n: int | list[int]) -> torch.Tensor | None:
        """n new slots per request (or n[i] for request i) like `alloc_running`, evicting
        from the tree but never retracting: None (nothing allocated) when they do not fit.
        The overlap scheduler launches a step this way while the previous one is in flight,
        and retracts only once it has finished it (serially, as without overlap)."""
        return self._alloc(list(reqs), [n] * len(reqs) if isinstance(n, int) else list(n))

    def free_positions(self, req: Req, lo: int, hi: int) -> None:
        """Frees the request's slots for positions [lo, hi), whole pages only: a page that
        also holds position lo-1 stays with the request (its next allocation continues it)."""
        first = -(-lo // self.page_size) * self.page_size
        if hi > first:
            self.allocator.free(self.host[req.req_pool_idx, first:hi].clone())
            if hi >= req.alloc_len:
                req.alloc_len = first

    def free_positions_many(self, reqs: list[Req], los: list[int], his: list[int]) -> None:
        """`free_positions(reqs[i], los[i], his[i])` for every i, the slots given back to
        the allocator in one call (a speculative step frees each request's rejected tail)."""
        self.allocator.free_group_begin()
        try:
            for req, lo, hi in zip(reqs, los, his, strict=True):
                self.free_positions(req, lo, hi)
        finally:
            self.allocator.free_group_end()

    def release(self, req: Req) -> None:
        """Gives the request's valid KV to the tree, frees the rest it holds, and returns its
        row. Safe at any point of a step (what was allocated beyond kv_len is freed too)."""
        if req.req_pool_idx is None:
            return
        if req.alloc_len > req.kv_len:
            self.free_positions(req, req.kv_len, req.alloc_len)
        row = self.host[req.req_pool_idx, : req.kv_len].clone()
        self.tree.cache_finished_req(req.all_ids, row, req.prefix_len, req.last_node, req.extra_key)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.decoder_state = None, None, None
        req.kv_len = req.alloc_len = req.prefix_len = 0
