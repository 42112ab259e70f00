"""DeepSeekMoE: grouped sigmoid routing with a score-correction bias, routed + shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.distributed import SINGLE, TPGroup
from srt_ascend.layers import onednn_packed
from srt_ascend.layers.linear import (
    Linear,
    bmm,
    elementwise,
    fixed_order_covers,
    linear,
    ordered_sum,
    row_tile,
)
from srt_ascend.layers.moe_all_to_all import AllToAllDispatch, combine
from srt_ascend.layers.quantization import QuantStack, stack_linears
from srt_ascend.layers.weight_stack import WeightStack

# Batch-invariant mode: the dense expert path while the stacked experts number at most this
# many per choice of a token (a constant of the layer, never of the batch).
INVARIANT_DENSE_RATIO = 4


class DenseMLP(nn.Module):
    """SwiGLU feed-forward (`gate_proj`, `up_proj`, `down_proj`), as in the checkpoint."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        # run time: [gate; up] read by one linear
        self.gate_up: WeightStack | QuantStack | None = None

    def fuse_weights(self) -> None:
        """[gate; up] as one linear, float or quantized (`stack_linears`)."""
        self.gate_up = stack_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.intact():
            gate, up = self.gate_up.linear(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    """DeepSeek-V3's gate: sigmoid scores; the bias picks experts but does not weight them.

    Rule: score = sigmoid(W x); choice = score + e_score_correction_bias; groups rank by the sum
    of their two best choices, the best `topk_group` groups stay, the top `top_k` experts among
    them are picked; weights are the un-biased scores (normalised if norm_topk_prob) times
    routed_scaling_factor.
    """

    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        if n_experts % n_group:
            raise ValueError(f"n_routed_experts {n_experts} not divisible by n_group {n_group}")
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.n_experts, self.top_k = n_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        scores = elementwise(torch.sigmoid, linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias
        per_group = choice.view(-1, self.n_group, self.n_experts // self.n_group)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(-1, self.n_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        # batch-invariant mode off the CPU: sorted, since CUDA's unsorted top-k lists a row's
        # picks in an order that follows its kernel choice (by row count), and the weights'
        # sum below follows that order
        in_order = row_tile() is not None and x.device.type != "cpu"
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=in_order)[1]
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            norm = ordered_sum(topk_weights, -1).unsqueeze(-1)
            topk_weights = topk_weights / (norm + 1e-20)
        return topk_weights * self.routed_scaling_factor, topk_ids


class RoutedExperts(nn.Module):
    """Experts stored stacked: w13 [E, 2I, H] (gate; up) and w2 [E, H, I].

    The loader maps checkpoint names `experts.{e}.gate_proj/up_proj/down_proj` into these rows.
    The dense path also takes the stacks explicitly (`stacks`): DeepseekMoE passes them with
    the shared expert appended as an extra row once it is fused (`fuse_weights`).

    Under expert parallelism a rank holds the E experts `first_expert` .. first_expert + E - 1
    of the model's; the routing ids stay the model's, and a token's assignments to other
    ranks' experts contribute nothing here (the caller's all-reduce adds them).
    """

    stackable = True  # DeepseekMoE may append the shared expert as stack row E

    def __init__(
        self,
        n_experts: int,
        hidden_size: int,
        intermediate_size: int,
        first_expert: int = 0,
        partitioned: bool = False,
    ) -> None:
        super().__init__()
        self.n_experts, self.intermediate_size = n_experts, intermediate_size
        self.first_expert, self.partitioned = first_expert, partitioned
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_size, intermediate_size))

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        static_shapes: bool = False,
    ) -> torch.Tensor:
        """x [T, H]; each token goes through its k experts, outputs summed with their weights.

        The path is `choose_path`'s: sparse (sorted per-expert slices; shapes follow the
        routing), dense (every expert over every token) or gathered (each assignment runs its
        own expert's weights, gathered by id)."""
        t, k = topk_ids.shape
        fixed = self.fixed_order(x, self.w13, self.w2)
        path = self.choose_path(t, k, self.n_experts, static_shapes, fixed)
        return getattr(self, f"forward_{path}")(x, topk_weights, topk_ids)

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The model's expert ids as rows of this rank's stack, n_experts for another
        rank's expert (the ids themselves without expert parallelism)."""
        if not self.partitioned:
            return topk_ids
        local = topk_ids - self.first_expert
        return local.masked_fill((local < 0) | (local >= self.n_experts), self.n_experts)

    @staticmethod
    def choose_path(
        tokens: int, k: int, rows: int, static_shapes: bool, fixed_order: bool = False
    ) -> str:
        """The dispatch rule for `tokens` tokens with `k` experts each over `rows` stacked
        experts. Shapes that must not depend on the routing (graph captures, accelerators)
        take gathered while the T*k assignments read fewer expert rows than there are (a
        decode or verify step: its cost grows with the tokens, not with E), else dense. Eager
        CPU batches whose assignments number between E/2 and 4E (most experts are hit anyway,
        so dense work reads little extra weight) take dense; the rest sparse. In
        batch-invariant mode (`linear.row_tile`) the choice must not depend on the tokens (the
        paths sum a token's experts in different orders, so its output would follow the
        batch's size): dense while the stack has at most INVARIANT_DENSE_RATIO rows per choice
        (the shipped checkpoint: 9 rows, 3 choices, where per-expert calls cost more than the
        extra rows), else the ordered pair (DeepSeek-V3: 257 rows, 9 choices). With
        `fixed_order` (each expert's linears run on the fixed-order CPU kernel,
        `linear.fixed_order_covers`: a one-row call costs its weight's read, no per-call setup)
        always the ordered pair, whose one token reads only its own experts."""
        if row_tile() is not None:
            if rows <= INVARIANT_DENSE_RATIO * k and not fixed_order:
                return "dense"
            return "ordered_dense" if static_shapes else "ordered"
        assignments = tokens * k
        if static_shapes:
            return "gathered" if assignments < rows else "dense"
        return "dense" if rows <= 2 * assignments <= 8 * rows else "sparse"

    def forward_sparse(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Token copies are sorted by expert, each expert runs once over its contiguous slice,
        and the results are put back in (token, k) order, weighted and summed (`combine`, as
        the all-to-all path's owner ranks' outputs are): no scatter-add."""
        t, k = topk_ids.shape
        flat_ids = self.local_ids(topk_ids).flatten()  # [T*k]; other ranks' experts sort last
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.n_experts + 1).tolist()
        xs = x.unsqueeze(1).expand(t, k, x.shape[-1]).reshape(t * k, x.shape[-1])[order]
        outs, start = [], 0
        for e, n in enumerate(counts[: self.n_experts]):
            if n:
                outs.append(self._expert_at(xs[start : start + n], e, self.w13, self.w2))
                start += n
        if counts[-1] or not outs:  # assignments to other ranks' experts add nothing here
            outs.append(x.new_zeros(counts[-1], x.shape[-1]))
        return combine(torch.cat(outs), order, topk_weights).to(x.dtype)

    def forward_dense(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        stacks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Every expert over every token (one linear over the stacked gate/up rows, one
        batched matmul for the down projections), combined with the routing weights (zero for
        unchosen experts): no routing-dependent shapes or host syncs."""
        w13, w2 = stacks or (self.w13, self.w2)
        n, t, inter = w13.shape[0], x.shape[0], self.intermediate_size
        weights = self._weights_by_expert(topk_weights, topk_ids, n)
        gate_up = linear(x, w13.reshape(-1, w13.shape[-1])).view(t, n, 2 * inter)
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [T, E, I]
        down = self._down_concat(w2, x)
        if down is not None:  # the weighted sum inside one product: sum_e (w_e act_e) W2_e^T
            scaled = (act.float() * weights.unsqueeze(-1)).to(x.dtype)
            return linear(scaled.view(t, n * inter), down)
        ys = bmm(act.transpose(0, 1), w2.transpose(1, 2))  # [E, T, H]
        return ordered_sum(ys.float() * weights.t().unsqueeze(-1), 0).to(x.dtype)

    @staticmethod
    def _down_concat(w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Batch-invariant mode on CPU: the down projections side by side, [H, E*I] (built
        once, `onednn_packed.derived`), so the dense path's down projection and weighted sum
        are one linear of one row-invariant kernel (a packed oneDNN product) instead of a
        batched matmul per expert, which costs a weight reorder a call; None elsewhere. Each
        row's reduction runs over its experts' E*I products in the kernel's fixed order
        (an unchosen expert's scaled inputs are exact zeros)."""
        if row_tile() is None or x.device.type != "cpu" or w2.dtype != x.dtype:
            return None
        if not onednn_packed.usable() or torch.compiler.is_compiling():
            return None
        e, h, i = w2.shape
        key = ("down_concat", w2.data_ptr(), tuple(w2.shape), w2.stride())
        return onednn_packed.derived(w2, key, lambda: w2.permute(1, 0, 2).reshape(h, e * i))

    def forward_ordered(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        stacks: tuple[torch.Tensor, torch.Tensor] | None = None,
        every_token: bool = False,
    ) -> torch.Tensor:
        """Batch-invariant mode. A token's output = its chosen experts' weighted outputs added
        one by one in expert id order into a float32 sum that starts at zero. Eager, each
        expert runs over the tokens that chose it (one sort and one host read of the counts);
        with `every_token` (fixed shapes, graph capture: `forward_ordered_dense`) over every
        token, with weight zero where unchosen. Each expert's products are the row-tiled
        `linear`s, whose rows do not depend on the other rows of the call, so a token's output
        is the same bits in any batch and on both paths (an unchosen expert adds an exact
        zero). Eager, its cost follows the tokens' choices (T*k expert rows), not T*E as a
        dense pass does: DeepSeek-V3 has 256 experts and 8 choices."""
        w13, w2 = stacks or (self.w13, self.w2)
        n, t = w13.shape[0], x.shape[0]
        weights = self._weights_by_expert(topk_weights, topk_ids, n)
        total = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device)
        if every_token:
            for e in range(n):
                total += weights[:, e : e + 1] * self._expert_at(x, e, w13, w2).float()
            return total.to(x.dtype)
        local = self.local_ids(topk_ids)  # n: another rank's expert (adds nothing here)
        if t == 1:  # one token (a lone decode step): the same sums, with no sort or gathers
            for e in sorted(local[0].tolist()):
                if e < n:
                    total += weights[:, e : e + 1] * self._expert_at(x, e, w13, w2).float()
            return total.to(x.dtype)
        flat = local.flatten()
        order = flat.argsort(stable=True)
        tokens = order // local.shape[1]  # the assignments' tokens, grouped by expert
        counts = torch.bincount(flat, minlength=n + 1).tolist()
        start = 0
        for e, count in enumerate(counts[:n]):
            if count:
                rows = tokens[start : start + count]  # distinct: a token picks an expert once
                y = self._expert_at(x.index_select(0, rows), e, w13, w2).float()
                total.index_copy_(0, rows, total.index_select(0, rows) + weights[rows, e, None] * y)
                start += count
        return total.to(x.dtype)

    def forward_ordered_dense(self, *args) -> torch.Tensor:
        """`forward_ordered` over every token (fixed shapes): what graphs capture."""
        return self.forward_ordered(*args, every_token=True)

    @staticmethod
    def fixed_order(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """Whether batch-invariant mode runs one expert's linears on the fixed-order kernel."""
        if w13.dim() != 3 or w2.dim() != 3:
            return False
        return fixed_order_covers(x, w13[0]) and fixed_order_covers(x, w2[0])

    def _weights_by_expert(self, topk_weights, topk_ids, n: int) -> torch.Tensor:
        """[T, n] float32: each token's routing weight per stacked expert, zero where
        unchosen (assignments to other ranks' experts dropped)."""
        weights = torch.zeros(topk_ids.shape[0], n + 1, device=topk_ids.device)
        weights.scatter_(1, self.local_ids(topk_ids), topk_weights.float())
        return weights[:, :n]

    def _expert_at(self, x: torch.Tensor, e: int, w13: torch.Tensor, w2: torch.Tensor):
        """Expert row e of the stacks (w13, w2) over x [T, H] (quantized experts override)."""
        return self._expert(x, w13[e], w2[e])

    def _expert(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU over x [T, H] (w13 [2I, H] gate; up, w2 [H, I])."""
        gate, up = linear(x, w13).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, w2)

    def forward_gathered(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        stacks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Every (token, choice) pair through its own expert: the T*k experts' weights are
        gathered by id and run as two batched matmuls of one row each, combined with the
        routing weights. Shapes depend on T and k only; an assignment to another rank's
        expert runs row 0 with weight 0."""
        w13, w2 = stacks or (self.w13, self.w2)
        t, k = topk_ids.shape
        ids = self.local_ids(topk_ids).flatten()  # [T*k]
        weights = topk_weights.float().flatten()
        if self.partitioned:
            other = ids == self.n_experts
            ids, weights = ids.masked_fill(other, 0), weights.masked_fill(other, 0.0)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, H]
        gate_up = bmm(xs, w13.index_select(0, ids).transpose(1, 2))  # [T*k, 1, 2I]
        inter = gate_up.shape[-1] // 2
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        ys = bmm(act, w2.index_select(0, ids).transpose(1, 2)).squeeze(1)  # [T*k, H]
        return (ys.float() * weights[:, None]).view(t, k, x.shape[-1]).sum(1).to(x.dtype)


class DeepseekMoE(nn.Module):
    """Under tensor parallelism every rank holds every expert, with its share of each
    expert's intermediate rows (gate/up column-parallel, down row-parallel; the shared expert
    the same way); the router is replicated, so every rank routes alike. The output is a
    partial sum that the caller all-reduces (one all-reduce for routed + shared).

    Under expert parallelism (`tp.expert_parallel`) rank r holds routed experts
    r * E/tp .. (r + 1) * E/tp - 1 whole, and the shared expert whole (replicated). Every rank
    has every token (attention is tensor-parallel), so dispatch needs no communication: a
    rank runs its experts over the tokens routed to them; the combine is the caller's
    all-reduce (a reduce-scatter + all-gather), to which the leader alone adds the shared
    expert's output. With data-parallel attention and `--moe-a2a-backend all_to_all`
    (`tp.moe_all_to_all`) a rank holds only its DP group's tokens and sends each one to its
    experts' ranks instead (`forward_all_to_all`)."""

    def __init__(self, config, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.gate = TopkRouter(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.n_group or 1,
            config.topk_group or 1,
            bool(config.norm_topk_prob),
            float(config.routed_scaling_factor),
        )
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:
            inter = config.moe_intermediate_size
            n = tp.shard(config.n_routed_experts, "n_routed_experts")
            self.experts = RoutedExperts(n, config.hidden_size, inter, tp.rank * n, True)
        else:
            inter = tp.shard(config.moe_intermediate_size, "moe_intermediate_size")
            self.experts = RoutedExperts(config.n_routed_experts, config.hidden_size, inter)
        self.runs_shared = tp.is_leader or not self.expert_parallel
        self.all_to_all = (
            AllToAllDispatch(tp, self.experts.n_experts)
            if self.expert_parallel and tp.moe_all_to_all
            else None
        )
        self.shared_experts = (
            DenseMLP(config.hidden_size, inter * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        # Run time: the shared expert as row E of stacked expert weights (w13, w2).
        self.stacks: tuple[WeightStack, WeightStack] | None = None

    def fuse_weights(self) -> None:
        """A shared expert as wide as a routed one (DeepSeek-V3: one shared expert) becomes
        row E of the stacked expert weights: the dense path runs it as an always-chosen
        expert with routing weight 1 (no separate gate / up / down matmuls), the sparse path
        as one gate+up and one down linear over all tokens. Otherwise the shared MLP only
        stacks its gate and up projections."""
        shared, experts = self.shared_experts, self.experts
        if shared is None:
            return
        inter = experts.intermediate_size
        wide = shared.gate_proj.weight.shape[0] != inter
        projections = (shared.gate_proj, shared.up_proj, shared.down_proj)
        plain = experts.stackable and all(isinstance(m, nn.Linear) for m in projections)
        if wide or self.expert_parallel or not plain:  # quantized layers are not stacked
            shared.fuse_weights()
            return
        w13, w2 = experts.w13, experts.w2
        with torch.inference_mode(False):
            t13 = w13.data.new_empty(w13.shape[0] + 1, *w13.shape[1:])
            t2 = w2.data.new_empty(w2.shape[0] + 1, *w2.shape[1:])
        self.stacks = (
            WeightStack(
                t13,
                [
                    (w13, t13[:-1]),
                    (shared.gate_proj.weight, t13[-1, :inter]),
                    (shared.up_proj.weight, t13[-1, inter:]),
                ],
            ),
            WeightStack(t2, [(w2, t2[:-1]), (shared.down_proj.weight, t2[-1])]),
        )
        # Row E is [gate; up] of the shared MLP: its own stacked path reads it in one linear.
        shared.gate_up = WeightStack(
            t13[-1],
            [(shared.gate_proj.weight, t13[-1, :inter]), (shared.up_proj.weight, t13[-1, inter:])],
        )

    def forward(self, x: torch.Tensor, static_shapes: bool = False) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        if self.stacks is not None and self.stacks[0].intact() and self.stacks[1].intact():
            w13, w2 = self.stacks[0].tensor, self.stacks[1].tensor
            k = ids.shape[1] + 1  # + the shared row
            fixed = self.experts.fixed_order(flat, w13, w2)
            path = self.experts.choose_path(ids.shape[0], k, w13.shape[0], static_shapes, fixed)
            if path != "sparse":
                ids = F.pad(ids, (0, 1), value=self.experts.n_experts)
                weights = F.pad(weights, (0, 1), value=1.0)
                run = getattr(self.experts, f"forward_{path}")
                return run(flat, weights, ids, (w13, w2)).view(shape)
            # Sparse: every token uses the shared row, so the shared MLP runs it on x directly
            # (reading row E: one gate/up linear, one down) rather than through the sort.
            out = self.experts.forward_sparse(flat, weights, ids)
        else:
            out = self.experts(flat, weights, ids, static_shapes)
        if self.shared_experts is not None and self.runs_shared:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def forward_all_to_all(self, x: torch.Tensor, static_shapes: bool = False) -> torch.Tensor:
        """x [T, H], this rank's DP group's tokens (alike on the group's ranks) -> the layer's
        whole output for them (no caller all-reduce): this rank's share of the tokens is
        routed, sent to the experts' ranks and combined back (`moe_all_to_all`), its shared
        expert runs here, and the group's shares are gathered. Collective over all ranks."""
        a2a, first = self.all_to_all, self.experts.first_expert
        own = a2a.own_share(x)
        weights, ids = self.gate(own)

        def run_experts(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            ones = torch.ones(rows.shape[0], 1, device=rows.device)  # weights: the sender's
            return self.experts(rows, ones, (local + first).unsqueeze(1), static_shapes)

        out = a2a.run(own, weights, ids, run_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(own)
        return a2a.gather_shares(out, x.shape[0])
