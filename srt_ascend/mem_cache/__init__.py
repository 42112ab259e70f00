"""KV memory: request rows, the paged MLA KV pool, its allocator and the prefix caches.

Ownership in one line: the allocator owns free pages, a running request owns the slots it
allocated, the prefix cache owns what it has been handed (see ``base_prefix_cache``).
"""

from __future__ import annotations

from srt_ascend.mem_cache.allocator import TokenToKVPoolAllocator
from srt_ascend.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, TreeNode
from srt_ascend.mem_cache.chunk_cache import ChunkCache
from srt_ascend.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from srt_ascend.mem_cache.radix_cache import RadixCache

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "MLATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
]
