"""The command-line options of the offline engine benchmarks' workload, and its random prompts."""

from __future__ import annotations

import argparse

import torch

from srt_ascend.server_args import SHIPPED_MODEL


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """Parser with --model-path, --dtype, --batch-sizes, --input-len, --output-len, --json-out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json-out", default=None)
    return p


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn uniformly from [3, vocab) (ids below 3 are the
    tokenizer's specials), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()
