"""Ragged verify rows (verify.Ragged): a step whose requests draft k_r <= K builds each
request's 1 + k_r rows only, and reads its outputs back in the [B, K+1] layout with row k_r
repeated past it. Both strategies' batches hold exactly the full batch's rows at those
positions (expand: single-token rows; fia: 1 + k_r query tokens per request)."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.speculative.verify import BatchExpansionVerify, MultiQueryFiaVerify, Ragged

K, LIMITS = 3, [0, 3, 1]


def _strategy(cls):
    """The strategy with a recording batch builder (its arguments, as lists)."""
    strategy = object.__new__(cls)
    strategy.k, strategy.backend = K, None
    strategy.build_forward_batch = lambda mode, ids, rows, seq, ext, loc, backend, bounds: {
        "ids": ids.tolist(),
        "rows": list(rows),
        "seq": seq.tolist() if isinstance(seq, torch.Tensor) else list(seq),
        "ext": list(ext),
        "loc": loc.tolist(),
        "bounds": bounds,
    }
    return strategy


def _inputs():
    b = len(LIMITS)
    tokens = torch.arange(b * (K + 1)).view(b, K + 1) + 100
    loc = torch.arange(b * (K + 1)).view(b, K + 1) + 500
    return tokens, [7, 8, 9], [20, 30, 40], loc


def test_rows_index_math():
    ragged = Ragged.of(LIMITS, K, "cpu")
    assert ragged.keep.tolist() == [0, 4, 5, 6, 7, 8, 9]
    assert ragged.first.tolist() == [0, 1, 5]
    assert ragged.expand.tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 6, 6]
    x = torch.arange(len(LIMITS) * (K + 1)) * 10
    back = ragged.spread(ragged.take(x)).view(len(LIMITS), K + 1)
    for b, n in enumerate(LIMITS):
        for j in range(K + 1):
            assert back[b, j] == x[b * (K + 1) + min(j, n)]


def test_expand_builds_the_full_batch_rows_it_keeps():
    strategy = _strategy(BatchExpansionVerify)
    tokens, rows, seq, loc = _inputs()
    full = strategy.build(tokens, rows, seq, loc)
    ragged = Ragged.of(LIMITS, K, "cpu")
    part = strategy.build(tokens, rows, seq, loc, None, ragged)
    keep = ragged.keep.tolist()
    for field in ("ids", "rows", "seq", "loc"):
        assert part[field] == [full[field][i] for i in keep], field
    assert part["ext"] == [1] * len(keep)
    # device lengths (an overlapped round's): the same rows, bounds kept alongside
    on_device = strategy.build(tokens, rows, torch.tensor(seq), loc, [s + 2 for s in seq], ragged)
    assert on_device["seq"] == part["seq"]
    assert on_device["bounds"] == [s + 2 for s in part["seq"]]


def test_fia_takes_per_request_query_lengths():
    strategy = _strategy(MultiQueryFiaVerify)
    tokens, rows, seq, loc = _inputs()
    ragged = Ragged.of(LIMITS, K, "cpu")
    part = strategy.build(tokens, rows, seq, loc, None, ragged)
    assert part["ext"] == [n + 1 for n in LIMITS]
    assert part["seq"] == [s + n for s, n in zip(seq, LIMITS)]  # through position L-1+k_r
    assert part["ids"] == ragged.take(tokens.view(-1)).tolist()
    assert part["rows"] == rows
    with pytest.raises(ValueError, match="host sequence lengths"):
        strategy.build(tokens, rows, torch.tensor(seq), loc, seq, ragged)
