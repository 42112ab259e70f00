"""One tensor-parallel group: its rank, its size, and the collectives the model and the
scheduler run over it.

Collectives on tensors go through the device group (HCCL on NPU, NCCL on CUDA, gloo on
CPU); Python objects (the scheduler's messages) through a gloo group on the CPU, as SGLang's
`cpu_group` does. `SINGLE`, the group of one rank, runs no collective at all: every method is
the identity, so a single-process server pays nothing for the parallel code paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def rank_of(self, local_rank: int) -> int:
        return self.node_rank * self.ranks_per_node + local_rank

    @property
    def init_method(self) -> str:
        return f"tcp://{self.addr}"


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

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

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
        """Sum of `x` over the ranks, in place; `x` itself with one rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._count("all_reduce", x.numel() * x.element_size())
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

    def broadcast_object(self, obj: Any) -> Any:
        """The leader's `obj` on every rank (what the others pass is ignored)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

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
    dist_init: DistInit, local_rank: int, backend: str, expert_parallel: bool = False
) -> TPGroup:
    """Joins the group as this node's `local_rank` (blocks until every rank has joined)."""
    import torch.distributed as dist

    rank = dist_init.rank_of(local_rank)
    dist.init_process_group(
        backend, init_method=dist_init.init_method, world_size=dist_init.world_size, rank=rank
    )
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo")
    return TPGroup(rank, dist_init.world_size, expert_parallel, world, cpu_group)
