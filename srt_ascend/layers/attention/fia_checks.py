"""The FIA reference's argument checks (a private part of fia_reference: import from there).

The inputs ``torch_npu.npu_fused_infer_attention_score`` rejects, as fia_reference's module
docstring lists them: keywords, layout and feature flags, TND length lists, sparse mode and
mask, query and paged-KV shapes, the block table. Each raises ValueError (TypeError for a
keyword the op lacks) with one line naming the input.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from srt_ascend.layers.attention.fia_plans import _CACHE, _Batch, _version_of

MASK_SIZE = 2048  # side of the compressed causal mask required by sparse_mode 2/3/4
MAX_QUERY_TOKENS_PER_REQ = 16  # MLA TND: query S per request is 1-16
MAX_TOTAL_TOKENS = 1 << 20  # TND: T <= 1M
SUPPORTED_LAYOUTS = ("TND", "TND_NTD")  # MLA with D=512 supports exactly these TND layouts
SPARSE_NO_MASK = 0
SPARSE_RIGHT_DOWN_CAUSAL = 3
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)

# Keywords of the real op this reference accepts only at their default value (None or 0).
_DEFAULT_ONLY_KWARGS: dict[str, object] = dict.fromkeys(
    "pse_shift dequant_scale1 quant_scale1 dequant_scale2 quant_scale2 quant_offset2 "
    "antiquant_offset query_padding_size kv_padding_size key_antiquant_scale key_antiquant_offset "
    "value_antiquant_scale value_antiquant_offset key_shared_prefix value_shared_prefix "
    "actual_shared_prefix_len key_rope_antiquant_scale".split()
) | {"key_antiquant_mode": 0, "value_antiquant_mode": 0}
# Keywords the real op ignores under sparse_mode 0 without a mask and sparse_mode 3
# (pre/next tokens), or that only pick a kernel precision (inner_precise 0-3).
_IGNORED_KWARGS = ("pre_tokens", "next_tokens", "inner_precise")


def _call_signature(
    tensors: tuple[torch.Tensor | None, ...],
    lens_q: Sequence[int] | None,
    lens_kv: Sequence[int] | None,
    scalars: tuple,
    antiquant_scale: torch.Tensor | None,
    unsupported: dict[str, object],
) -> tuple | None:
    """Everything the argument checks read except the mask, or None when the call is not
    worth remembering (extra keywords, antiquant_scale, length lists that are not plain
    lists of ints). Equal signatures with the same, already checked mask pass the same checks:
    each layer of a forward makes the same call, and only the first is checked."""
    if unsupported or antiquant_scale is not None:
        return None
    if type(lens_q) not in (list, tuple) or type(lens_kv) not in (list, tuple):
        return None
    lens = (*lens_q, -1, *lens_kv)
    if not all(type(n) is int for n in lens):
        return None
    meta = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors)
    return lens, meta, scalars


def _check_extra_kwargs(extra: dict[str, object]) -> None:
    """Reject keywords the real op lacks (TypeError) or that this reference cannot honour."""
    for name, val in extra.items():
        if name in _IGNORED_KWARGS:
            if name == "inner_precise" and val not in (0, 1, 2, 3):
                raise ValueError(f"inner_precise must be 0, 1, 2 or 3, got {val!r}")
            continue
        if name not in _DEFAULT_ONLY_KWARGS:
            raise TypeError(f"npu_fused_infer_attention_score() got an unexpected keyword {name!r}")
        default = _DEFAULT_ONLY_KWARGS[name]
        if (val is not None) if default is None else (val != default):
            raise ValueError(f"{name}={val!r} is not supported by the FIA reference")


def _check_flags(
    layout: str,
    antiquant_mode: int,
    antiquant_scale: torch.Tensor | None,
    softmax_lse_flag: bool,
    query_rope: torch.Tensor | None,
) -> None:
    """Layout and feature switches the MLA TND path supports."""
    if layout not in SUPPORTED_LAYOUTS:
        raise ValueError(f"input_layout must be one of {SUPPORTED_LAYOUTS}, got {layout!r}")
    if antiquant_mode != 0 or antiquant_scale is not None:
        raise ValueError("antiquantisation (antiquant_mode/antiquant_scale) is not supported")
    if softmax_lse_flag and query_rope is not None:
        raise ValueError("softmax_lse_flag=True is not supported with query_rope (MLA)")


def _as_host_ints(name: str, values: Sequence[int] | None) -> list[int]:
    """A host-side list of ints; the op takes int[] and TND requires it."""
    if values is None:
        raise ValueError(f"{name} is required with input_layout TND")
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a host list of ints, got {type(values).__name__}")
    if not all(type(v) is int or isinstance(v, numbers.Integral) for v in values):
        raise TypeError(f"{name} must contain ints, got {values!r}")
    return [int(v) for v in values]


def _split_lengths(
    actual_seq_lengths: Sequence[int] | None,
    actual_seq_lengths_kv: Sequence[int] | None,
    num_tokens: int,
) -> _Batch:
    """Validate the TND length lists and turn them into per-request lengths."""
    ends = _as_host_ints("actual_seq_lengths", actual_seq_lengths)
    kv_lens = _as_host_ints("actual_seq_lengths_kv", actual_seq_lengths_kv)
    if len(ends) != len(kv_lens):
        raise ValueError(f"actual_seq_lengths_kv has {len(kv_lens)} requests, not {len(ends)}")
    if num_tokens > MAX_TOTAL_TOKENS:
        raise ValueError(f"T={num_tokens} exceeds the TND limit of {MAX_TOTAL_TOKENS} tokens")
    starts = [0, *ends][: len(ends)]
    q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
    if any(n < 0 for n in q_lens):
        raise ValueError(f"actual_seq_lengths must be cumulative (non-decreasing), got {ends}")
    if (ends[-1] if ends else 0) != num_tokens:
        raise ValueError(f"actual_seq_lengths must end at T={num_tokens}, got {ends}")
    if any(n > MAX_QUERY_TOKENS_PER_REQ for n in q_lens):
        raise ValueError(
            f"at most {MAX_QUERY_TOKENS_PER_REQ} query tokens per request, got {q_lens}"
        )
    if any(n < 0 for n in kv_lens):
        raise ValueError(f"actual_seq_lengths_kv must be >= 0, got {kv_lens}")
    return _Batch(q_starts=starts, q_lens=q_lens, kv_lens=kv_lens)


def _check_sparse(sparse_mode: int, mask: torch.Tensor | None, batch: _Batch, mla: bool) -> None:
    """TND supports sparse 0 without a mask or sparse 3 with the compressed 2048x2048 mask."""
    if sparse_mode == SPARSE_NO_MASK:
        if mask is not None:
            raise ValueError("sparse_mode=0 with input_layout TND takes no atten_mask")
        if mla and any(n > 1 for n in batch.q_lens):
            raise ValueError("MLA with more than 1 query token per request needs sparse_mode=3")
        return
    if sparse_mode != SPARSE_RIGHT_DOWN_CAUSAL:
        raise ValueError(
            f"sparse_mode must be 0 (no mask) or 3 (rightDownCausal) with TND, got {sparse_mode}"
        )
    if mask is None:
        raise ValueError(f"sparse_mode=3 requires atten_mask ({MASK_SIZE}x{MASK_SIZE})")
    if (
        mask.shape[-2:] != (MASK_SIZE, MASK_SIZE)
        or any(d != 1 for d in mask.shape[:-2])
        or mask.dim() > 4
    ):
        raise ValueError(
            f"sparse_mode=3 requires atten_mask of shape ({MASK_SIZE}, {MASK_SIZE}) "
            f"(optionally with leading 1s), got {tuple(mask.shape)}"
        )
    if mask.dtype not in _MASK_DTYPES:
        raise ValueError(f"atten_mask dtype must be bool, int8 or uint8, got {mask.dtype}")
    # The op trusts the caller to pass the upper-triangular pattern; spot-check it here so an
    # inverted or all-zero mask fails on CPU instead of silently differing on NPU. Callers
    # build the mask once and pass it to every layer: check each mask (and version) once.
    # On a device these value checks would be host syncs: they run where the reference is
    # the test oracle, on the host.
    if mask.device.type == "cpu" and (
        _CACHE.mask is not mask or _CACHE.mask_version != _version_of(mask)
    ):
        rows = torch.tensor([0, 0, 1, MASK_SIZE - 1, 0, MASK_SIZE - 2], device=mask.device)
        cols = torch.tensor(
            [0, 1, 0, MASK_SIZE - 1, MASK_SIZE - 1, MASK_SIZE - 1], device=mask.device
        )
        if mask.reshape(MASK_SIZE, MASK_SIZE)[rows, cols].ne(0).tolist() != [0, 1, 0, 0, 1, 1]:
            raise ValueError("atten_mask must be upper-triangular (1/True = masked above diagonal)")
        _CACHE.mask, _CACHE.mask_version = mask, _version_of(mask)
    for i, (q, kv) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        if 0 < kv < q:  # kv == 0 is a padding request; its output is zeros
            raise ValueError(
                f"request {i}: {q} query tokens but only {kv} KV tokens; "
                "sparse_mode=3 needs q_len <= kv_len"
            )


def _check_shapes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_rope: torch.Tensor | None,
    key_rope: torch.Tensor | None,
    num_heads: int,
    num_key_value_heads: int,
) -> int:
    """Check TND query and paged KV shapes; return the number of KV heads."""
    if query.dim() != 3 or query.shape[1] != num_heads:
        raise ValueError(f"query must be [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={kv_heads}")
    if key.shape != value.shape or key.dim() not in (3, 4):
        raise ValueError(
            f"key and value must share one paged shape (num_blocks, block_size, H) "
            f"or (num_blocks, N, block_size, D), got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    _check_kv_heads("key", key, kv_heads, query.shape[2])
    if (query_rope is None) != (key_rope is None):
        raise ValueError("query_rope and key_rope must be given together (MLA) or not at all")
    if query_rope is not None and key_rope is not None:
        if query_rope.shape[:2] != query.shape[:2] or query_rope.dim() != 3:
            raise ValueError(
                f"query_rope must be [T, N, Dr] matching query {tuple(query.shape)}, "
                f"got {tuple(query_rope.shape)}"
            )
        if key_rope.dim() != key.dim() or key_rope.shape[:-1] != key.shape[:-1]:
            raise ValueError(
                f"key_rope must match key {tuple(key.shape)} except the last dim, "
                f"got {tuple(key_rope.shape)}"
            )
        _check_kv_heads("key_rope", key_rope, kv_heads, query_rope.shape[2])
        if query_rope.dtype != query.dtype or key_rope.dtype != key.dtype:
            raise ValueError("query_rope/key_rope must have the dtypes of query/key")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes differ: {query.dtype, key.dtype, value.dtype}")
    return kv_heads


def _check_kv_heads(name: str, cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """A paged cache carries kv_heads heads of head_dim each."""
    if cache.dim() == 3:
        ok = cache.shape[2] == kv_heads * head_dim
    else:
        ok = cache.shape[1] == kv_heads and cache.shape[3] == head_dim
    if not ok:
        raise ValueError(
            f"{name} {tuple(cache.shape)} does not hold {kv_heads} KV heads of dim {head_dim}"
        )


def _check_block_table(
    block_table: torch.Tensor | None,
    block_size: int,
    batch: _Batch,
    key: torch.Tensor,
) -> None:
    """Page attention is mandatory for MLA TND: check the table covers every KV length."""
    if block_table is None:
        raise ValueError("block_table is required (page attention) for the TND MLA path")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(
            f"block_table must be 2-D int32, got {block_table.dtype} {block_table.dim()}-D"
        )
    cache_block = key.shape[1] if key.dim() == 3 else key.shape[2]
    if block_size <= 0 or block_size != cache_block:
        raise ValueError(f"block_size={block_size} must be > 0 and match the cache's {cache_block}")
    if block_table.shape[0] != len(batch.kv_lens):
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows for {len(batch.kv_lens)} requests"
        )
    need = [-(-kv // block_size) for kv in batch.kv_lens]
    if need and max(need) > block_table.shape[1]:
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns but a request needs "
            f"{max(need)} blocks (kv lens {batch.kv_lens}, block_size {block_size})"
        )
