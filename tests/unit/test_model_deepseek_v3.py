"""DeepseekV3ForCausalLM against transformers' implementation, in float32.

Every test loads a random tiny checkpoint written by transformers (see tests/conftest.py) with
srt_ascend's loader and compares logits with the HF model on the same tokens: the dense causal
path (training), the absorbed MLA path over the paged latent KV pool (ragged prefill, chunked
extend, step-by-step decode, page sizes 1 and 4, shuffled slot order), for each config variant
(q_lora_rank 48 / None, YaRN / plain rope).
"""

from __future__ import annotations

import pytest
import torch

from srt_ascend.layers.attention.fia_backend import FiaMLABackend
from srt_ascend.layers.attention.torch_native import TorchNativeMLABackend
from srt_ascend.mem_cache import MLATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt_ascend.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt_ascend.models.loader import load_model

TOL = 1e-4  # max abs error relative to the reference's max abs logit


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def pair(tiny_hf_checkpoint):
    """(our model, hf model), both float32, for each config variant."""
    path, hf = tiny_hf_checkpoint
    model, mtp = load_model(path, dtype=torch.float32, load_mtp=False)
    assert mtp is None
    return model.eval(), hf


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


class PagedRunner:
    """Drives the absorbed path the way a scheduler does: a request row per sequence, KV slots
    from the allocator (optionally handed out in shuffled page order), one ForwardBatch per
    forward. Several requests per forward, each with its own number of new tokens."""

    def __init__(
        self,
        model,
        page_size: int = 1,
        size: int = 512,
        shuffle_seed: int | None = None,
        layout: str = "interleaved",
    ):
        cfg = model.config
        self.model = model
        self.req_pool = ReqToTokenPool(size=4, max_context_len=256)
        self.kv_pool = MLATokenToKVPool(
            size,
            page_size,
            torch.float32,
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            layer_num=cfg.num_hidden_layers,
            layout=layout,
        )
        self.allocator = TokenToKVPoolAllocator(size, page_size)
        self.backend = TorchNativeMLABackend()
        self.seq_len: dict[int, int] = {}
        if shuffle_seed is not None:  # hand pages out in a random order
            slots = self.allocator.alloc(size)
            pages = slots.view(-1, page_size)
            gen = torch.Generator().manual_seed(shuffle_seed)
            for i in torch.randperm(pages.shape[0], generator=gen).tolist():
                self.allocator.free(pages[i])

    def new_rows(self, n: int) -> list[int]:
        rows = self.req_pool.alloc(n)
        self.seq_len.update(dict.fromkeys(rows, 0))
        return rows

    def forward(self, rows: list[int], chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Appends chunks[i] to request rows[i]; returns each row's logits [len(chunk), V]."""
        prefix = [self.seq_len[r] for r in rows]
        seq = [p + len(c) for p, c in zip(prefix, chunks, strict=True)]
        last = [
            int(self.req_pool.req_to_token[r, p - 1]) if p else -1
            for r, p in zip(rows, prefix, strict=True)
        ]
        decode = all(p > 0 and len(c) == 1 for p, c in zip(prefix, chunks, strict=True))
        if decode:
            loc = self.allocator.alloc_decode(seq, last)
        else:
            loc = self.allocator.alloc_extend(prefix, seq, last)
        assert loc is not None, "test pool too small"
        offset = 0
        for r, p, s in zip(rows, prefix, seq, strict=True):
            self.req_pool.req_to_token[r, p:s] = loc[offset : offset + s - p]
            offset += s - p
            self.seq_len[r] = s
        fb = ForwardBatch.build(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            torch.cat(chunks),
            rows,
            seq,
            [len(c) for c in chunks],
            loc,
            self.req_pool,
            self.kv_pool,
            self.backend,
        )
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))
        return list(logits.split([len(c) for c in chunks]))


def test_dense_prefill_matches_hf(pair):
    model, hf = pair
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(24)))
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (2, 24, 256)
    assert rel_err(ours, ref) < TOL
    assert ref.std() > 0.5  # the random model's logits are far from flat


def test_absorbed_ragged_prefill_matches_hf(pair):
    """Three requests of 13, 1 and 24 tokens in one EXTEND batch, slots in shuffled order."""
    model, hf = pair
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids)
    runner = PagedRunner(model, page_size=1, shuffle_seed=0)
    rows = runner.new_rows(3)
    lens = [13, 1, 24]
    out = runner.forward(rows, [ids[i, :n] for i, n in enumerate(lens)])
    used = runner.req_pool.req_to_token[rows[2], :24]
    assert not bool((used.diff() == 1).all())  # the slots really are out of order
    for i, n in enumerate(lens):
        assert rel_err(out[i], ref[i, :n]) < TOL, f"row {i}"


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_absorbed_chunked_extend_and_decode_match_hf(pair, page_size, layout):
    """Prefill (5 and 9 tokens), a chunked extend over the cached prefix (3 and 2 more tokens,
    continuing a partly filled page), then one-token decode steps, all against HF's logits for
    the whole sequence."""
    model, hf = pair
    total = 20
    ids = torch.randint(0, 256, (2, total), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(hf, ids)
    runner = PagedRunner(model, page_size=page_size, shuffle_seed=page_size, layout=layout)
    rows = runner.new_rows(2)
    done = [0, 0]

    def step(new: list[int]) -> None:
        out = runner.forward(rows, [ids[i, done[i] : done[i] + n] for i, n in enumerate(new)])
        for i, n in enumerate(new):
            err = rel_err(out[i], ref[i, done[i] : done[i] + n])
            assert err < TOL, f"row {i}, positions {done[i]}..{done[i] + n - 1}: {err:.2e}"
            done[i] += n

    step([5, 9])
    step([3, 2])
    while done[1] < total:
        step([1, 1])
    assert done == [total - 3, total]
    if page_size > 1:  # positions k*page..k*page+page-1 of a row share one page
        slots = runner.req_pool.req_to_token[rows[1], :total]
        pages = slots // page_size
        assert bool((slots % page_size == torch.arange(total) % page_size).all())
        assert bool((pages.view(-1, page_size) == pages.view(-1, page_size)[:, :1]).all())


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
@pytest.mark.parametrize("page_size", [16, 128])
def test_fia_multi_query_over_both_pool_layouts_matches_hf(pair, page_size, layout):
    """FIA's block sizes (16, 128) and both KV layouts: a torch-native prefill, then
    multi-query rows (verify-shaped: 4 and 3 new tokens, then 2 and 5) through the FIA backend,
    whose key / value / key_rope are the pool's latent and rope caches, against HF."""
    model, hf = pair
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(9))
    ref = hf_logits(hf, ids)
    runner = PagedRunner(model, page_size=page_size, shuffle_seed=1, layout=layout)
    rows = runner.new_rows(2)
    runner.forward(rows, [ids[0, :21], ids[1, :30]])
    runner.backend = FiaMLABackend(page_size=page_size)
    done = [21, 30]
    for new in ([4, 3], [2, 5]):
        out = runner.forward(rows, [ids[i, done[i] : done[i] + n] for i, n in enumerate(new)])
        for i, n in enumerate(new):
            assert rel_err(out[i], ref[i, done[i] : done[i] + n]) < TOL, f"row {i}"
            done[i] += n
    c_kv = runner.kv_pool.get_c_kv(0)
    assert c_kv.is_contiguous() == (layout == "separate")


def test_decode_after_long_prefill_uses_yarn_positions(tiny_hf_factory):
    """Positions past YaRN's original_max_position_embeddings (128): dense, absorbed prefill
    and decode all still match HF."""
    path, hf = tiny_hf_factory()
    model, _ = load_model(path, dtype=torch.float32, load_mtp=False)
    assert model.config.rope_parameters["rope_type"] == "yarn"
    n = 150
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(hf, ids)
    with torch.no_grad():
        dense = model.compute_logits(model(ids, torch.arange(n)))
    assert rel_err(dense, ref) < TOL
    runner = PagedRunner(model, page_size=4)
    rows = runner.new_rows(1)
    (prefill,) = runner.forward(rows, [ids[0, : n - 3]])
    assert rel_err(prefill, ref[0, : n - 3]) < TOL
    for t in range(n - 3, n):
        (step,) = runner.forward(rows, [ids[0, t : t + 1]])
        assert rel_err(step, ref[0, t : t + 1]) < TOL


def test_dense_and_absorbed_paths_agree(pair):
    """Same weights, two attention forms: expanded SDPA over [B, S] and absorbed paged MLA."""
    model, _ = pair
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        dense = model(ids, torch.arange(16))
    runner = PagedRunner(model, page_size=1)
    fb_rows = runner.new_rows(2)
    prefix, seq = [0, 0], [16, 16]
    loc = runner.allocator.alloc_extend(prefix, seq, [-1, -1])
    runner.req_pool.req_to_token[fb_rows[0], :16] = loc[:16]
    runner.req_pool.req_to_token[fb_rows[1], :16] = loc[16:]
    fb = ForwardBatch.build(
        ForwardMode.EXTEND,
        ids.reshape(-1),
        fb_rows,
        seq,
        seq,
        loc,
        runner.req_pool,
        runner.kv_pool,
        runner.backend,
    )
    with torch.no_grad():
        absorbed = model(fb.input_ids, fb.positions, fb).view(2, 16, -1)
    assert rel_err(absorbed, dense) < 1e-5
    # Every layer's latent was written for every token, nowhere else.
    for layer in range(model.config.num_hidden_layers):
        buf = runner.kv_pool.get_key_buffer(layer)
        written = torch.zeros(buf.shape[0], dtype=torch.bool)
        written[loc] = True
        assert bool((buf[written].abs().sum(-1) > 0).all())
        assert bool((buf[~written] == 0).all())


def test_dense_and_absorbed_paths_agree_in_bfloat16(tiny_hf_factory):
    """In bfloat16 the two forms round differently but pick the same tokens almost always."""
    path, _ = tiny_hf_factory()
    model, _ = load_model(path, dtype=torch.bfloat16, load_mtp=False)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        dense = model.compute_logits(model(ids, torch.arange(32)))[0]
    runner = PagedRunner(model, page_size=1)
    runner.kv_pool = MLATokenToKVPool(
        512,
        1,
        torch.bfloat16,
        model.config.kv_lora_rank,
        model.config.qk_rope_head_dim,
        layer_num=model.config.num_hidden_layers,
    )
    (absorbed,) = runner.forward(runner.new_rows(1), [ids[0]])
    assert dense.dtype == absorbed.dtype == torch.float32  # compute_logits upcasts
    # Per position: a routing near-tie may flip one token's expert choice in bf16, which moves
    # that position's logits a lot; the rest stay within rounding.
    per_position = (absorbed - dense).norm(dim=-1) / dense.norm(dim=-1)
    assert (per_position < 5e-2).float().mean() >= 0.9
    assert (absorbed.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def test_tied_word_embeddings_load(tiny_hf_factory):
    path, hf = tiny_hf_factory(tie_word_embeddings=True)
    model, _ = load_model(path, dtype=torch.float32, load_mtp=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.arange(12)[None] * 7 % 256
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(12)))
    assert rel_err(ours, hf_logits(hf, ids)) < TOL


def test_rope_interleave_false_matches_hf(tiny_hf_factory):
    path, hf = tiny_hf_factory(rope_interleave=False)
    model, _ = load_model(path, dtype=torch.float32, load_mtp=False)
    ids = torch.arange(12)[None] * 7 % 256
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(12)))
    assert rel_err(ours, hf_logits(hf, ids)) < TOL
