"""Graphs under data-parallel attention: every rank replays the same graph, or none does.

Under `--enable-dp-attention` the MLPs run over every DP group's tokens (DecoderLayer: gathered
before, each group's rows reduced back after), so a forward's collective shapes depend on all
groups' batches, while a captured forward's are fixed: it gathers its `num_tokens` rows (the
bucket's, padding included) from every group (`[num_tokens] * dp_size` as its
ForwardBatch.dp_token_counts). So before each forward every rank states a *demand*, and the
ranks exchange the demands in the one host exchange the forward has anyway (it also carries
the token counts an eager forward gathers by: `TPGroup.dp_exchange`, over gloo, before any
replay is chosen). `agree_replay` maps the exchanged demands to one choice, the same on every
rank since every rank computes it from the same list:

- every DP group with tokens can replay the same graph kind: all ranks replay that kind at the
  largest bucket any group needs (each group's rows fit, the rest is padding); a group without
  tokens (the DP-idle rule) replays the same graph over padding rows only (KV length 0, KV
  writes to the reserved padding slot 0), exactly as captures run, so its collectives pair
  with the others' and nothing of its pools changes;
- otherwise (a prefill, a batch too large for the buckets, groups running different kinds,
  every group idle) every rank runs eagerly and the MLPs gather the exchanged token counts.

Padding rows never change real rows: they are sliced away after the MLP reduction, and the
MoE paths have no expert capacity (dense, gathered and sparse compute every token's experts
on their own), so a padding row's routing takes nothing from a real row's. The KV window a
torch_native graph reads stays each rank's own choice: attention runs within its DP group
and no collective depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence

NO_GRAPH = -1  # a demand's kind index when its batch cannot replay a graph


def demand(tokens: int, kind_index: int | None = None, bucket: int | None = None) -> list[int]:
    """What a rank states before a forward: its DP group's token count, and the graph kind
    (index in the graph runner's kinds) and smallest bucket that hold its batch, or none."""
    if kind_index is None or bucket is None:
        return [tokens, NO_GRAPH, 0]
    return [tokens, kind_index, bucket]


def token_counts(demands: Sequence[Sequence[int]]) -> list[int]:
    """Every DP group's tokens for this forward (index: DP rank), from the exchanged demands."""
    return [d[0] for d in demands]


def agree_replay(demands: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """(kind index, bucket) that every rank replays, or None: every rank runs eagerly.

    `demands` are the DP groups' (tokens, kind index, bucket), as `demand` builds them. Groups
    without tokens take whatever the others choose; the groups with tokens must all hold their
    batch in a graph of the same kind, and the bucket is the largest of theirs (buckets grow,
    so it holds every group's batch). None when no group has tokens (idle forwards run no MLP
    collective at all)."""
    busy = [d for d in demands if d[0] > 0]
    kinds = {kind for _, kind, _ in busy}
    if len(kinds) != 1 or NO_GRAPH in kinds:
        return None
    return kinds.pop(), max(bucket for _, _, bucket in busy)
