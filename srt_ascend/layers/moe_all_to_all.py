"""Expert-parallel token dispatch and combine by all-to-all (`--moe-a2a-backend all_to_all`).

Under expert parallelism with data-parallel attention (`--ep-size` = `--tp-size`,
`--enable-dp-attention --dp-size D`) rank r holds routed experts r * n .. (r + 1) * n - 1
(n = E / tp) and the tokens of its own DP group only. `--moe-a2a-backend none` gathers every
group's tokens on every rank (`TPGroup.dp_gather`) and all-reduces the partial sums back; here
each token travels only to the ranks that own its chosen experts, with torch.distributed's
all-to-all (HCCL, NCCL, gloo):

1. Counts. The rank's k (token, expert) assignments per token are sorted by expert, hence by
   owning rank, and counted per expert [E]; one all-to-all of those counts tells every rank
   how many rows it gets from each rank for each of its own experts.
2. Dispatch. One all-to-all of the token rows, one copy per assignment, in that order. Rows
   arrive grouped by sender and, within a sender's block, sorted by expert, so the counts
   give every row's expert: no ids travel.
3. The owners run their experts over the rows they received, unweighted.
4. Combine. The reverse all-to-all brings every assignment's output back to its token's
   rank, which weights the k outputs with its routing weights and sums them (the sum
   `RoutedExperts.forward_sparse` computes in one process).

Which rank dispatches: within a DP group of A = tp / D ranks every rank holds the same tokens
(attention is tensor-parallel within the group). Each rank dispatches its own contiguous share
of them (ceil(T / A) rows, the last share shorter; `own_share`), runs the router and the
shared expert (replicated under expert parallelism) on that share only, and the group's ranks
all-gather their shares' outputs afterwards (`gather_shares`; nothing to gather when A = 1).
Work and bytes per rank shrink by A for one all-gather within the group; a single dispatching
rank would leave A - 1 ranks idle, send A times the rows from one rank, and still need a
broadcast of its outputs. A DP group without tokens (IDLE forward) dispatches nothing and
still joins the three all-to-alls, receiving and serving other groups' rows.

Host reads: the all-to-all's split sizes are host integers (torch.distributed takes lists):
one read per MoE layer and forward, of the rows this rank sends to and receives from each rank
([2, tp] integers, through `HOST_READS`; a device-to-host sync on an accelerator, a plain read
on CPU). Everything else stays on the device (counts by `index_add_`, expert ids by
`repeat_interleave` with a host `output_size`). Graphs: those host reads cannot be captured,
so this backend turns graphs off (`ServerArgs.graphs_enabled`) and this path only runs eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from srt_ascend.distributed import TPGroup
from srt_ascend.utils import HOST_READS

# (rows [R, H], their experts as rows of this rank's stack [R]) -> expert outputs [R, H]
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class AllToAllDispatch:
    """One rank's dispatch and combine for MoE layers whose routed experts are partitioned over
    `tp`'s ranks, `n_local` whole experts each (rank r: r * n_local .. (r + 1) * n_local - 1)."""

    def __init__(self, tp: TPGroup, n_local: int) -> None:
        self.tp, self.n_local = tp, n_local

    def own_share(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H], the DP group's tokens -> the rows this rank dispatches (a view)."""
        attn = self.tp.attn_group
        per = -(-x.shape[0] // attn.size)
        return x[attn.rank * per : (attn.rank + 1) * per]

    def gather_shares(self, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """This rank's share's outputs -> the DP group's [n_tokens, H], in token order: an
        all-gather within the attention group of the shares padded to ceil(T / A) rows."""
        attn = self.tp.attn_group
        if attn.size == 1:
            return y
        padded = y.new_zeros(max(1, -(-n_tokens // attn.size)), *y.shape[1:])
        padded[: y.shape[0]] = y
        return attn.all_gather(padded, dim=0)[:n_tokens]

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: LocalExperts,
    ) -> torch.Tensor:
        """x [T, H] (this rank's share), topk_weights [T, k] float32, topk_ids [T, k] (the
        model's expert ids) -> the routed experts' weighted sum per token [T, H] in x's dtype.
        `experts` runs this rank's experts over the rows the other ranks send (collective:
        every rank of `tp` calls `run` for the same layer, with or without tokens)."""
        t, k = topk_ids.shape
        size, n = self.tp.size, self.n_local
        flat = topk_ids.flatten()  # [T*k], token-major
        order = flat.argsort(stable=True)  # assignments sorted by expert, so by owning rank
        per_expert = torch.zeros(size * n, dtype=torch.int64, device=x.device)
        per_expert.index_add_(0, flat, torch.ones_like(flat))
        recv_per_expert = self.tp.all_to_all(per_expert, [n] * size, [n] * size)  # [tp * n]
        send, recv = HOST_READS.read(
            torch.stack([per_expert.view(size, n).sum(1), recv_per_expert.view(size, n).sum(1)])
        )
        rows = self.tp.all_to_all(x[order // k], send, recv)  # [R, H]
        local = torch.arange(n, device=x.device).repeat(size)
        local = local.repeat_interleave(recv_per_expert, output_size=rows.shape[0])  # [R]
        back = self.tp.all_to_all(experts(rows, local), recv, send)  # [T*k, H], sorted
        return combine(back, order, topk_weights).to(x.dtype)


def combine(outputs: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor):
    """outputs [T*k, H]: assignment order[i]'s expert output in row i -> [T, H] float32, the
    sum over k of topk_weights[t, k] * output of (t, k)."""
    t, k = topk_weights.shape
    ys = torch.empty_like(outputs).index_put_((order,), outputs).view(t, k, outputs.shape[-1])
    return (ys.float() * topk_weights.unsqueeze(-1)).sum(1)
