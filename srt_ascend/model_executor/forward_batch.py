"""ForwardBatch: what one model forward needs, as index tensors over the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

from srt_ascend.utils import to_device

if TYPE_CHECKING:
    from srt_ascend.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill / chunked prefill: many new tokens per request
    DECODE = auto()  # one new token per request
    TARGET_VERIFY = auto()  # 1 + K tokens per request (speculative verify)
    DRAFT_EXTEND = auto()  # MTP module over accepted tokens
    IDLE = auto()  # no requests (a rank that must still join collectives)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class ForwardBatch:
    """Row b has `extend_seq_lens[b]` new tokens at positions seq_lens[b]-extend_seq_lens[b] ..
    seq_lens[b]-1; its KV slots are req_to_token[req_pool_indices[b], :seq_lens[b]] (the new
    tokens' slots, `out_cache_loc`, already written there by the scheduler).

    Several rows may share one request row (batch-expanded verify): they differ in seq_lens.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, KV length after this forward
    extend_seq_lens: torch.Tensor  # [B] int64, new tokens per row
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    seq_lens_cpu: list[int]  # exact, or upper bounds when `host_lengths_exact` is False
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MLATokenToKVPool
    attn_backend: Any  # layers.attention.base.AttentionBackend (which imports this module)
    attn_metadata: Any = field(default=None, repr=False)  # the backend's per-batch cache
    # Set by the graph runner: every row has the same query length (FIA rows excepted), KV is
    # read through a fixed window of this many positions, and nothing may depend on host
    # values of the device tensors (no data-dependent shapes), so the forward can be captured.
    static_kv_len: int | None = None
    # Set by the graph runner for FIA rows (ragged): the most query tokens a row with KV holds
    # (1+K; padding rows with KV length 0 may hold more), a constant of the captured graph.
    static_max_q: int | None = None
    # Data-parallel attention: tokens of this forward in every DP group (index: DP rank),
    # exchanged by the model runner before the forward; None without DP attention.
    dp_token_counts: list[int] | None = None
    # False when `seq_lens` was built on the device (an overlapped MTP round, whose lengths
    # follow the previous round's accept lengths) and `seq_lens_cpu` holds upper bounds: a
    # backend may size its KV window by them, never read a row's length from them.
    host_lengths_exact: bool = True

    @property
    def static_shapes(self) -> bool:
        return self.static_kv_len is not None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc(self) -> torch.Tensor:  # [B] offset of each row's first token
        return torch.cumsum(self.extend_seq_lens, 0) - self.extend_seq_lens

    @property
    def last_token_index(self) -> torch.Tensor:  # [B] index of each row's last token in [T]
        return torch.cumsum(self.extend_seq_lens, 0) - 1

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: list[int] | torch.Tensor,
        req_pool_indices: list[int],
        seq_lens: list[int] | torch.Tensor,
        extend_seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MLATokenToKVPool,
        attn_backend: Any,
        device: torch.device | str = "cpu",
        init_metadata: bool = True,
        seq_bounds: list[int] | None = None,
    ) -> ForwardBatch:
        """Builds positions from the lengths and (unless the caller defers it, as the model
        runner does for batches a graph may replay) lets the backend precompute its metadata.
        Host inputs reach `device` together, by one async copy (`pack_to_device`); device
        tensors (e.g. draft tokens) are used as they are. `seq_lens` on the device comes with
        `seq_bounds`, host upper bounds of its values, and one query length for every row:
        the positions are then computed on the device too (`host_lengths_exact` False)."""
        exact = not isinstance(seq_lens, torch.Tensor)
        if exact:
            positions = [p for s, e in zip(seq_lens, extend_seq_lens) for p in range(s - e, s)]
            seq_bounds = list(seq_lens)
        else:
            if seq_bounds is None or len(set(extend_seq_lens)) > 1:
                raise ValueError("device seq_lens need host bounds and one query length")
            q = extend_seq_lens[0] if extend_seq_lens else 0
            seq_lens = seq_lens.to(device)
            steps = torch.arange(-q, 0, device=seq_lens.device)
            positions = (seq_lens.view(-1, 1) + steps).view(-1)
        ids, pos, rows, lens, ext, loc = pack_to_device(
            [input_ids, positions, req_pool_indices, seq_lens, extend_seq_lens, out_cache_loc],
            device,
        )
        fb = cls(
            forward_mode=forward_mode,
            input_ids=ids,
            positions=pos,
            req_pool_indices=rows,
            seq_lens=lens,
            extend_seq_lens=ext,
            out_cache_loc=loc,
            seq_lens_cpu=list(seq_bounds),
            extend_seq_lens_cpu=list(extend_seq_lens),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            host_lengths_exact=exact,
        )
        if init_metadata:
            attn_backend.init_forward_metadata(fb)
        return fb


def pack_to_device(
    parts: list[list[int] | torch.Tensor], device: torch.device | str
) -> list[torch.Tensor]:
    """Each of `parts` as an int64 vector on `device`. Host data (lists, and CPU tensors when
    `device` is not the host) is concatenated on the host and sent by one copy
    (utils.to_device: pinned and async where the device has a runtime), then handed back as
    views of that one tensor; a tensor already on `device` passes through as itself (a buffer
    a launched step fills later stays the batch's). A step's batch is then one host->device
    copy, not one per field. The views share storage: nobody may resize them."""
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(parts)
    lists: list[int] = []  # the host lists, flattened in order: one tensor build
    list_at: list[tuple[int, int]] = []  # (part, length)
    tensors: list[tuple[int, torch.Tensor]] = []  # host tensors, after the lists
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            lists.extend(p)
            list_at.append((i, len(p)))
        elif p.device.type != "cpu" or device.type == "cpu":  # already where it is used
            out[i] = p.to(device=device, dtype=torch.int64)
        else:
            tensors.append((i, p.to(dtype=torch.int64).reshape(-1)))
    if not list_at and not tensors:
        return out  # type: ignore[return-value]
    host = [torch.tensor(lists, dtype=torch.int64)] + [t for _, t in tensors]
    packed = to_device(torch.cat(host) if len(host) > 1 else host[0], device)
    sizes = [n for _, n in list_at] + [int(t.numel()) for _, t in tensors]
    order = [i for i, _ in list_at] + [i for i, _ in tensors]
    for i, view in zip(order, packed.split(sizes)):
        out[i] = view
    return out  # type: ignore[return-value]
