"""What every figure is recorded with: the CPU, its bf16 flags, torch, and the load."""

from __future__ import annotations

import os
import platform
import re


def machine_info() -> dict:
    """CPU model name, which of avx512_bf16 / amx_bf16 it has, core count, torch version and
    the load averages (1, 5, 15 min) now: call it before and after a run."""
    import torch

    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "bf16_flags": sorted(set(re.findall(r"\b(avx512_bf16|amx_bf16)\b", text))),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
