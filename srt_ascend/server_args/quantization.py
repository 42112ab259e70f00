"""ServerArgs' quantized-checkpoint flag: --quantization (SGLang's name and values)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

# --quantization values served here (SGLang's names): checkpoints kept quantized in memory
# (models/quant_config.py); without the flag the format is detected from the checkpoint
QUANTIZATION_FORMATS = ("fp8", "modelslim")


class QuantizationArgsMixin:
    """--quantization's check (ServerArgs.check)."""

    def _check_quantization(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_FORMATS):
            raise ValueError(
                f"--quantization {self.quantization!r} is not served here "
                f"(served: {', '.join(QUANTIZATION_FORMATS)}; default: from the checkpoint)"
            )


def add_quantization_flags(
    parser: argparse.ArgumentParser, d: Mapping[str, dataclasses.Field]
) -> None:
    parser.add_argument(
        "--quantization",
        default=d["quantization"].default,
        help="the checkpoint's quantized format, fp8 (DeepSeek's blocks) or modelslim "
        "(W8A8 / W8A8_DYNAMIC); default: detected from the checkpoint",
    )
