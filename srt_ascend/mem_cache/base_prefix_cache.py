"""The prefix-cache interface the scheduler talks to, and its boundary types.

Request-level contract (shared by every cache):

* ``match_prefix(token_ids)`` finds cached KV for a prefix of ``token_ids``. It does not
  lock: the caller locks ``last_node`` with :meth:`BasePrefixCache.inc_lock_ref` before
  anything can evict (i.e. before the next ``evict`` call), and from then on the returned
  slots are shared, read-only, and owned by the cache.
* While a request runs, ``kv_indices`` are its KV slots for positions ``0 .. n-1``: the first
  ``prefix_len`` came from the cache (locked via ``last_node``), the rest the request
  allocated itself and owns.
* ``cache_unfinished_req`` (chunked prefill) hands what is computed so far to the cache and
  returns the request's new prefix, moving the lock; ``cache_finished_req`` hands everything
  over, frees the rest and drops the lock. After it the request owns no KV slots. Aborts and
  retractions use ``cache_finished_req`` too.
* ``extra_key`` (SGLang's, from a request's ``cache_salt``): sequences with different keys
  never share cached KV; ``None`` is a key of its own (the unsalted tree).
* When idle (no request holds slots or locks):
  ``allocator.available_size() + cache.total_size() == allocator.size``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

_access_clock = itertools.count(1)


def next_access_time() -> int:
    """Monotonic logical clock for LRU; one tick per cache operation, shared by its path."""
    return next(_access_clock)


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class TreeNode:
    """A node of the radix tree: a run of keys and the KV slots holding them.

    ``key`` [n] (token ids, or token bigrams) and ``value`` [n] (KV slot indices) have equal
    length, a multiple of the page size. ``lock_ref`` counts running requests whose matched
    prefix passes through this node; a node with ``lock_ref > 0`` is never evicted. The
    tree owns ``value``'s slots.
    """

    key: list[Any] = field(default_factory=list)
    value: torch.Tensor = field(default_factory=_no_slots)  # [len(key)] int64 KV slot indices
    parent: TreeNode | None = None
    children: dict[tuple[Any, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = field(default_factory=next_access_time)

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    """Result of a prefix match.

    ``device_indices`` [prefix_len] are the KV slots of the matched prefix, owned by the cache;
    ``last_node`` is the deepest matched node, the handle to lock while they are in use.
    """

    device_indices: torch.Tensor  # [prefix_len] int64
    last_node: TreeNode

    @property
    def prefix_len(self) -> int:
        return int(self.device_indices.numel())


class BasePrefixCache(ABC):
    """Interface of a KV prefix cache; see the module docstring for the ownership contract."""

    @abstractmethod
    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` under ``extra_key``. Does not lock; changes
        only LRU times."""

    @abstractmethod
    def insert(
        self, token_ids: list[int], kv_indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """Store ``kv_indices`` [n] as the KV of the first n positions of ``token_ids``.

        Ownership of all n slots passes to the cache, except that the first ``r`` positions
        (``r``, the return value) were already cached: the caller frees its own slots among
        ``kv_indices[:r]`` (those it did not get from the cache).
        """

    @abstractmethod
    def cache_finished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: TreeNode,
        extra_key: str | None = None,
    ) -> None:
        """Hand a finished (or aborted) request's KV to the cache and release its lock.

        ``kv_indices`` [n] cover positions 0..n-1 and ``token_ids`` may be longer (tokens
        whose KV was never computed). Afterwards the request owns no KV slots.
        """

    @abstractmethod
    def cache_unfinished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: TreeNode,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Cache a running request's computed KV (chunked prefill) and move its lock.

        Returns the request's new prefix: ``device_indices`` [m] replace
        ``kv_indices[:m]`` (write them into the request's req_to_token row); the request
        keeps owning ``kv_indices[m:]``, and ``last_node`` is now locked in place of the old.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked cached tokens if possible; returns freed."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors; returns the change of ``evictable_size()``."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock_ref`; returns the change of ``evictable_size()``."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens that no running request holds (can be evicted)."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens locked by running requests."""

    def total_size(self) -> int:
        """All tokens the cache owns."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry, returning its slots to the allocator (when idle)."""
