"""Which verify path, KV layout and page size a device runs for a model's shape, decided at start.

FIA (``npu_fused_infer_attention_score``) on NPU is a hardware op with shape limits on its MLA
path (query heads 32/64/128, latent D 512, rope D 64, block size 16/128: see
``fia_reference.mla_npu_shape_problems``). Elsewhere the plain-torch reference with the same
contract runs every shape. So on NPU the choice depends on the model: FIA where its limits
hold, else batch expansion over the torch-native backend, or a one-line error when the user
asked for FIA explicitly. Nothing here waits for the first request to find out.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt_ascend.layers.attention.fia_reference import mla_npu_shape_problems

VERIFY_PATHS = ("expand", "fia")
# Devices whose FIA is the hardware op with the MLA shape limits (elsewhere: the reference).
FIA_SHAPE_LIMITED = frozenset({"npu"})
# Page size when --page-size is not given: FIA's MLA path takes block sizes 16 or 128.
DEFAULT_PAGE_SIZE = {"npu": 128}
# KV pool layout per device: the NPU op takes the latent and rope caches as separate
# contiguous tensors; torch-native attention gathers interleaved rows once (CPU/CUDA).
KV_LAYOUT = {"npu": "separate"}


class UnsupportedOnDevice(ValueError):
    """A flag or model shape this device cannot run; the message is one line for the CLI."""


@dataclass(frozen=True)
class AttentionPlan:
    verify: str  # "fia" | "expand": the verify path that runs
    kv_layout: str  # MLATokenToKVPool layout: "interleaved" | "separate"
    page_size: int
    fallback: str | None = None  # why the default FIA path gave way to expand (for a log line)


def default_page_size(device_type: str) -> int:
    """--page-size when not given: 128 on NPU (an FIA block size), 1 elsewhere."""
    return DEFAULT_PAGE_SIZE.get(device_type, 1)


def default_verify(device_type: str) -> str | None:
    """--speculative-verify when not given, where the device alone decides it: "fia" wherever
    FIA is the reference (it runs every shape); None on NPU, where the model's shape decides
    (``resolve_attention_plan``)."""
    return None if device_type in FIA_SHAPE_LIMITED else "fia"


def resolve_attention_plan(
    device_type: str,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    page_size: int,
    requested_verify: str | None,
) -> AttentionPlan:
    """The verify path, KV layout and page size for a model shape on a device.

    ``num_heads`` are the query heads one rank computes (num_attention_heads / TP size).
    ``requested_verify`` is --speculative-verify as given, None when not given (pass None
    when speculation is off: the plan's ``verify`` is then unused). Raises
    ``UnsupportedOnDevice`` (one line) when FIA was asked for explicitly and the device's op
    cannot run the shape or page size."""
    if requested_verify not in (None, *VERIFY_PATHS):
        raise UnsupportedOnDevice(
            f"--speculative-verify must be one of {', '.join(VERIFY_PATHS)}, "
            f"got {requested_verify!r}"
        )
    layout = KV_LAYOUT.get(device_type, "interleaved")
    if device_type not in FIA_SHAPE_LIMITED:
        return AttentionPlan(requested_verify or "fia", layout, page_size)
    problems = mla_npu_shape_problems(num_heads, kv_lora_rank, rope_dim, page_size)
    if not problems:
        return AttentionPlan(requested_verify or "fia", layout, page_size)
    why = "; ".join(problems)
    if requested_verify == "fia":
        raise UnsupportedOnDevice(
            f"--speculative-verify fia cannot run this model on {device_type} "
            f"({num_heads} query heads per rank, page size {page_size}): {why}; "
            "use --speculative-verify expand"
        )
    fallback = None
    if requested_verify is None:
        fallback = f"verifying by batch expansion: FIA on {device_type}: {why}"
    return AttentionPlan("expand", layout, page_size, fallback)
