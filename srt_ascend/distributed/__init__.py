"""Tensor-parallel communication over torch.distributed (HCCL on NPU, NCCL on CUDA, gloo on
CPU): the group a rank belongs to (`TPGroup`) and how the processes find each other
(`DistInit`). With one rank every collective is the identity and nothing is initialised."""

from __future__ import annotations

from srt_ascend.distributed.group import (
    SINGLE,
    DistInit,
    TPGroup,
    init_tp_group,
    set_fixed_order_sums,
)

__all__ = ["SINGLE", "DistInit", "TPGroup", "init_tp_group", "set_fixed_order_sums"]
