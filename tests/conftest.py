"""Shared fixtures: tiny random DeepSeek-V3 checkpoints written by transformers itself.

The reference implementation is transformers' own `DeepseekV3ForCausalLM`: a fixture builds it
from a tiny config with every weight randomised (norm weights and router biases included, so
nothing is a no-op), saves it with `save_pretrained`, and hands back (path, hf_model). Tests load
the directory with srt_ascend's loader and compare against the HF model in float32.

MTP weights are not part of transformers' model; `tiny_mtp_checkpoint` adds them under
DeepSeek-V3's real names (layer index num_hidden_layers) and writes the result as two shards
with a `model.safetensors.index.json`, like the released checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)
# mscale != mscale_all_dim makes both YaRN factors (cos/sin scale and softmax scale) non-trivial.
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
}
# The variants the model tests run over (fixture param id -> config overrides).
HF_VARIANTS = {
    "q_lora48-yarn": {},
    "no_q_lora-yarn": {"q_lora_rank": None},
    "q_lora48-plain_rope": {"rope_scaling": None},
}


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    kwargs = {**TINY_CONFIG, "rope_scaling": YARN, **overrides}
    if kwargs["rope_scaling"] is None:
        del kwargs["rope_scaling"]
    return DeepseekV3Config(attn_implementation="eager", **kwargs)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: matrices N(0, 0.1), norm weights U(0.5, 1.5), router biases
    U(-0.2, 0.2) (large enough to change which experts win)."""
    gen = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        if p.dim() > 1:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        else:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_((torch.rand(b.shape, generator=gen) - 0.5) * 0.4)


def build_tiny_hf_checkpoint(path: str, seed: int = 0, **overrides):
    """A random transformers DeepseekV3ForCausalLM saved to `path`. Returns (path, hf_model)."""
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM(tiny_config(**overrides)).eval()
    randomize_(hf, seed)
    hf.save_pretrained(path)
    return path, hf


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in `path` (no dequantisation, no renaming)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update((k, f.get_tensor(k)) for k in f.keys())
    return out


def write_checkpoint(
    path: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    num_shards: int = 1,
    shard_of: Callable[[str], int] | None = None,
) -> str:
    """config.json + tensors split over `num_shards` files (+ an index when more than one).

    By default names are dealt round-robin in sorted order, a `*_scale_inv` tensor going with
    its weight (as in the released DeepSeek-V3 shards); `shard_of(name)` overrides that.
    """
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if shard_of is None:
        bases = sorted({n.removesuffix("_scale_inv") for n in tensors})
        order = {b: i % num_shards for i, b in enumerate(bases)}
        shard_of = lambda n: order[n.removesuffix("_scale_inv")]
    files = (
        ["model.safetensors"]
        if num_shards == 1
        else [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    )
    weight_map = {n: files[shard_of(n)] for n in sorted(tensors)}
    for shard in files:
        part = {n: tensors[n].contiguous() for n, f in weight_map.items() if f == shard}
        save_file(part, os.path.join(path, shard), metadata={"format": "pt"})
    if num_shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return path


@dataclass
class MTPCheckpoint:
    """A checkpoint directory holding main + MTP weights, and the pieces to recompute MTP.

    `hf_blocks[i]` is a transformers DeepseekV3DecoderLayer (layer index L + i) holding exactly
    the block weights written for MTP layer i; `mtp_tensors` are all tensors under
    `model.layers.{L + i}.` as written (real DeepSeek-V3 names).
    """

    path: str
    hf_model: torch.nn.Module
    hf_blocks: list
    mtp_tensors: dict[str, torch.Tensor]
    config: dict


def build_mtp_checkpoint(
    src_dir: str, hf_model, dst_dir: str, num_mtp: int = 1, seed: int = 1
) -> MTPCheckpoint:
    """Copies the HF checkpoint in `src_dir` and adds `num_mtp` random MTP layers."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = num_mtp
    n_main = config["num_hidden_layers"]
    # The MTP blocks are layers L .. L+num_mtp-1 of a deeper random HF model: save_pretrained
    # writes them under DeepSeek's per-expert names, and its decoder layers are the reference.
    deeper_cfg = DeepseekV3Config.from_dict({**config, "num_hidden_layers": n_main + num_mtp})
    deeper_cfg._attn_implementation = "eager"
    deeper = DeepseekV3ForCausalLM(deeper_cfg).eval()
    randomize_(deeper, seed)
    scratch = dst_dir + ".deeper"
    deeper.save_pretrained(scratch)
    deeper_tensors = read_checkpoint(scratch)
    shutil.rmtree(scratch)

    tensors = read_checkpoint(src_dir)
    gen = torch.Generator().manual_seed(seed + 1000)
    d = config["hidden_size"]
    mtp_tensors = {}
    for i in range(num_mtp):
        prefix = f"model.layers.{n_main + i}."
        mtp_tensors.update((k, v) for k, v in deeper_tensors.items() if k.startswith(prefix))
        mtp_tensors[prefix + "enorm.weight"] = torch.rand(d, generator=gen) + 0.5
        mtp_tensors[prefix + "hnorm.weight"] = torch.rand(d, generator=gen) + 0.5
        mtp_tensors[prefix + "eh_proj.weight"] = torch.randn(d, 2 * d, generator=gen) * 0.1
        mtp_tensors[prefix + "shared_head.norm.weight"] = torch.rand(d, generator=gen) + 0.5
        # The shared copies, as DeepSeek-V3 ships them (equal to the main model's).
        mtp_tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        mtp_tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    write_checkpoint(dst_dir, config, {**tensors, **mtp_tensors}, num_shards=2)
    blocks = [deeper.model.layers[n_main + i] for i in range(num_mtp)]
    return MTPCheckpoint(dst_dir, hf_model, blocks, mtp_tensors, config)


@pytest.fixture
def gemm_mode():
    """`linear.configure` for one test (the process-wide CPU GEMM mode: small-GEMM routing,
    batch-invariant row tiles), the mode before it restored after."""
    from srt_ascend.layers import linear

    before = (linear.small_gemm_limit(), linear.row_tile())
    yield linear.configure
    linear.configure(*before)


@pytest.fixture(scope="session")
def tiny_hf_factory(tmp_path_factory) -> Callable:
    """make(**config_overrides) -> (path, hf_model); one build per distinct override set."""
    cache: dict = {}

    def make(**overrides):
        key = repr(sorted(overrides.items()))
        if key not in cache:
            path = str(tmp_path_factory.mktemp("tiny_hf"))
            cache[key] = build_tiny_hf_checkpoint(path, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=sorted(HF_VARIANTS))
def tiny_hf_checkpoint(request, tiny_hf_factory):
    """(path, hf_model) for each config variant in HF_VARIANTS (q_lora_rank 48 / None, YaRN)."""
    return tiny_hf_factory(**HF_VARIANTS[request.param])


@pytest.fixture(scope="session")
def tiny_mtp_factory(tmp_path_factory, tiny_hf_factory) -> Callable:
    """make(num_mtp=1, **config_overrides) -> MTPCheckpoint (2 shards + index)."""
    cache: dict = {}

    def make(num_mtp: int = 1, **overrides):
        key = (num_mtp, repr(sorted(overrides.items())))
        if key not in cache:
            src, hf = tiny_hf_factory(**overrides)
            dst = str(tmp_path_factory.mktemp("tiny_mtp") / "ckpt")
            cache[key] = build_mtp_checkpoint(src, hf, dst, num_mtp=num_mtp)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_mtp_checkpoint(tiny_mtp_factory) -> MTPCheckpoint:
    """The default tiny config (q_lora_rank 48, YaRN) with one MTP layer, sharded."""
    return tiny_mtp_factory()


@pytest.fixture(scope="session")
def checkpoint_io() -> SimpleNamespace:
    """The helpers above, for tests that write their own (tampered) checkpoints."""
    return SimpleNamespace(
        read=read_checkpoint, write=write_checkpoint, randomize=randomize_, config=tiny_config
    )


# The suite runs on two pytest-xdist workers, a module at a time (`--dist loadfile`, set in
# pyproject.toml): a module's fixtures (servers, engines) are built once, on one worker.
# Workers take modules in collection order (`--no-loadscope-reorder`: xdist would otherwise
# order them by test count), so the longest go first, and the run does not end waiting on one
# long module started last. Measured on a 2-core machine (`--durations`);
# every module not listed follows in its usual order.
LONGEST_FIRST = (  # seconds per module, 2 workers on a 2-core Xeon (AVX-512, AMX), 2026-12-04
    "engine/test_compile_lossless.py",  # 171
    "e2e/test_disaggregation.py",  # 133
    "engine/test_deterministic.py",  # 118
    "e2e/test_schemathesis.py",  # 105
    "engine/test_spec_distribution.py",  # 103
    "e2e/test_sglang_launcher.py",  # 101
    "unit/test_compile_cache.py",  # 85
    "e2e/test_dp_attention.py",  # 74
    "e2e/test_tensor_parallel.py",  # 71
    "e2e/test_multi_node.py",  # 55
    "e2e/test_deterministic_parallel.py",  # 41
    "engine/test_overlap.py",  # 36
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = item.path.as_posix()
        return next((r for name, r in rank.items() if path.endswith("/" + name)), len(rank))

    items.sort(key=key)  # stable: each module's tests keep their order
