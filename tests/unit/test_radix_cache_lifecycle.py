"""Simulated scheduler: requests go match -> chunked prefill -> decode -> finish (or retract).

Checks after every step: no KV slot (or page) is owned twice, each running request's
req_to_token row equals its slots, and cached KV data is right for the tokens it is keyed
by (bigram mode: also for the next token). When idle: allocator + cache == pool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from srt_ascend.mem_cache import (
    BasePrefixCache,
    ChunkCache,
    MLATokenToKVPool,
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    TreeNode,
)

POOL_TOKENS = 96
CHUNK = 6  # not a multiple of the page size: chunk ends fall inside pages


def prefix_hash(tokens: list[int]) -> float:
    """Stand-in for the main model's KV at the last position: depends on the whole prefix."""
    h = 7
    for tok in tokens:
        h = (h * 31 + tok + 1) % 1_000_003
    return float(h)


@dataclass
class SimReq:
    prompt: list[int]
    max_new: int
    row: int
    kv: torch.Tensor  # [computed positions] KV slots
    prefix_len: int
    last_node: TreeNode
    output: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Sim:
    def __init__(self, cache_kind: str, page_size: int, bigram: bool, seed: int):
        self.rng = random.Random(seed)
        self.ps, self.bigram = page_size, bigram
        self.alloc = TokenToKVPoolAllocator(size=POOL_TOKENS, page_size=page_size)
        self.cache: BasePrefixCache = (
            RadixCache(self.alloc, bigram_keys=bigram)
            if cache_kind == "radix"
            else ChunkCache(self.alloc)
        )
        self.req_pool = ReqToTokenPool(size=4, max_context_len=128)
        self.kv_pool = MLATokenToKVPool(POOL_TOKENS, page_size, torch.float32, 1, 1, 1)
        self.running: list[SimReq] = []
        self.history: list[list[int]] = []
        self.stats = {"finished": 0, "retracted": 0, "hit_tokens": 0}

    # ---------------------------------------------------------------- request steps
    def admit(self) -> None:
        rows = self.req_pool.alloc(1)
        if rows is None:
            return
        base = self.rng.choice(self.history)[: self.rng.randint(0, 40)] if self.history else []
        prompt = base + [self.rng.randrange(4) for _ in range(self.rng.randint(1, 20))]
        self.history.append(prompt)
        # Leave at least one prompt position to compute (bigram keys already do).
        res = self.cache.match_prefix(prompt if self.bigram else prompt[:-1])
        self.cache.inc_lock_ref(res.last_node)
        self.check_kv_data(prompt, res.device_indices)
        self.stats["hit_tokens"] += res.prefix_len
        req = SimReq(
            prompt=prompt,
            max_new=self.rng.randint(0, 10),
            row=rows[0],
            kv=res.device_indices,
            prefix_len=res.prefix_len,
            last_node=res.last_node,
            output=[],
        )
        self.req_pool.req_to_token[req.row, : res.prefix_len] = res.device_indices
        self.running.append(req)

    def _get_slots(self, req: SimReq, new_len: int) -> torch.Tensor | None:
        n = req.kv.numel()
        last = int(req.kv[-1]) if n else -1
        for attempt in range(2):
            out = (
                self.alloc.alloc_decode([new_len], [last])
                if new_len == n + 1 and attempt == 0 and self.rng.random() < 0.5
                else self.alloc.alloc_extend([n], [new_len], [last])
            )
            if out is not None:
                return out
            self.cache.evict(new_len - n + self.ps)
        return None

    def extend(self, req: SimReq, new_len: int) -> bool:
        """Compute positions len(kv)..new_len-1; False if memory ran out."""
        n = req.kv.numel()
        out = self._get_slots(req, new_len)
        if out is None:
            return False
        assert out.numel() == new_len - n
        assert self.owned_slots().isdisjoint(out.tolist()), "slot handed out twice"
        req.kv = torch.cat([req.kv, out])
        self.req_pool.req_to_token[req.row, n:new_len] = out
        toks = req.tokens
        for t in range(n, new_len):
            self.kv_pool.get_c_kv(0)[req.kv[t], 0, 0] = prefix_hash(toks[: t + 1])
        self.write_next_token(req)
        return True

    def write_next_token(self, req: SimReq) -> None:
        """Draft-layer stand-in: slot of position t records token t+1 once it is known."""
        toks, n = req.tokens, req.kv.numel()
        known = min(n, len(toks) - 1)
        if known > 0:
            nxt = torch.tensor(toks[1 : known + 1], dtype=torch.float32)
            self.kv_pool.get_k_pe(0)[req.kv[:known], 0, 0] = nxt

    def step(self, req: SimReq) -> None:
        n = req.kv.numel()
        if n < len(req.prompt):  # prefill chunk
            if not self.extend(req, min(n + CHUNK, len(req.prompt))):
                return self.retire(req, retracted=True)
            if req.kv.numel() < len(req.prompt):
                res = self.cache.cache_unfinished_req(
                    req.prompt, req.kv, req.prefix_len, req.last_node
                )
                m = res.prefix_len
                self.req_pool.req_to_token[req.row, :m] = res.device_indices
                req.kv = torch.cat([res.device_indices, req.kv[m:]])
                req.prefix_len, req.last_node = m, res.last_node
                return
            req.output.append(self.rng.randrange(4))  # first sampled token
        elif len(req.output) < req.max_new:  # decode the last sampled token
            if not self.extend(req, n + 1):
                return self.retire(req, retracted=True)
            req.output.append(self.rng.randrange(4))
        else:
            return self.retire(req, retracted=False)
        self.write_next_token(req)

    def retire(self, req: SimReq, retracted: bool) -> None:
        self.cache.cache_finished_req(req.tokens, req.kv, req.prefix_len, req.last_node)
        self.req_pool.free(req.row)
        self.running.remove(req)
        self.stats["retracted" if retracted else "finished"] += 1

    # ---------------------------------------------------------------- checks
    def tree_slots(self) -> list[int]:
        slots, stack = [], [self.cache.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.cache.root_node:
                slots.extend(node.value.tolist())
        return slots

    def req_own_slots(self, req: SimReq) -> list[int]:
        """Slots the request owns: past its cached prefix (all of them with ChunkCache)."""
        start = req.prefix_len if isinstance(self.cache, RadixCache) else 0
        return req.kv[start:].tolist()

    def owned_slots(self) -> set[int]:
        return set(self.tree_slots()) | {s for r in self.running for s in self.req_own_slots(r)}

    def check_ownership(self) -> None:
        tree = self.tree_slots()
        assert len(tree) == len(set(tree)) == self.cache.total_size()
        owners = [{s // self.ps for s in tree}]
        for req in self.running:
            own = self.req_own_slots(req)
            assert set(own).isdisjoint(tree)
            owners.append({s // self.ps for s in own})
            n = req.kv.numel()
            assert torch.equal(self.req_pool.req_to_token[req.row, :n], req.kv)
        assert sum(len(p) for p in owners) == len(set().union(*owners)), "page owned twice"
        free_pages = self.alloc.available_size() // self.ps
        assert free_pages + sum(len(p) for p in owners) == self.alloc.num_pages

    def check_kv_data(self, tokens: list[int], slots: torch.Tensor) -> None:
        for t, slot in enumerate(slots.tolist()):
            assert self.kv_pool.get_c_kv(0)[slot, 0, 0].item() == prefix_hash(tokens[: t + 1])
            if self.bigram:
                assert self.kv_pool.get_k_pe(0)[slot, 0, 0].item() == tokens[t + 1]

    def check_idle(self) -> None:
        assert not self.running and self.req_pool.available_size() == self.req_pool.size
        assert self.alloc.available_size() + self.cache.total_size() == POOL_TOKENS
        assert self.cache.protected_size() == 0


def run_sim(sim: Sim, steps: int) -> None:
    for i in range(steps):
        if sim.running and sim.rng.random() < 0.75:
            sim.step(sim.rng.choice(sim.running))
        else:
            sim.admit()
        sim.check_ownership()
        if i % 50 == 49 and isinstance(sim.cache, RadixCache):
            sim.cache.check_invariants()
    while sim.running:
        sim.step(sim.running[0])
    sim.check_ownership()
    sim.check_idle()


@pytest.mark.parametrize("bigram", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_lifecycle_no_leaks_no_double_ownership(page_size, bigram):
    sim = Sim("radix", page_size, bigram, seed=page_size * 10 + bigram)
    run_sim(sim, steps=700)
    assert sim.stats["finished"] > 20 and sim.stats["hit_tokens"] > 100
    assert sim.stats["retracted"] > 0  # the pool is small enough to run out
    assert sim.cache.total_size() > 0
    sim.cache.check_invariants()
    sim.cache.evict(POOL_TOKENS)
    assert sim.alloc.available_size() == POOL_TOKENS


def test_finished_request_is_matchable_up_to_its_computed_kv():
    for page_size, bigram in [(1, False), (1, True), (4, False), (4, True)]:
        sim = Sim("radix", page_size, bigram, seed=0)
        sim.history = []
        sim.admit()
        req = sim.running[0]
        while sim.running:
            sim.step(req)
        computed = len(req.tokens) - 1  # the last sampled token has no KV
        res = sim.cache.match_prefix(req.tokens)
        assert res.prefix_len == computed - computed % page_size
        sim.check_kv_data(req.tokens, res.device_indices)
        sim.check_idle()


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_lifecycle_shares_nothing(page_size):
    sim = Sim("chunk", page_size, bigram=False, seed=3)
    run_sim(sim, steps=400)
    assert sim.stats["finished"] > 10 and sim.stats["hit_tokens"] == 0
    assert sim.cache.total_size() == 0 and sim.alloc.available_size() == POOL_TOKENS
    assert sim.cache.evict(100) == 0
    own = sim.alloc.alloc(2 * page_size)
    res = sim.cache.cache_unfinished_req([1, 2], own, 0, sim.cache.root_node)
    assert res.device_indices is own and res.prefix_len == 2 * page_size
    sim.cache.cache_finished_req([1, 2, 3], own, 0, res.last_node)
    assert sim.alloc.available_size() == POOL_TOKENS
