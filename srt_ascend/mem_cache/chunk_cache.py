"""The cache used with ``--disable-radix-cache``: same interface, shares nothing.

Every request keeps its own slots from allocation to finish; the cache never owns any, so
``total_size()`` is always 0 and the idle invariant reduces to "the allocator is full".
"""

from __future__ import annotations

import torch

from srt_ascend.mem_cache.allocator import TokenToKVPoolAllocator
from srt_ascend.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, TreeNode


class ChunkCache(BasePrefixCache):
    """No-sharing prefix cache: matches nothing, frees a request's slots when it finishes."""

    def __init__(self, allocator: TokenToKVPoolAllocator):
        self.allocator = allocator
        self.device = allocator.device
        # Stand-in node returned as ``last_node``; locking it is a no-op.
        self.root_node = TreeNode(lock_ref=1)

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        """Always the empty prefix."""
        return MatchResult(
            device_indices=torch.empty(0, dtype=torch.int64, device=self.device),
            last_node=self.root_node,
        )

    def insert(
        self, token_ids: list[int], kv_indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """Takes ownership of ``kv_indices`` by freeing them at once; nothing was cached."""
        self.allocator.free(kv_indices)
        return 0

    def cache_finished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: TreeNode,
        extra_key: str | None = None,
    ) -> None:
        """Free all of the request's slots (every one of them is the request's own)."""
        self.allocator.free(kv_indices)

    def cache_unfinished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: TreeNode,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Keep everything with the request: returns its own indices unchanged, no lock."""
        return MatchResult(device_indices=kv_indices, last_node=self.root_node)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        """Nothing is cached, so nothing to drop."""
