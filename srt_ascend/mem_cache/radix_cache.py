"""Radix-tree prefix cache over KV slot indices (and the ``--disable-radix-cache`` fallback).

Keys. Position ``t`` of a sequence is keyed by ``token_ids[t]``; with ``bigram_keys=True`` it
is keyed by the pair ``(token_ids[t], token_ids[t+1])`` instead. Bigram keys are for MTP
speculative decoding: the draft layer's KV at position t is computed from the main model's
hidden state at t and the embedding of token t+1, so a cached slot is only reusable where the
next token matches too. A sequence of n tokens therefore has n-1 keys, ``match_prefix`` matches
over those pairs, and the request-level calls need ``token_ids`` one longer than the keyed KV
(positions without a pair are treated like an unaligned tail: not cached).

Salts. A request's ``extra_key`` (its ``cache_salt``) replaces the key of position 0 by
``(SALT, extra_key, key)``, so the salt seeds the tree below the root: sequences with different
salts diverge at their first key and never share a node, while one salt shares as usual.

Pages. With ``page_size > 1`` only whole pages are matched and inserted, children are keyed by
the tuple of their first page's keys, and nodes split only at page boundaries, so every node's
slots are whole pages that the tree can free on its own.

Locks and sizes. ``lock_ref`` propagates from a locked node up to the root; a node with
``lock_ref > 0`` is protected, otherwise evictable, and ``evictable_size()`` /
``protected_size()`` sum the key lengths of each kind. Eviction is LRU over unlocked leaves.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from srt_ascend.mem_cache.allocator import TokenToKVPoolAllocator
from srt_ascend.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    MatchResult,
    TreeNode,
    next_access_time,
)
from srt_ascend.mem_cache.chunk_cache import ChunkCache

_SALT = "salt"  # tags a salted first key (a str never equals a token id or a token pair)

__all__ = ["BasePrefixCache", "ChunkCache", "MatchResult", "RadixCache", "TreeNode"]


class RadixCache(BasePrefixCache):
    """Token-keyed radix tree mapping cached prefixes to KV slots it owns.

    The tree frees slots to ``allocator`` on eviction, on ``reset`` and for request
    duplicates/tails in ``cache_finished_req`` / ``cache_unfinished_req``. See
    :mod:`srt_ascend.mem_cache.base_prefix_cache` for the ownership contract.
    """

    def __init__(self, allocator: TokenToKVPoolAllocator, bigram_keys: bool = False):
        self.allocator = allocator
        self.bigram_keys = bigram_keys
        self.device = allocator.device
        self._reset_tree()

    @property
    def page_size(self) -> int:
        """The allocator's: whole pages are matched, inserted and evicted."""
        return self.allocator.page_size

    # ------------------------------------------------------------------ keys
    def _keys(self, token_ids: list[int], extra_key: str | None = None) -> list[Any]:
        """Per-position keys: tokens, or (token, next token) pairs in bigram mode; with an
        ``extra_key`` the first one is salted."""
        if self.bigram_keys:
            keys: list[Any] = list(zip(token_ids[:-1], token_ids[1:], strict=True))
        else:
            keys = list(token_ids)
        if extra_key is not None and keys:
            keys[0] = (_SALT, extra_key, keys[0])
        return keys

    def _align(self, n: int) -> int:
        return n - n % self.page_size

    def _child_key(self, key: list[Any]) -> tuple[Any, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[Any], b: list[Any]) -> int:
        """Length of the common prefix of ``a`` and ``b``, rounded down to whole pages."""
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return self._align(n)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ state
    def _reset_tree(self) -> None:
        """Forget the tree without freeing anything."""
        self.root_node = TreeNode(key=[], value=self._empty(), lock_ref=1)
        self._evictable_size = 0
        self._protected_size = 0

    def reset(self) -> None:
        """Free every cached slot to the allocator and start empty.

        Requires that no request holds a lock. Do not also ``allocator.clear()`` afterwards
        expecting the cache's slots to be freed twice: they already are.
        """
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens")
        values = [node.value for node in self._iter_nodes() if node is not self.root_node]
        if values:
            self.allocator.free(torch.cat(values))
        self._reset_tree()

    def _iter_nodes(self) -> list[TreeNode]:
        nodes, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def evictable_size(self) -> int:
        return self._evictable_size

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tree's structure or size accounting is broken.

        Checks: node key/value lengths are equal whole pages; parent/child links agree;
        a node's lock_ref covers its children's; parents are at least as recent as children;
        each page's slots are one allocator page in order; no slot appears twice; the
        evictable/protected counters equal the sums over nodes. O(tree size); for tests and
        debugging.
        """
        evictable = protected = 0
        seen: set[int] = set()
        for node in self._iter_nodes():
            for key, child in node.children.items():
                assert child.parent is node and key == self._child_key(child.key)
                assert node.last_access_time >= child.last_access_time, "LRU order broken"
            if node is self.root_node:
                continue
            child_locks = sum(child.lock_ref for child in node.children.values())
            assert node.lock_ref >= child_locks, "lock_ref not propagated"
            n = node.num_tokens
            assert n > 0 and n % self.page_size == 0 and node.value.numel() == n
            pages = node.value.reshape(-1, self.page_size)
            offsets = torch.arange(self.page_size, device=pages.device)
            assert bool((pages == pages[:, :1] + offsets).all()), "node is not whole pages"
            assert bool((pages[:, 0] % self.page_size == 0).all()), "node is not page-aligned"
            slots = node.value.tolist()
            assert seen.isdisjoint(slots), "a slot is owned twice by the tree"
            seen.update(slots)
            if node.lock_ref > 0:
                protected += n
            else:
                evictable += n
        assert (evictable, protected) == (self._evictable_size, self._protected_size)

    def protected_size(self) -> int:
        return self._protected_size

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached whole-page prefix of ``token_ids``.

        Returns the slots of the matched positions (owned by the tree) and the deepest node
        on the path, splitting a node when the match ends inside it. Does not lock; the
        caller must ``inc_lock_ref(result.last_node)`` before any eviction can run.
        Refreshes the LRU time of the matched path.
        """
        keys = self._keys(token_ids, extra_key)
        return self._match_keys(keys[: self._align(len(keys))])

    def _walk(self, key: list[Any], now: int) -> tuple[TreeNode, list[torch.Tensor]]:
        """Follow ``key`` from the root, splitting where the match ends inside a node.

        Stamps every node on the path with ``now``. Returns the deepest matched node and the
        slot tensors of the matched nodes, in order.
        """
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, key = child, key[n:]
        return node, values

    def _match_keys(self, key: list[Any]) -> MatchResult:
        node, values = self._walk(key, next_access_time())
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, last_node=node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after its first ``n`` keys; returns the new upper node."""
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n].clone(),
            parent=child.parent,
            lock_ref=child.lock_ref,
            last_access_time=child.last_access_time,
        )
        child.parent.children[self._child_key(upper.key)] = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def insert(
        self, token_ids: list[int], kv_indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """Insert positions ``0 .. len(kv_indices)-1``; returns how many were already cached.

        ``len(kv_indices)`` must be a multiple of page_size and every position needs a key
        (bigram mode: ``len(token_ids) > len(kv_indices)``). The tree takes ownership of the
        slots past the returned length; the caller frees its own slots before it.
        """
        n = kv_indices.numel()
        keys = self._keys(token_ids, extra_key)
        if n % self.page_size or len(keys) < n:
            raise ValueError(f"insert needs whole pages with keys: {n=}, keys={len(keys)}")
        return self._insert_keys(keys[:n], kv_indices.reshape(-1))

    def _insert_keys(self, key: list[Any], value: torch.Tensor) -> int:
        now = next_access_time()
        node, values = self._walk(key, now)
        matched = sum(v.numel() for v in values)
        if matched < len(key):
            leaf = TreeNode(
                key=list(key[matched:]),
                value=value[matched:].to(torch.int64).clone(),
                parent=node,
                last_access_time=now,
            )
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_size += leaf.num_tokens
        return matched

    # ------------------------------------------------------------------ request-level
    def _insert_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        extra_key: str | None,
    ) -> tuple[list[Any], int]:
        """Insert a request's cacheable part and free its duplicate slots.

        Returns the inserted keys and their count (the page-aligned keyed length).
        """
        keys = self._keys(token_ids, extra_key)
        aligned = self._align(min(len(keys), kv_indices.numel()))
        if not prefix_len <= aligned or prefix_len % self.page_size:
            raise ValueError(f"prefix_len {prefix_len} inconsistent with cacheable {aligned}")
        keys = keys[:aligned]
        new_prefix = self._insert_keys(keys, kv_indices[:aligned])
        if new_prefix < prefix_len:
            raise RuntimeError("a locked prefix was evicted")
        # Slots in [prefix_len, new_prefix) are the request's copies of cached positions.
        self.allocator.free(kv_indices[prefix_len:new_prefix])
        return keys, aligned

    def cache_finished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: TreeNode,
        extra_key: str | None = None,
    ) -> None:
        """Insert the whole-page keyed part, free duplicates and the tail, release the lock.

        After the call the tree owns positions ``0 .. aligned-1`` and the rest of
        ``kv_indices`` is back in the allocator; the request owns no KV slots.
        """
        _, aligned = self._insert_req(token_ids, kv_indices, prefix_len, extra_key)
        self.allocator.free(kv_indices[aligned:])
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: TreeNode,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Insert what is computed so far and move the lock to the new deepest node.

        Returns the tree's slots for positions ``0 .. m-1`` (m = whole-page keyed length),
        which replace the request's own; ``kv_indices[m:]`` stay owned by the request.
        """
        keys, aligned = self._insert_req(token_ids, kv_indices, prefix_len, extra_key)
        result = self._match_keys(keys)
        if result.prefix_len != aligned:
            raise RuntimeError(f"re-match found {result.prefix_len} of {aligned} inserted tokens")
        self.inc_lock_ref(result.last_node)
        self.dec_lock_ref(last_node)
        return result

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors. Returns the (non-positive) evictable-size delta."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= node.num_tokens
                self._protected_size += node.num_tokens
                delta -= node.num_tokens
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock on ``node`` and its ancestors. Returns the evictable-size delta."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node")
            if node.lock_ref == 1:
                self._evictable_size += node.num_tokens
                self._protected_size -= node.num_tokens
                delta += node.num_tokens
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Evict least-recently-used unlocked leaves until ``num_tokens`` are freed.

        Parents that become unlocked leaves join the candidates. Frees the slots to the
        allocator and returns the number of tokens freed (may exceed ``num_tokens`` by up
        to one node, or fall short when everything evictable is gone).
        """
        heap = [
            (node.last_access_time, id(node), node)
            for node in self._iter_nodes()
            if node.is_leaf and node.lock_ref == 0 and node is not self.root_node
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            freed.append(node.value)
            num_freed += node.num_tokens
            self._evictable_size -= node.num_tokens
            if parent.is_leaf and parent.lock_ref == 0 and parent is not self.root_node:
                heapq.heappush(heap, (parent.last_access_time, id(parent), parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed
