"""The FIA reference's plans and attention math (a private part of fia_reference: import from
there).

Per call: the requests split into runs whose padded scores stay under _SCORE_BUDGET, each
run's index tensors (`_ChunkPlan`: key slots, the mask of keys each query row may not attend)
built from the lengths and the block table only and kept per thread (`_LastCall`) for the
next layer's identical call, then one padded attention per run (`_attend_chunk`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from srt_ascend.utils import to_device

_SCORE_BUDGET = 1 << 26  # float32 score elements per chunk of requests (~256 MiB)


@dataclass(frozen=True)
class _Batch:
    """Host-side per-request lengths derived from the TND length lists."""

    q_starts: list[int]  # [B] first token of each request
    q_lens: list[int]  # [B]
    kv_lens: list[int]  # [B]

    def token_span(self, lo: int, hi: int) -> tuple[int, int]:
        """[first, end) TND rows of requests lo..hi-1 (contiguous by construction)."""
        start = self.q_starts[lo]
        return start, start + sum(self.q_lens[lo:hi])


def _paged_view(cache: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
    """View a paged cache as [num_blocks, block_size, kv_heads, D] (no copy for 3-D caches)."""
    if cache.dim() == 3:
        return cache.view(cache.shape[0], block_size, kv_heads, -1)
    return cache.transpose(1, 2)


def _request_chunks(batch: _Batch, num_heads: int) -> list[tuple[int, int]]:
    """Split requests into runs whose padded score tensors stay under _SCORE_BUDGET."""
    num = len(batch.q_lens)
    per_req = num_heads * max(batch.q_lens, default=0) * max(batch.kv_lens, default=0)
    step = max(1, _SCORE_BUDGET // max(per_req, 1))
    return [(lo, min(lo + step, num)) for lo in range(0, num, step)]


@dataclass
class _ChunkPlan:
    """Index tensors for one run of requests [lo, hi), derived from the lengths and the block
    table only, so every layer of a forward reuses them."""

    t0: int  # first TND row of the run
    t1: int
    max_q: int
    max_kv: int
    slots: torch.Tensor  # [b, max_kv] block * block_size + offset of each key (0 past kv_len)
    blocked: torch.Tensor  # [b, max_q, max_kv] keys each (padded) query row may not attend
    # Ragged query lengths only (None when all are equal: tokens already form [b, max_q]):
    req: torch.Tensor | None  # [t] request (in the run) of each token
    slot: torch.Tensor | None  # [t] query index of each token inside its request

    @property
    def uniform(self) -> bool:
        return self.req is None


class _LastCall(threading.local):
    """What the previous call in this thread derived, reused while the same block table, the
    same lengths and cache geometry come back (the FIA backend calls once per layer with the
    same metadata), and the mask already spot-checked (same object and, outside inference
    mode, version). Per thread: two engines in one process never see each other's plans."""

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None  # the table the plans were built from
        self.table_version = -1
        self.key: tuple | None = None
        self.plans: list[_ChunkPlan] = []
        self.mask: torch.Tensor | None = None
        self.mask_version = -1
        self.signature: tuple | None = None  # the last call that passed every check
        self.checked: tuple[int, _Batch] | None = None  # (kv heads, lengths) it derived
        self.checked_mask: torch.Tensor | None = None  # its mask (None: it had none)

    def checked_for(self, signature: tuple, mask: torch.Tensor | None) -> bool:
        """Whether an identical call (same signature, the same mask object, unmodified)
        already passed."""
        if signature != self.signature or mask is not self.checked_mask:
            return False
        return mask is None or self.mask_version == _version_of(mask)


_CACHE = _LastCall()


def _plans(
    batch: _Batch, block_table: torch.Tensor, cache: torch.Tensor, num_heads: int, causal: bool
) -> list[_ChunkPlan]:
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    key = (
        tuple(block_table.shape),
        block_table.device,
        tuple(batch.q_lens),
        tuple(batch.kv_lens),
        num_blocks,
        block_size,
        num_heads,
        causal,
    )
    # every layer of a forward passes the same table: identity and version, no value read
    if (
        _CACHE.key == key
        and _CACHE.table is block_table
        and _CACHE.table_version == _version_of(block_table)
    ):
        return _CACHE.plans
    plans = [
        _chunk_plan(batch, block_table, lo, hi, num_blocks, block_size, causal)
        for lo, hi in _request_chunks(batch, num_heads)
        if sum(batch.q_lens[lo:hi]) > 0
    ]
    _CACHE.table, _CACHE.table_version = block_table, _version_of(block_table)
    _CACHE.key, _CACHE.plans = key, plans
    return plans


def _version_of(t: torch.Tensor) -> int:
    """The in-place version counter; inference tensors have none (-1)."""
    return -1 if t.is_inference() else t._version


def _chunk_plan(
    batch: _Batch,
    block_table: torch.Tensor,
    lo: int,
    hi: int,
    num_blocks: int,
    block_size: int,
    causal: bool,
) -> _ChunkPlan:
    """Positions past kv_len read slot 0 (masked later), so unused table entries may hold
    any id; ids of valid positions must lie in [0, num_blocks)."""
    dev = block_table.device
    q_list, kv_list = batch.q_lens[lo:hi], batch.kv_lens[lo:hi]
    max_q, max_kv = max(q_list), max(kv_list)
    t0, t1 = batch.token_span(lo, hi)
    q_lens = to_device(q_list, dev)
    kv_lens = to_device(kv_list, dev)
    pos = torch.arange(max_kv, device=dev)
    blocks = block_table[lo:hi, : -(-max_kv // block_size)].long()
    if block_size > 1:
        blocks = blocks[:, pos // block_size] * block_size + pos % block_size
    slots = torch.where(pos[None, :] < kv_lens[:, None], blocks, 0)  # [b, max_kv]
    if slots.numel() and dev.type == "cpu":  # a value check: host sync on a device
        low, high = torch.aminmax(slots)
        if int(low) < 0 or int(high) >= num_blocks * block_size:
            raise ValueError(
                f"block_table holds block ids outside [0, {num_blocks}) for valid slots"
            )
    blocked = ~_allowed_keys(q_lens, kv_lens, max_q, max_kv, causal)
    req = slot = None
    if len(set(q_list)) > 1:
        req = torch.repeat_interleave(  # [t]; output_size: no host read of the sum
            torch.arange(hi - lo, device=dev), q_lens, output_size=t1 - t0
        )
        starts = to_device(batch.q_starts[lo:hi], dev) - t0
        slot = torch.arange(t1 - t0, device=dev) - starts[req]
    return _ChunkPlan(t0, t1, max_q, max_kv, slots, blocked, req, slot)


def _gather_kv(caches: list[torch.Tensor], plan: _ChunkPlan) -> list[torch.Tensor]:
    """Each request's first kv_len slots of every cache as [b, max_kv, kv_heads, D] float32;
    a cache passed twice (MLA: the latent is both key and value) is gathered once."""
    out: list[torch.Tensor] = []
    for c in caches:
        same = next((g for c0, g in zip(caches, out) if _same_view(c0, c)), None)
        if same is None:
            nb, bs = c.shape[0], c.shape[1]
            if bs == 1 or c.stride(0) == bs * c.stride(1):  # slots = one flat index: a view
                same = c.view(nb * bs, *c.shape[2:])[plan.slots]
            else:
                same = c[plan.slots // bs, plan.slots % bs]
            same = same.float()
        out.append(same)
    return out


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a and b as one view [..., Da + Db] when b's columns follow a's in one buffer (same
    rows, strides and dtype), else None."""

    def strides(t: torch.Tensor) -> list[int]:  # size-1 dims' strides are arbitrary
        return [st for n, st in zip(t.shape, t.stride()) if n != 1]

    if (
        a.shape[:-1] != b.shape[:-1]
        or strides(a)[:-1] != strides(b)[:-1]
        or a.dtype != b.dtype
        or a.stride(-1) != 1
        or b.data_ptr() != a.data_ptr() + a.shape[-1] * a.element_size()
    ):
        return None
    return a.as_strided((*a.shape[:-1], a.shape[-1] + b.shape[-1]), a.stride(), a.storage_offset())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _attend_chunk(
    query: torch.Tensor,
    query_rope: torch.Tensor | None,
    caches: list[torch.Tensor],
    plan: _ChunkPlan,
    scale: float,
    want_lse: bool,
    value_cols: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for one planned run of requests with at least one query token: pad them to
    [b, max_q] queries x [b, max_kv] keys; return float32 (out [t, N, Dv], lse [t, N] or None
    unless `want_lse`) for their t tokens in TND order. With `value_cols`, caches is [key] and
    the values are the key's first value_cols columns."""
    t0, t1, max_q, max_kv = plan.t0, plan.t1, plan.max_q, plan.max_kv
    b = plan.slots.shape[0]
    kv = _gather_kv(caches, plan)
    kv_heads = kv[0].shape[2]
    group = query.shape[1] // kv_heads

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, N, d] -> [b, max_q, kv_heads, group, d]
        if plan.uniform:
            return x[t0:t1].float().view(b, max_q, kv_heads, group, -1)
        buf = torch.zeros(b, max_q, *x.shape[1:], dtype=torch.float32, device=x.device)
        buf[plan.req, plan.slot] = x[t0:t1].float()
        return buf.view(b, max_q, kv_heads, group, -1)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [b, q, h, g, d] -> [b*h, q*g, d]
        return x.permute(0, 2, 1, 3, 4).reshape(b * kv_heads, max_q * group, x.shape[-1])

    def keys_t(x: torch.Tensor) -> torch.Tensor:  # [b, k, h, d] -> [b*h, d, k] (a view for h=1)
        return x.permute(0, 2, 1, 3).reshape(b * kv_heads, max_kv, x.shape[-1]).transpose(1, 2)

    scores = torch.bmm(heads_first(padded(query)), keys_t(kv[0]))
    if query_rope is not None:
        scores += torch.bmm(heads_first(padded(query_rope)), keys_t(kv[2]))
    scores = scores.view(b, kv_heads, max_q, group, max_kv).mul_(scale)  # [b, h, q, g, k]
    scores = scores.masked_fill_(plan.blocked[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all-masked rows -> 0
    vals = kv[0][..., :value_cols] if value_cols else kv[1]
    dv = vals.shape[-1]
    values = vals.permute(0, 2, 1, 3).reshape(b * kv_heads, max_kv, dv)
    ctx = torch.bmm(probs.view(b * kv_heads, max_q * group, max_kv), values)
    ctx = ctx.view(b, kv_heads, max_q, group, dv).permute(0, 2, 1, 3, 4)  # [b, q, h, g, dv]
    n = kv_heads * group
    ctx = (ctx if plan.uniform else ctx[plan.req, plan.slot]).reshape(t1 - t0, n, dv)
    if not want_lse:
        return ctx, None
    lse = torch.logsumexp(scores, dim=-1).permute(0, 2, 1, 3)  # [b, q, h, g]
    lse = lse.reshape(b * max_q, n) if plan.uniform else lse[plan.req, plan.slot].flatten(1, 2)
    return ctx, lse


def _allowed_keys(
    q_lens: torch.Tensor, kv_lens: torch.Tensor, max_q: int, max_kv: int, causal: bool
) -> torch.Tensor:
    """[b, max_q, max_kv] bool: which keys each (padded) query row may attend.

    Query i (0-based) of a request sees keys j < kv_len; with sparse_mode 3 (rightDownCausal,
    the causal diagonal aligned to the bottom-right corner) only j <= kv_len - q_len + i.
    Padded query rows (i >= q_len) and requests with kv_len 0 see nothing."""
    i = torch.arange(max_q, device=q_lens.device)[None, :, None]
    j = torch.arange(max_kv, device=q_lens.device)[None, None, :]
    q = q_lens[:, None, None]
    end = kv_lens[:, None, None] - (q - 1 - i if causal else 0)  # exclusive key bound
    return (j < end) & (i < q)
