"""Free-slot bookkeeping for the paged KV pool.

Layout. The pool has ``size`` usable token slots grouped into ``num_pages = size // page_size``
pages numbered ``1 .. num_pages``; slot ``page * page_size + offset`` is offset ``offset`` of
page ``page``. Page 0 (slots ``0 .. page_size-1``) is the reserved padding page of
:class:`~srt_ascend.mem_cache.memory_pool.MLATokenToKVPool` and is never handed out. With
``page_size == 1`` the slots are simply ``1 .. size``.

Page alignment. A request's position ``p`` always lives at offset ``p % page_size`` of its
page, and the positions ``k*page_size .. (k+1)*page_size-1`` of one request share one page.
:meth:`TokenToKVPoolAllocator.alloc_extend` and :meth:`alloc_decode` keep this true by
continuing in the partially filled last page before taking new pages. The radix cache relies
on it: its nodes hold whole pages.

Ownership. The allocator owns every page it has not handed out. A page handed out belongs to
the caller (a request, later possibly the radix tree) until it comes back through
:meth:`free`. ``free`` works on whole pages: it frees the unique pages that the given slot
indices belong to, so a caller must only free pages it wholly owns (with ``page_size > 1``
the unused tail of a request's last page belongs to that request). Freeing a page that is
already free raises ``ValueError`` instead of corrupting the free list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IntSeq = Sequence[int] | torch.Tensor


def _to_list(values: IntSeq) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


class TokenToKVPoolAllocator:
    """Hands out KV slots of a paged pool; see the module docstring for layout and ownership.

    ``available_size`` and all sizes are in tokens. ``check_double_free`` validates every
    :meth:`free` (cheap on CPU; a host sync on devices).
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        check_double_free: bool = True,
    ):
        if page_size <= 0 or size <= 0 or size % page_size != 0:
            raise ValueError(
                f"size must be a positive multiple of page_size: {size=}, {page_size=}"
            )
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.check_double_free = check_double_free
        self._free_pages = torch.empty(0, dtype=torch.int64, device=self.device)  # [n_free]
        # [num_pages + 1] True where the page is free; page 0 is never free.
        self._page_is_free = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._group: list[torch.Tensor] | None = None
        self.clear()

    # ------------------------------------------------------------------ state
    def available_size(self) -> int:
        """Free capacity in tokens (free pages times page_size)."""
        return int(self._free_pages.numel()) * self.page_size

    def clear(self) -> None:
        """Mark every page free. Any outstanding slots become invalid; use only when idle."""
        self._free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )
        self._page_is_free.fill_(True)
        self._page_is_free[0] = False
        self._group = None

    def _take_pages(self, n: int) -> torch.Tensor:
        """Pop ``n`` pages (caller has checked availability). Returns [n] page ids."""
        pages = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        self._page_is_free[pages] = False
        return pages

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of ``pages`` [n] in order, [n * page_size]."""
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    # ------------------------------------------------------------------ allocation
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` slots as whole fresh pages.

        ``need_size`` must be a multiple of page_size. Returns [need_size] slot indices owned
        by the caller, or None (and no change) if there is not enough room.
        """
        if need_size < 0 or need_size % self.page_size != 0:
            raise ValueError(f"alloc needs a multiple of page_size={self.page_size}: {need_size}")
        n_pages = need_size // self.page_size
        if n_pages > self._free_pages.numel():
            return None
        return self._page_slots(self._take_pages(n_pages))

    def alloc_extend(
        self, prefix_lens: IntSeq, seq_lens: IntSeq, last_loc: IntSeq
    ) -> torch.Tensor | None:
        """Allocate slots for positions ``prefix_len .. seq_len-1`` of each request.

        ``last_loc[i]`` is the slot of position ``prefix_len[i]-1`` (-1 when prefix_len is 0).
        If that slot is not at a page end, the request continues in its partially filled
        page (which it owns) before new pages are taken. Returns the concatenated
        ``out_cache_loc`` [sum(seq_len - prefix_len)] in request order, or None (and no
        change) if the free pages do not suffice.
        """
        prefix, seq, last = _to_list(prefix_lens), _to_list(seq_lens), _to_list(last_loc)
        if not len(prefix) == len(seq) == len(last):
            raise ValueError("prefix_lens, seq_lens and last_loc must have equal lengths")
        ps = self.page_size
        plan: list[tuple[int, int, int]] = []  # (last_loc, tokens in old page, new tokens)
        total_pages = 0
        for p, s, loc in zip(prefix, seq, last, strict=True):
            self._check_last_loc(p, s, loc)
            fill = min((ps - p % ps) % ps, s - p)
            new_tokens = s - p - fill
            plan.append((loc, fill, new_tokens))
            total_pages += -(-new_tokens // ps)
        if total_pages > self._free_pages.numel():
            return None
        new_slots = self._page_slots(self._take_pages(total_pages))
        parts: list[torch.Tensor] = []
        cursor = 0
        for loc, fill, new_tokens in plan:
            if fill:
                parts.append(torch.arange(loc + 1, loc + 1 + fill, device=self.device))
            if new_tokens:
                parts.append(new_slots[cursor : cursor + new_tokens])
                cursor += -(-new_tokens // ps) * ps
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(torch.int64)

    def _check_last_loc(self, prefix_len: int, seq_len: int, last_loc: int) -> None:
        if seq_len < prefix_len or prefix_len < 0:
            raise ValueError(f"bad extend: {prefix_len=} {seq_len=}")
        if prefix_len == 0:
            if last_loc != -1:
                raise ValueError(f"last_loc must be -1 for an empty prefix, got {last_loc}")
        elif (
            last_loc < self.page_size
            or last_loc % self.page_size != (prefix_len - 1) % self.page_size
        ):
            raise ValueError(
                f"last_loc {last_loc} breaks page alignment for prefix_len {prefix_len}"
            )

    def alloc_decode(self, seq_lens: IntSeq, last_loc: IntSeq) -> torch.Tensor | None:
        """Allocate one slot per request for position ``seq_len - 1`` (the new seq_len).

        ``last_loc[i]`` is the slot of position ``seq_len[i] - 2``. Continues in the current
        page unless ``last_loc`` is at a page end. Returns [batch] slots or None (no change).
        """
        if len(seq_lens) != len(last_loc):
            raise ValueError("seq_lens and last_loc must have equal lengths")
        if self.page_size == 1:  # every position is a page of its own: take len(seq) pages
            if len(seq_lens) > self._free_pages.numel():
                return None
            return self._take_pages(len(seq_lens)).clone()
        seq = torch.as_tensor(seq_lens, dtype=torch.int64, device=self.device)
        last = torch.as_tensor(last_loc, dtype=torch.int64, device=self.device)
        if self.page_size > 1 and bool(
            ((last + 1) % self.page_size != (seq - 1) % self.page_size).any()
        ):
            raise ValueError("last_loc breaks page alignment")
        needs_page = (last + 1) % self.page_size == 0  # [batch]
        n_pages = int(needs_page.sum())
        if n_pages > self._free_pages.numel():
            return None
        out = last + 1
        out[needs_page] = self._take_pages(n_pages) * self.page_size
        return out

    # ------------------------------------------------------------------ freeing
    def free(self, indices: IntSeq) -> None:
        """Give back the unique pages that ``indices`` [n] belong to.

        The caller must wholly own those pages. Inside a free group the pages are collected
        and released at :meth:`free_group_end`. Raises ``ValueError`` on a double free, on
        the padding page, or (page_size 1) on a slot repeated within one call.
        """
        indices = torch.as_tensor(indices, dtype=torch.int64, device=self.device).reshape(-1)
        if indices.numel() == 0:
            return
        if self._group is not None:
            self._group.append(indices)
            return
        self._release(indices)

    def _release(self, indices: torch.Tensor) -> None:
        if self.page_size == 1:
            pages = indices
            if self.check_double_free and torch.unique(pages).numel() != pages.numel():
                raise ValueError("double free: a slot is repeated in one free call")
        else:
            pages = torch.unique(indices // self.page_size)
        if self.check_double_free:
            if bool(((pages < 1) | (pages > self.num_pages)).any()):
                raise ValueError(f"free of slots outside the pool: {indices.tolist()}")
            if bool(self._page_is_free[pages].any()):
                raise ValueError(
                    f"double free of KV pages {pages[self._page_is_free[pages]].tolist()}"
                )
        self._page_is_free[pages] = True
        self._free_pages = torch.cat([self._free_pages, pages])

    def free_group_begin(self) -> None:
        """Start collecting frees; they take effect together at :meth:`free_group_end`."""
        if self._group is not None:
            raise RuntimeError("free group already open")
        self._group = []

    def free_group_end(self) -> None:
        """Release everything freed since :meth:`free_group_begin` in one operation."""
        if self._group is None:
            raise RuntimeError("free_group_end without free_group_begin")
        group, self._group = self._group, None
        if group:
            self._release(torch.cat(group))
