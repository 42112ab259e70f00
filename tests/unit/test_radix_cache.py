"""RadixCache against a reference model, plus targeted structural cases.

The reference maps every cached page-aligned key prefix ``keys[:p+page_size]`` to the KV slots
of the page at positions ``p .. p+page_size-1``. A match must return the longest page-aligned
prefix present in it, with exactly its slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from srt_ascend.mem_cache import RadixCache, TokenToKVPoolAllocator, TreeNode

Ref = dict[tuple, tuple[int, ...]]  # page-aligned key prefix -> its last page's slots


def ref_keys(tokens: list[int], bigram: bool) -> list:
    return [(tokens[t], tokens[t + 1]) for t in range(len(tokens) - 1)] if bigram else tokens


def expected_match(ref: Ref, keys: list, page_size: int) -> list[int]:
    """Slots of the longest page-aligned prefix of ``keys`` present in ``ref``."""
    slots: list[int] = []
    while len(slots) + page_size <= len(keys) and tuple(keys[: len(slots) + page_size]) in ref:
        slots.extend(ref[tuple(keys[: len(slots) + page_size])])
    return slots


def tree_pages(cache: RadixCache) -> dict[tuple, tuple[tuple[int, ...], int]]:
    """Every cached page-aligned key prefix -> (its last page's slots, its node's access time)."""
    ps = cache.page_size
    out: dict[tuple, tuple[tuple[int, ...], int]] = {}
    stack: list[tuple[TreeNode, tuple]] = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            slots, child_path = child.value.tolist(), path
            for i in range(0, child.num_tokens, ps):
                child_path = child_path + tuple(child.key[i : i + ps])
                out[child_path] = (tuple(slots[i : i + ps]), child.last_access_time)
            stack.append((child, child_path))
    return out


def random_tokens(rng: random.Random, history: list[list[int]], vocab: int) -> list[int]:
    """Often extend a prefix of an earlier sequence, so that prefixes are shared."""
    if history and rng.random() < 0.6:
        base = rng.choice(history)
        base = base[: rng.randint(0, len(base))]
    else:
        base = []
    return base + [rng.randrange(vocab) for _ in range(rng.randint(0, 14))]


class Harness:
    """Drives a RadixCache and the reference side by side."""

    def __init__(self, page_size: int, bigram: bool, seed: int):
        self.rng = random.Random(seed)
        self.ps, self.bigram = page_size, bigram
        self.alloc = TokenToKVPoolAllocator(size=1024, page_size=page_size)
        self.cache = RadixCache(self.alloc, bigram_keys=bigram)
        self.ref: Ref = {}
        self.locks: list[tuple[TreeNode, tuple]] = []
        self.history: list[list[int]] = []

    def tokens(self) -> list[int]:
        toks = random_tokens(self.rng, self.history, vocab=2 if self.ps > 1 else 3)
        self.history.append(toks)
        return toks

    def op_match(self) -> None:
        toks = self.tokens()
        keys = ref_keys(toks, self.bigram)
        res = self.cache.match_prefix(toks)
        assert res.device_indices.tolist() == expected_match(self.ref, keys, self.ps)
        if res.prefix_len and self.rng.random() < 0.3:
            before = self.cache.evictable_size()
            delta = self.cache.inc_lock_ref(res.last_node)
            assert delta <= 0 and self.cache.evictable_size() == before + delta
            self.locks.append((res.last_node, tuple(keys[: res.prefix_len])))

    def op_unlock(self) -> None:
        node, _ = self.locks.pop(self.rng.randrange(len(self.locks)))
        before = self.cache.evictable_size()
        delta = self.cache.dec_lock_ref(node)
        assert delta >= 0 and self.cache.evictable_size() == before + delta

    def _record(self, keys: list, kv: torch.Tensor, start: int) -> None:
        slots = kv.tolist()
        for p in range(start, len(slots), self.ps):
            self.ref[tuple(keys[: p + self.ps])] = tuple(slots[p : p + self.ps])

    def _alloc(self, n: int) -> torch.Tensor | None:
        out = self.alloc.alloc(n)
        if out is None:
            self.cache.evict(n)  # locks may prevent it; then the op is skipped
            out = self.alloc.alloc(n)
        return out

    def op_insert(self, fresh: bool) -> None:
        toks = self.tokens()
        keys = ref_keys(toks, self.bigram)
        n = len(keys) - len(keys) % self.ps
        expected = len(expected_match(self.ref, keys[:n], self.ps))
        res = self.cache.match_prefix(toks)  # locked by nothing: no eviction until insert
        own = self._alloc(n if fresh else n - res.prefix_len)
        if own is None:
            return
        if not fresh and res.prefix_len and self.cache.match_prefix(toks).prefix_len == 0:
            self.alloc.free(own)  # our eviction took the prefix: retry later
            return
        kv = own if fresh else torch.cat([res.device_indices, own])
        already = self.cache.insert(toks, kv)
        assert already == expected
        if fresh:
            self.alloc.free(kv[:already])
        self._record(keys, kv, already)

    def op_evict(self) -> None:
        want = self.rng.randint(1, 40)
        before = tree_pages(self.cache)
        evictable, free = self.cache.evictable_size(), self.alloc.available_size()
        freed = self.cache.evict(want)
        after = tree_pages(self.cache)
        assert freed == (evictable if evictable < want else freed) and freed >= min(want, evictable)
        removed = set(before) - set(after)
        assert len(removed) * self.ps == freed and set(after) <= set(before)
        assert self.alloc.available_size() == free + freed
        assert self.cache.evictable_size() == evictable - freed
        for _, path in self.locks:
            assert path in after  # locked prefixes survive
        # LRU: nothing evicted is more recent than an evictable leaf that stayed.
        if removed:
            newest_removed = max(before[p][1] for p in removed)
            for node in self._evictable_leaves():
                assert node.last_access_time >= newest_removed
        self.ref = {p: slot for p, (slot, _) in after.items()}

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves, stack = [], list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def check(self) -> None:
        self.cache.check_invariants()
        cached = tree_pages(self.cache)
        assert {p: s for p, (s, _) in cached.items()} == self.ref
        assert self.cache.total_size() == len(self.ref) * self.ps
        # Only the tree and the allocator own slots here.
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.size


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bigram", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_ops_agree_with_reference(page_size, bigram, seed):
    h = Harness(page_size, bigram, seed)
    for _ in range(400):
        r = h.rng.random()
        if r < 0.35:
            h.op_match()
        elif r < 0.45 and h.locks:
            h.op_unlock()
        elif r < 0.85:
            h.op_insert(fresh=r < 0.6)
        else:
            h.op_evict()
        h.check()
    while h.locks:
        h.op_unlock()
    h.check()
    assert h.cache.evict(10**9) == len(h.ref) * page_size
    assert h.cache.total_size() == 0 and h.alloc.available_size() == h.alloc.size


def _insert(cache: RadixCache, alloc: TokenToKVPoolAllocator, tokens: list[int], n: int) -> int:
    kv = alloc.alloc(n)
    already = cache.insert(tokens, kv)
    alloc.free(kv[:already])
    return already


def test_split_on_partial_match_and_lock_sizes():
    alloc = TokenToKVPoolAllocator(size=32)
    cache = RadixCache(alloc)
    assert _insert(cache, alloc, [1, 2, 3, 4], 4) == 0
    assert _insert(cache, alloc, [1, 2, 5], 3) == 2
    res = cache.match_prefix([1, 2, 9])
    assert res.prefix_len == 2 and res.last_node.key == [1, 2]
    assert sorted(c.num_tokens for c in res.last_node.children.values()) == [1, 2]
    assert cache.total_size() == 5 and cache.evictable_size() == 5
    deep = cache.match_prefix([1, 2, 3, 4, 7])
    assert deep.prefix_len == 4
    assert cache.inc_lock_ref(deep.last_node) == -4
    assert (cache.protected_size(), cache.evictable_size()) == (4, 1)
    assert cache.inc_lock_ref(res.last_node) == 0  # already protected via the child
    assert cache.evict(100) == 1  # only [5] is evictable
    assert cache.dec_lock_ref(res.last_node) == 0
    assert cache.dec_lock_ref(deep.last_node) == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(deep.last_node)
    cache.check_invariants()
    assert cache.evict(1) == 2 and cache.total_size() == 2  # LRU leaf [3, 4] first


def test_page_aligned_match_and_insert():
    alloc = TokenToKVPoolAllocator(size=64, page_size=4)
    cache = RadixCache(alloc)
    with pytest.raises(ValueError):
        cache.insert(list(range(6)), alloc.alloc(4)[:3])
    assert _insert(cache, alloc, list(range(10)), 8) == 0
    assert cache.total_size() == 8
    assert cache.match_prefix(list(range(7))).prefix_len == 4
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 9]).prefix_len == 4
    assert cache.match_prefix([0, 1, 2, 9]).prefix_len == 0
    assert _insert(cache, alloc, [0, 1, 2, 3, 4, 5, 9, 9], 8) == 4
    cache.check_invariants()
    assert cache.total_size() == 12


def test_bigram_keys_need_the_next_token():
    alloc = TokenToKVPoolAllocator(size=32)
    cache = RadixCache(alloc, bigram_keys=True)
    kv = alloc.alloc(3)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], kv)  # position 2 has no pair
    assert cache.insert([1, 2, 3, 4], kv) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == kv[:2].tolist()
    assert cache.match_prefix([1, 2, 3, 5]).prefix_len == 2  # next token differs at 3
    assert cache.match_prefix([1, 2, 3, 4, 9]).device_indices.tolist() == kv.tolist()
    assert cache.match_prefix([1]).prefix_len == 0 and cache.match_prefix([]).prefix_len == 0


@pytest.mark.parametrize("page_size, bigram", [(1, False), (1, True), (4, False), (2, True)])
def test_salted_sequences_share_nothing_across_salts(page_size, bigram):
    """cache_salt seeds the tree: one salt shares prefixes, different salts (and no salt)
    never do, whatever the tokens."""
    alloc = TokenToKVPoolAllocator(size=128, page_size=page_size)
    cache = RadixCache(alloc, bigram_keys=bigram)
    tokens = list(range(1, 18))
    kv = alloc.alloc(16)
    assert cache.insert(tokens, kv, extra_key="a") == 0
    assert cache.match_prefix(tokens, "a").device_indices.tolist() == kv.tolist()
    assert cache.match_prefix(tokens, "b").prefix_len == 0
    assert cache.match_prefix(tokens).prefix_len == 0
    assert cache.insert(tokens, alloc.alloc(16), extra_key="b") == 0  # its own copy
    assert cache.insert(tokens, alloc.alloc(16)) == 0
    keys = 9 - bigram  # a 9-token prefix has 9 keys, or 8 token pairs
    assert cache.match_prefix(tokens[:9], "a").prefix_len == keys - keys % page_size
    cache.check_invariants()
    assert cache.total_size() == 48


def test_reset_frees_to_allocator_and_refuses_with_locks():
    alloc = TokenToKVPoolAllocator(size=16, page_size=2)
    cache = RadixCache(alloc)
    _insert(cache, alloc, [1, 2, 3, 4], 4)
    _insert(cache, alloc, [1, 2, 5, 6], 4)
    res = cache.match_prefix([1, 2, 5, 6])
    cache.inc_lock_ref(res.last_node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(res.last_node)
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == 16
    assert cache.match_prefix([1, 2]).prefix_len == 0


def test_match_refreshes_lru_so_the_other_branch_is_evicted_first():
    alloc = TokenToKVPoolAllocator(size=32)
    cache = RadixCache(alloc)
    _insert(cache, alloc, [1, 2, 3], 3)
    _insert(cache, alloc, [4, 5], 2)
    _insert(cache, alloc, [1, 2, 6], 3)  # splits [1, 2, 3]
    assert cache.match_prefix([1, 2, 3, 9]).prefix_len == 3  # [1, 2, 3] is now newest
    assert cache.evict(1) == 2  # [4, 5] is least recently used
    assert cache.match_prefix([4, 5]).prefix_len == 0
    assert cache.evict(1) == 1  # then [6], not the just-matched [3]
    assert cache.match_prefix([1, 2, 3]).prefix_len == 3
    assert cache.match_prefix([1, 2, 6]).prefix_len == 2
