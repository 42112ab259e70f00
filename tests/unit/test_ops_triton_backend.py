"""The triton attention backend through the tiny DeepSeek-V3 model on CPU (kernels under
Triton's interpreter): the same logits as torch_native for extend with a cached prefix,
decode, and both verify layouts, fp32 tolerance. Also the --attention-backend defaults."""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.attention.base import create_attention_backend
from srt_ascend.mem_cache import MLATokenToKVPool, ReqToTokenPool
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.models.loader import load_model
from srt_ascend.server_args import ServerArgs
from tests.unit.triton_interpreter import import_interpreted

import_interpreted()
PAGE = 16


class Runner:
    """One backend over its own pools; request row r owns pages r+1.. (slot = page*16+i)."""

    def __init__(self, model, backend: str):
        cfg = model.config
        self.model = model
        self.req_pool = ReqToTokenPool(4, 128)
        self.kv_pool = MLATokenToKVPool(
            33 * PAGE, PAGE, torch.float32, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            cfg.num_hidden_layers,
        )  # fmt: skip
        for r in range(4):  # rows get pages in a scattered order
            pages = torch.tensor([1 + r + 4 * j for j in range(8)])
            self.req_pool.req_to_token[r] = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        self.backend = create_attention_backend(backend)

    def run(self, mode, ids, rows, seq_lens, q_lens):
        r2t = self.req_pool.req_to_token
        loc = torch.cat([r2t[r, s - q : s] for r, s, q in zip(rows, seq_lens, q_lens)])
        fb = ForwardBatch.build(
            mode, ids, rows, seq_lens, q_lens, loc, self.req_pool, self.kv_pool, self.backend
        )
        with torch.no_grad():
            return self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))


@pytest.fixture(scope="module")
def model(tiny_hf_factory):
    path, _ = tiny_hf_factory()
    model, _ = load_model(path, dtype=torch.float32, load_mtp=False)
    return model.eval()


def test_triton_backend_matches_torch_native(model):
    gen = torch.Generator().manual_seed(0)
    runners = [Runner(model, "torch_native"), Runner(model, "triton")]
    ids = torch.randint(0, 256, (60,), generator=gen)

    def both(mode, tokens, rows, seq_lens, q_lens):
        native, triton = (r.run(mode, tokens, rows, seq_lens, q_lens) for r in runners)
        scale = native.abs().max()
        assert ((triton - native).abs().max() / scale).item() < 1e-4
        return native

    # extend: prompts of 9, 17, 4; then a second chunk over the cached prefix (ragged)
    both(ForwardMode.EXTEND, ids[:30], [0, 1, 2], [9, 17, 4], [9, 17, 4])
    both(ForwardMode.EXTEND, ids[30:45], [0, 1, 2], [14, 21, 10], [5, 4, 6])
    # decode: one token per row
    both(ForwardMode.DECODE, ids[45:48], [0, 1, 2], [15, 22, 11], [1, 1, 1])
    # verify, K = 3: row 0 as one multi-query row, then the same tokens batch-expanded
    k = 3
    multi = both(ForwardMode.TARGET_VERIFY, ids[48:52], [0], [15 + k + 1], [k + 1])
    expanded = both(
        ForwardMode.TARGET_VERIFY, ids[48:52], [0] * (k + 1), list(range(16, 20)), [1] * 4
    )
    torch.testing.assert_close(expanded, multi, atol=1e-4, rtol=1e-4)


def test_attention_backend_defaults():
    args = ServerArgs()
    assert args.attention_backend is None
    assert args.attention_backend_on("cuda") == "triton"
    assert args.attention_backend_on("cpu") == "torch_native"
    assert args.attention_backend_on("npu") == "torch_native"
    assert ServerArgs(attention_backend="torch_native").attention_backend_on("cuda") == (
        "torch_native"
    )
    with pytest.raises(ValueError, match="unknown --attention-backend"):
        ServerArgs(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="needs --device cuda"):
        ServerArgs(attention_backend="triton", device="cpu")
    backend = create_attention_backend(args.for_device("cpu").attention_backend)
    assert type(backend).__name__ == "TorchNativeMLABackend"


def test_kv_parts_planned_once_per_forward(model, monkeypatch):
    """The KV split count is planned at a forward's first attention layer and reused by the
    others (launch metadata per forward, not per layer call)."""
    from srt_ascend.layers.attention import triton_backend

    plans = []
    real = triton_backend.plan_kv_splits

    def counted(*args):
        plans.append(args)
        return real(*args)

    monkeypatch.setattr(triton_backend, "plan_kv_splits", counted)
    runner = Runner(model, "triton")
    layers = model.config.num_hidden_layers
    assert layers > 1
    ids = torch.arange(3, 12)
    runner.run(ForwardMode.EXTEND, ids, [0], [9], [9])
    runner.run(ForwardMode.DECODE, ids[:2], [0, 1], [10, 5], [1, 1])
    assert len(plans) == 2, f"{len(plans)} plans for 2 forwards of {layers} layers"
