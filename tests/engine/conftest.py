from __future__ import annotations

import os

import pytest
import torch

from srt_ascend.server_args import SHIPPED_MODEL

MODEL = os.environ.get("SRT_TEST_MODEL", SHIPPED_MODEL)


@pytest.fixture(scope="session")
def model_path() -> str:
    return MODEL


@pytest.fixture(scope="session")
def reference_decode(model_path):
    """Greedy one-request-at-a-time decode with the dense (no KV cache) forward: every step
    recomputes the whole sequence, so nothing of the runtime's paging or batching is used."""
    from srt_ascend.models.loader import load_model

    model, _ = load_model(model_path, dtype=torch.float32, load_mtp=False)
    model.eval()
    cache: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def decode(input_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(input_ids), max_new_tokens)
        if key not in cache:
            ids = list(input_ids)
            for _ in range(max_new_tokens):
                x = torch.tensor([ids])
                hidden = model(x, torch.arange(len(ids)))
                ids.append(int(model.compute_logits(hidden[0, -1]).argmax()))
            cache[key] = ids[len(input_ids) :]
        return cache[key]

    return decode


@pytest.fixture(scope="session")
def baseline(model_path):
    """Greedy float32 outputs of the 50 lossless prompts: eager, no speculation."""
    from lossless import run

    outs, _ = run(model_path)
    return outs
