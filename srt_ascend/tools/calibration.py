"""Calibration runs of a float checkpoint for the quantizer: the model (and its MTP layer) run
densely in float32 over windows of the training corpus the tiny model was trained on
(srt_ascend.tools.corpus, held-out files excluded), with hooks on named linear layers.

Layer names are the checkpoint's (`model.layers.{i}.self_attn.o_proj`; the MTP layer's block
at `model.layers.{num_hidden_layers + i}`). The run-time weight stacks are left unbuilt, so
every projection is its own module and its hook fires.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

CALIB_SEQ_LEN = 256


@dataclass
class InputStats:
    """What one layer's inputs looked like over the calibration windows."""

    lo: float  # smallest value (or the windows' smallest low quantile)
    hi: float  # largest value (or the windows' largest high quantile)
    channel_max: torch.Tensor  # float32 [K]: max |x| per input channel


def calibration_windows(tokenizer_dir: str, sequences: int, seq_len: int = CALIB_SEQ_LEN):
    """`sequences` token windows of seq_len + 1 tokens, spread over the training files."""
    from tokenizers import Tokenizer

    from srt_ascend.tools.corpus import list_files, split

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    train, _ = split(list_files())
    windows = []
    for f in train[:: max(1, len(train) // (4 * sequences))]:
        ids = tok.encode(f.read()[: 8 * seq_len]).ids
        if len(ids) > seq_len + 1:
            windows.append(ids[: seq_len + 1])
        if len(windows) == sequences:
            break
    return windows


class CalibrationModel:
    """The float model of `src` (with its MTP layer when `mtp`) in float32, unstacked, with
    its linear layers by checkpoint name (`linears`)."""

    def __init__(self, src: str, mtp: bool) -> None:
        from srt_ascend.layers.linear import Linear
        from srt_ascend.models.loader import load_model

        self.src = src
        self.model, self.mtp = load_model(src, dtype=torch.float32, load_mtp=mtp)
        layers = self.model.config.num_hidden_layers
        self.linears: dict[str, nn.Module] = {}
        roots = [(self.model, "")] + ([(self.mtp, "mtp")] if self.mtp is not None else [])
        for root, kind in roots:
            for path, module in root.named_modules():
                for attr in ("qkv_a", "gate_up", "stacks"):
                    if attr in module.__dict__:  # unstacked: every projection's hook fires
                        setattr(module, attr, None)
                if type(module) is not Linear:
                    continue
                if kind:
                    m = re.match(r"^layers\.(\d+)\.(block\.)?(.*)$", path)
                    path = f"model.layers.{layers + int(m.group(1))}.{m.group(3)}"
                self.linears[path] = module

    @torch.inference_mode()
    def logits(self, windows: list[list[int]]) -> Iterator[torch.Tensor]:
        """Per window: the float32 logits [seq_len, vocab] of the main model, with the MTP
        layer's over the same window below them ([2 * seq_len, vocab]) when it is loaded."""
        for ids in windows:
            x = torch.tensor([ids])
            positions = torch.arange(x.shape[1] - 1)
            hidden = self.model(x[:, :-1], positions)
            logits = self.model.compute_logits(hidden)[0]
            if self.mtp is not None:
                drafted = self.mtp.compute_logits(self.mtp(x[:, 1:], hidden, positions))
                logits = torch.cat([logits, drafted.reshape(-1, logits.shape[-1])])
            yield logits

    def with_hooks(self, hooks: dict[str, Callable]) -> list:
        """Registers forward hooks (name -> hook(module, args, output)); returns the handles."""
        missing = sorted(hooks.keys() - self.linears.keys())
        if missing:
            raise RuntimeError(f"calibration model has no linear layer {missing[0]}")
        return [self.linears[n].register_forward_hook(h) for n, h in hooks.items()]


def input_stats(
    src: str,
    names: set[str],
    sequences: int,
    clip: float | None = None,
    seq_len: int = CALIB_SEQ_LEN,
) -> dict[str, InputStats]:
    """{layer name: InputStats} of the `names` layers' inputs over `sequences` windows; with
    `clip`, lo / hi are each window's (1 - clip, clip) quantiles (outliers saturate) instead
    of its extremes."""
    layers = num_layers(src)
    want_mtp = any(int(n.split(".")[2]) >= layers for n in names)
    run = CalibrationModel(src, want_mtp)
    stats: dict[str, InputStats] = {}

    def hook(name):
        def record(_module, args, _out):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            flat = x.flatten()
            if clip is None:
                w_lo, w_hi = float(flat.min()), float(flat.max())
            else:
                w_lo, w_hi = _quantiles(flat, clip)
            cmax = x.abs().amax(0)
            old = stats.get(name)
            if old is not None:
                w_lo, w_hi = min(old.lo, w_lo), max(old.hi, w_hi)
                cmax = torch.maximum(old.channel_max, cmax)
            stats[name] = InputStats(w_lo, w_hi, cmax)

        return record

    handles = run.with_hooks({n: hook(n) for n in names})
    for _ in run.logits(calibration_windows(src, sequences, seq_len)):
        pass
    for h in handles:
        h.remove()
    missing = sorted(names - stats.keys())
    if missing:
        raise RuntimeError(f"calibration never ran layer {missing[0]}")
    return stats


def _quantiles(flat: torch.Tensor, clip: float) -> tuple[float, float]:
    """The (1 - clip, clip) quantiles of `flat` as torch.quantile's "nearest" picks them:
    two k-th value selections (linear time; quantile sorts, several times slower here)."""
    n = flat.numel()
    lo_k = round((1 - clip) * (n - 1)) + 1
    hi_k = round(clip * (n - 1)) + 1
    return float(flat.kthvalue(lo_k).values), float(flat.kthvalue(hi_k).values)


def num_layers(src: str) -> int:
    """The checkpoint's num_hidden_layers (the MTP layers come after them)."""
    with open(os.path.join(src, "config.json")) as f:
        return int(json.load(f)["num_hidden_layers"])
