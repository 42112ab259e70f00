"""Waiting-queue order and prefill admission (which requests join the next prefill batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from srt_ascend.managers.schedule_batch import Req
from srt_ascend.mem_cache.base_prefix_cache import BasePrefixCache

# Tokens kept free per running request for its next decode steps, so a new prefill does not
# immediately force a retraction. Retraction still guarantees progress when this is too low.
DECODE_RESERVE_PER_REQ = 8


def order_waiting(waiting: list[Req], policy: str, cache: BasePrefixCache) -> list[Req]:
    """fcfs: arrival order. lpm: longest cached prefix first (ties by arrival)."""
    if policy == "fcfs" or len(waiting) < 2:
        return list(waiting)
    lens = {
        id(r): cache.match_prefix(r.all_ids[: r.max_prefix_len()], r.extra_key).prefix_len
        for r in waiting
    }
    return sorted(waiting, key=lambda r: (-lens[id(r)], r.created_time))


@dataclass
class PrefillPlan:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    chunked: set[str] = field(default_factory=set)


@dataclass
class PrefillAdder:
    """Admits requests while the token budget, the running-request limit and KV memory last.

    `available` is free KV tokens plus what the tree could evict. Each admitted request costs
    its extend tokens plus one page of slack (page-granular allocation).
    """

    budget: int  # prefill tokens this batch may compute (chunked-prefill size or unlimited)
    available: int
    free_req_slots: int
    page_size: int
    reserve: int  # tokens held back for the running requests' decode steps
    plan: PrefillPlan = field(default_factory=PrefillPlan)

    def try_add(self, req: Req, extend_len: int, can_chunk: bool) -> bool:
        if self.free_req_slots <= 0 or self.budget <= 0:
            return False
        take = min(extend_len, self.budget)
        if take < extend_len:
            if not can_chunk:
                return False
            take = take // self.page_size * self.page_size
            if take <= 0:
                return False
        cost = take + self.page_size
        if cost + self.reserve > self.available:
            return False
        self.plan.reqs.append(req)
        self.plan.extend_lens.append(take)
        if take < extend_len:
            self.plan.chunked.add(req.rid)
        self.budget -= take
        self.available -= cost
        self.free_req_slots -= 1
        self.reserve += min(req.remaining_new_tokens, DECODE_RESERVE_PER_REQ)
        return True
