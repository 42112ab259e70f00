"""One tensor-parallel group: its rank, its size, and the collectives the model and the
scheduler run over it.

Collectives on tensors go through the device group (HCCL on NPU, NCCL on CUDA, gloo on
CPU); Python objects (the scheduler's messages) through a gloo group on the CPU, as SGLang's
`cpu_group` does. `SINGLE`, the group of one rank, runs no collective at all: every method is
the identity, so a single-process server pays nothing for the parallel code paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch


@dataclass(frozen=True)
class DistInit:
    """Where the ranks of one group meet (`--dist-init-addr`, `--nnodes`, `--node-rank`).

    The group has `world_size` ranks spread evenly over `nnodes` nodes; the ranks of node n
    are n * ranks_per_node ... (n + 1) * ranks_per_node - 1, and the first rank of node 0
    (rank 0) leads: it receives the requests."""

    addr: str  # host:port of rank 0's rendezvous (torch.distributed's TCP store)
    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    # --dist-timeout: how long a collective (or the rendezvous) may wait for a peer before
    # it raises; None: torch.distributed's default
    timeout_s: float | None = None

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def rank_of(self, local_rank: int) -> int:
        return self.node_rank * self.ranks_per_node + local_rank

    @property
    def init_method(self) -> str:
        return f"tcp://{self.addr}"


# --enable-deterministic-inference (`set_fixed_order_sums`): all-reduces add the ranks' parts
# in rank order on every rank, whatever the tensor's size.
_fixed_order_sums = False


def set_fixed_order_sums(on: bool) -> None:
    """Process-wide: make `TPGroup.all_reduce` a fixed-order sum (set by the model runner
    before the first forward). With two ranks every element is one addition, which is
    commutative, so any algorithm gives the same bits; with more, ring and tree all-reduces
    (gloo, NCCL, HCCL) add an element's parts in an order that follows where the element falls
    in the chunked buffer and which algorithm the buffer's size selects, i.e. the batch: a
    row's sum would depend on the rows around it. Then every rank gathers all parts and adds
    them in rank order instead (size times the traffic of a ring all-reduce's share)."""
    global _fixed_order_sums
    _fixed_order_sums = on


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # --ep-size = --tp-size: each rank holds E / size whole routed experts (expert
    # parallelism) instead of every expert's share of intermediate rows.
    expert_parallel: bool = False
    device_group: Any = None  # torch.distributed ProcessGroup for tensors
    cpu_group: Any = None  # gloo ProcessGroup for Python objects
    # Collectives run by this rank since start: name -> [calls, bytes sent in]. Counted on the
    # host; `benchmark/parallel.py` reads it per step.
    counts: dict[str, list[int]] = field(default_factory=dict)
    # Data-parallel attention (--enable-dp-attention --dp-size): the ranks form dp_size
    # groups of size / dp_size consecutive ranks. Attention and the vocabulary are split
    # within this rank's group (`attn`); MLPs and experts over all ranks, which gather every
    # group's tokens first (`dp_gather`) and hand each group its rows back (`dp_scatter`).
    dp_size: int = 1
    attn: TPGroup | None = None
    # --moe-a2a-backend all_to_all (expert parallelism under DP attention): MoE layers send
    # each token to the ranks of its experts (`all_to_all`) instead of gathering every token.
    moe_all_to_all: bool = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def attn_group(self) -> TPGroup:
        """The ranks that split this rank's attention heads (all of them without DP)."""
        return self if self.attn is None else self.attn

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel attention group."""
        return self.rank // (self.size // self.dp_size)

    @property
    def is_dp_leader(self) -> bool:
        """The first rank of its DP group (it reports the group's outputs)."""
        return self.rank % (self.size // self.dp_size) == 0

    def shard(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, intermediate rows, vocabulary); a size that does
        not divide evenly is a ValueError naming `what`."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by --tp-size {self.size}")
        return n // self.size

    def _count(self, name: str, nbytes: int) -> None:
        entry = self.counts.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place; `x` itself with one rank; in rank order with
        `set_fixed_order_sums`."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._count("all_reduce", x.numel() * x.element_size())
        if _fixed_order_sums and self.size > 2:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.device_group)
            total = parts[0]
            for part in parts[1:]:
                total = total.add_(part)
            return x.copy_(total)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order; `x` with one rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self._count("all_gather", x.numel() * x.element_size())
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_to_all(
        self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        """x [sum(send_splits), ...]: block i of send_splits[i] rows goes to rank i. Returns
        the blocks received [sum(recv_splits), ...], block i (recv_splits[i] rows) from rank
        i; `x` itself with one rank. The splits are host integers on every rank, paired:
        rank i's send_splits[j] is rank j's recv_splits[i]."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self._count("all_to_all", x.numel() * x.element_size())
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x, recv_splits, send_splits, group=self.device_group)
        return out

    def dp_exchange(self, values: list[int]) -> list[list[int]]:
        """Every DP group's host integers `values` (index: DP rank; as many on every rank),
        from each group's first rank: one all-gather over the gloo group (no device read).
        The model runner's once-per-forward exchange: token count and graph choice."""
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.int64)
        self._count("dp_counts", mine.numel() * mine.element_size())
        parts = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.cpu_group)
        step = self.size // self.dp_size
        return [parts[g * step].tolist() for g in range(self.dp_size)]

    def dp_gather(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [counts[dp_rank], H] -> every DP group's rows [sum(counts), H] in DP-rank order:
        an all-gather of x padded to max(counts) rows, read from each group's first rank."""
        import torch.distributed as dist

        rows = max(counts)
        padded = x.new_zeros(rows, *x.shape[1:])
        padded[: x.shape[0]] = x
        self._count("dp_gather", padded.numel() * padded.element_size())
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.device_group)
        step = self.size // self.dp_size
        return torch.cat([parts[g * step][:n] for g, n in enumerate(counts)])

    def dp_scatter(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Partial sums y [sum(counts), H] (each rank's share of the MLP) -> the total of this
        rank's DP group's rows [counts[dp_rank], H]: an all-reduce, then its slice."""
        start = sum(counts[: self.dp_rank])
        return self.all_reduce(y)[start : start + counts[self.dp_rank]]

    def broadcast_object(self, obj: Any) -> Any:
        """The group's first rank's `obj` on every rank of the group (over its gloo group;
        what the others pass is ignored)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        src = dist.get_global_rank(self.cpu_group, 0)  # this group's first rank
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (over the gloo group)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """Returns once every rank has reached it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


SINGLE = TPGroup()


def init_tp_group(
    dist_init: DistInit,
    local_rank: int,
    backend: str,
    expert_parallel: bool = False,
    dp_size: int = 1,
    moe_all_to_all: bool = False,
) -> TPGroup:
    """Joins the group as this node's `local_rank` (blocks until every rank has joined);
    with `dp_size` > 1 also the attention group of its data-parallel group (every rank
    creates every subgroup, in the same order, as torch.distributed requires)."""
    import torch.distributed as dist

    rank, size = dist_init.rank_of(local_rank), dist_init.world_size
    timeout = None if dist_init.timeout_s is None else timedelta(seconds=dist_init.timeout_s)
    dist.init_process_group(
        backend, init_method=dist_init.init_method, world_size=size, rank=rank, timeout=timeout
    )
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    counts: dict[str, list[int]] = {}
    attn = None
    if dp_size > 1:
        step = size // dp_size
        for g in range(dp_size):
            ranks = list(range(g * step, (g + 1) * step))
            device_group = dist.new_group(ranks, timeout=timeout) if step > 1 else None
            group_cpu = dist.new_group(ranks, backend="gloo", timeout=timeout) if step > 1 else None
            if g == rank // step:
                attn = TPGroup(
                    rank % step, step, device_group=device_group, cpu_group=group_cpu, counts=counts
                )
    return TPGroup(
        rank, size, expert_parallel, world, cpu_group, counts, dp_size, attn, moe_all_to_all
    )
