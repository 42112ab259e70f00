"""Load a Hugging Face-format DeepSeek-V3 directory: config.json + sharded safetensors.

Checkpoint names are DeepSeek-V3's own. MTP layers sit at `model.layers.{L + i}` for
L = num_hidden_layers; their `embed_tokens` / `shared_head.head` copies are the main model's
and are skipped. Block-FP8 weights (`weight` float8_e4m3fn + `weight_scale_inv`) are
dequantised on load unless the model is built quantized (`quantization`, a QuantConfig from
`models/quant_config.py`): then the layers the checkpoint quantizes are `layers.quantization`
modules that keep the checkpoint's int8 / fp8 tensors and scales as they are on disk (MLA's
kv_b_proj, which the absorbed attention reads as float, is dequantised after loading). A
missing, unexpected or mis-shaped tensor, or a quantized tensor where the model holds a float
one (and back), is an error naming it.

Under tensor parallelism each rank builds its shard of the model and keeps its slice of each
split tensor (`TP_SPLITS`); everything else is loaded whole on every rank. Under expert
parallelism a rank loads its own routed experts whole, skips the others', and loads the shared
expert whole.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from srt_ascend.distributed import SINGLE, TPGroup
from srt_ascend.layers.layernorm import RMSNorm
from srt_ascend.layers.linear import Linear
from srt_ascend.layers.moe import RoutedExperts
from srt_ascend.layers.moe_quant import QuantRoutedExperts
from srt_ascend.layers.ops.quant_matmul import dequantize_fp8_blocks
from srt_ascend.layers.quantization import QuantLinear, QuantModule
from srt_ascend.models.deepseek_mtp import DeepseekV3ModelMTP
from srt_ascend.models.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM, MLAAttention
from srt_ascend.models.quant_config import QuantConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# a routed expert's tensor: its weight, or a quantized expert's scales / offsets
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.\w+$")
_IGNORED = re.compile(
    r"(rotary_emb\.inv_freq|\.weight_scale_inv|\.input_scale|\.activation_scale)$"
)

_STACK = re.compile(r"^(.*\.experts)\.(w13|w2)(?:_(\w+))?$")  # stacked experts' tensors
_MOE_EXPERT = re.compile(r"\.mlp\.(experts|shared_experts)\.")  # whole under expert parallelism
# Checkpoint tensors tensor parallelism splits, the dim a rank takes its slice of, and whether
# the split is attention's (over the rank's DP group under data-parallel attention) or the
# MLPs' (over all ranks). A column-parallel layer's per-channel scales (W8A8_DYNAMIC's
# `weight_scale` / `weight_offset` [N, 1]) split with its rows; a row-parallel layer's stay
# whole (every rank's partial sum covers every output channel).
_ROWS = r"\.(weight|weight_scale|weight_offset)$"
TP_SPLITS = (
    (re.compile(r"\.(q_proj|q_b_proj|kv_b_proj)" + _ROWS), 0, True),  # heads' rows
    (re.compile(r"\.o_proj\.weight$"), 1, True),  # attention heads' columns (row-parallel)
    (re.compile(r"\.(gate_proj|up_proj)" + _ROWS), 0, False),  # dense, shared, routed experts
    (re.compile(r"\.down_proj\.weight$"), 1, False),
    (re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$"), 0, True),  # vocabulary rows
)


def tp_shape_problem(
    config, tp_size: int, expert_parallel: bool = False, attn_tp_size: int | None = None
) -> str | None:
    """Why the model cannot be split over `tp_size` ranks, its attention and vocabulary over
    `attn_tp_size` (default: tp_size) of them (a size that does not divide), or None."""
    attn = tp_size if attn_tp_size is None else attn_tp_size
    sizes = {"intermediate_size": (config.intermediate_size, tp_size)}
    sizes["num_attention_heads"] = (config.num_attention_heads, attn)
    sizes["vocab_size"] = (config.vocab_size, attn)
    if expert_parallel:
        sizes["n_routed_experts"] = (config.n_routed_experts, tp_size)
    else:
        sizes["moe_intermediate_size"] = (config.moe_intermediate_size, tp_size)
    bad = [f"{k} {v} (over {n} ranks)" for k, (v, n) in sizes.items() if v % n]
    return f"--tp-size {tp_size} does not divide the model's {', '.join(bad)}" if bad else None


def tp_slice(name: str, tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (the whole tensor when it is replicated)."""
    if tp.size == 1 or (tp.expert_parallel and _MOE_EXPERT.search(name)):
        return tensor
    for pattern, dim, attention in TP_SPLITS:
        if pattern.search(name):
            group = tp.attn_group if attention else tp
            return tensor.chunk(group.size, dim)[group.rank]
    return tensor


class CheckpointError(ValueError):
    pass


def load_config(model_path: str):
    """config.json -> transformers' DeepseekV3Config (offline; rope keys standardised)."""
    from transformers import DeepseekV3Config

    cfg_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"no config.json in model path {model_path!r}")
    with open(cfg_file) as f:
        raw = json.load(f)
    if raw.get("model_type") != "deepseek_v3":
        raise CheckpointError(
            f"{cfg_file}: model_type {raw.get('model_type')!r} is not supported (deepseek_v3)"
        )
    return DeepseekV3Config.from_pretrained(model_path, local_files_only=True)


def shard_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"no *.safetensors files in {model_path!r}")
    return [os.path.join(model_path, n) for n in names]


def iter_checkpoint(
    files: list[str],
    block_size: tuple[int, int] = (128, 128),
    desc: str = "Loading shards",
    keep: frozenset[str] = frozenset(),
) -> Iterator:
    """Yields (name, tensor); block-FP8 weights not named in `keep` are dequantised with their
    `_scale_inv` tensors, which may sit in any shard (a first pass collects those small
    tensors)."""
    scales: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("_scale_inv"):
                    scales[name] = f.get_tensor(name)
    for path in tqdm(files, desc=desc, unit="shard", disable=len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn and name not in keep:
                    scale = scales.get(name + "_scale_inv")
                    if scale is None:
                        raise CheckpointError(f"{name}: FP8 weight without {name}_scale_inv")
                    t = dequant_block_fp8(t, scale, block_size)
                yield name, t


def dequant_block_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """w [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)]: each bn x bk block times its scale."""
    n, k = w.shape
    bn, bk = block_size
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise CheckpointError(
            f"FP8 scale shape {tuple(scale_inv.shape)} does not tile weight {(n, k)} "
            f"with blocks {block_size}"
        )
    return dequantize_fp8_blocks(w, scale_inv, block_size)


def fp8_block_size(config) -> tuple[int, int]:
    qc = getattr(config, "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    bs = qc.get("weight_block_size") or (128, 128)
    return int(bs[0]), int(bs[1])


@dataclass
class _Target:
    """Where a checkpoint tensor goes: a parameter (or buffer), optionally a slice of it."""

    tensor: torch.Tensor
    index: tuple = field(default_factory=tuple)
    key: str = ""


_QUANTIZED = (torch.int8, torch.float8_e4m3fn)


class WeightLoader:
    """Maps checkpoint names onto a DeepseekV3ForCausalLM (+ optional DeepseekV3ModelMTP)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        mtp: DeepseekV3ModelMTP | None,
        tp: TPGroup = SINGLE,
        quantization: QuantConfig | None = None,
    ) -> None:
        self.model, self.mtp, self.tp = model, mtp, tp
        self.quantization = quantization
        self.num_layers = model.config.num_hidden_layers
        self.num_mtp = int(getattr(model.config, "num_nextn_predict_layers", 0) or 0)
        self.pending: dict[str, _Target] = {}
        self._collect("", model, skip_prefix=None)
        if mtp is not None:
            for i, layer in enumerate(mtp.layers):
                self._collect(f"model.layers.{self.num_layers + i}.", layer, skip_prefix=None)

    def _collect(self, prefix: str, module: nn.Module, skip_prefix: str | None) -> None:
        tensors = dict(module.named_parameters())
        tensors.update((n, b) for n, b in module.named_buffers() if "e_score_correction" in n)
        for name, t in tensors.items():
            for key, target in self._expand(prefix + re.sub(r"^block\.", "", name), t):
                self.pending[key] = target

    def _expand(self, name: str, t: torch.Tensor):
        """Stacked expert tensors (`w13`, `w2`, and quantized experts' `w13_weight_scale`
        ...) expand into the checkpoint's per-expert names."""
        first = self.tp.rank * t.shape[0] if self.tp.expert_parallel else 0  # model's ids
        m = _STACK.match(name)
        if m is None:
            yield name, _Target(t)
            return
        base, leaf = m.group(1), m.group(3) or "weight"
        if m.group(2) == "w13":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}.{first + e}.gate_proj.{leaf}", _Target(t, (e, slice(0, inter)))
                yield f"{base}.{first + e}.up_proj.{leaf}", _Target(t, (e, slice(inter, None)))
        else:
            for e in range(t.shape[0]):
                yield f"{base}.{first + e}.down_proj.{leaf}", _Target(t, (e,))

    def _other_ranks_expert(self, name: str) -> bool:
        """A routed expert another rank holds (expert parallelism)."""
        m = _EXPERT.match(name)
        if not (self.tp.expert_parallel and self.tp.size > 1 and m):
            return False
        n = self.model.config.n_routed_experts // self.tp.size
        return int(m.group(2)) // n != self.tp.rank

    def _is_shared_copy(self, name: str) -> bool:
        m = _LAYER.match(name)
        return bool(
            m
            and int(m.group(1)) >= self.num_layers
            and m.group(2) in ("embed_tokens.weight", "shared_head.head.weight")
        )

    def load(self, items) -> None:
        for name, tensor in items:
            if name not in self.pending and (_IGNORED.search(name) or self._is_shared_copy(name)):
                continue
            m = _LAYER.match(name)
            if self.mtp is None and m and int(m.group(1)) >= self.num_layers:
                continue  # MTP weights present but speculative decoding off
            target = self.pending.pop(name, None)
            if target is None and self._other_ranks_expert(name):
                continue
            if target is None:
                raise CheckpointError(f"unexpected tensor in checkpoint: {name}")
            dst = target.tensor[target.index] if target.index else target.tensor
            tensor = tp_slice(name, tensor, self.tp)
            if self.quantization is not None:
                tensor = self.quantization.from_disk(name, tensor)
            weight = name.endswith(".weight")  # (scales and offsets are cast)
            quantized = dst.dtype in _QUANTIZED or (weight and tensor.dtype in _QUANTIZED)
            if quantized and dst.dtype != tensor.dtype:
                raise CheckpointError(
                    f"dtype mismatch for {name}: checkpoint {tensor.dtype}, model expects "
                    f"{dst.dtype} (quantized and float layers must match the checkpoint's "
                    f"quantization description)"
                )
            if tuple(dst.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                    f"model expects {tuple(dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(tensor.to(dst.dtype))
        if self.pending:
            missing = sorted(self.pending)
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"missing tensors in checkpoint: {', '.join(missing[:5])}{more}")


def load_model(
    model_path: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    load_mtp: bool = True,
    config=None,
    tp: TPGroup = SINGLE,
    quantization: QuantConfig | None = None,
) -> tuple[DeepseekV3ForCausalLM, DeepseekV3ModelMTP | None]:
    """Builds the main model (and the MTP module when load_mtp), this rank's shard of them
    under tensor parallelism `tp`, fills them from disk and stacks the weights one matmul can
    read together (`fuse_weights`: serving layout).

    Router biases stay float32 (as DeepSeek keeps them); quantized layers (`quantization`)
    keep their tensors' own dtypes; everything else is cast to `dtype`.
    """
    config = config or load_config(model_path)
    layers = config.num_hidden_layers
    with torch.device("meta"):  # quantized modules swapped in before anything is allocated
        model = DeepseekV3ForCausalLM(config, tp)
        if quantization is not None:
            quantize_modules(model, lambda path: path, quantization)
    model = _empty_on_cpu(model)
    if getattr(config, "tie_word_embeddings", False):  # the copy unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    mtp = None
    if load_mtp:
        if not int(getattr(config, "num_nextn_predict_layers", 0) or 0):
            raise CheckpointError(f"{model_path}: checkpoint has no MTP layers")
        with torch.device("meta"):
            mtp = DeepseekV3ModelMTP(config, model.model.embed_tokens, model.lm_head, tp)
            if quantization is not None:
                quantize_modules(mtp, lambda path: mtp_checkpoint_name(path, layers), quantization)
        mtp = _empty_on_cpu(mtp)
        mtp._shared = (model.model.embed_tokens, model.lm_head)
    _reset_rotary(model, mtp, config)
    loader = WeightLoader(model, mtp, tp, quantization)
    keep = frozenset(n for n, t in loader.pending.items() if t.tensor.dtype in _QUANTIZED)
    loader.load(iter_checkpoint(shard_files(model_path), fp8_block_size(config), keep=keep))
    for m in (model, mtp):
        if m is not None:
            _dequantize_absorbed(m)
            _cast(m, dtype, device)
            for q in m.modules():
                if isinstance(q, QuantModule):
                    q.finish()
            fuse_weights(m)
    return model, mtp


def mtp_checkpoint_name(path: str, num_layers: int) -> str:
    """An MTP module's name in the checkpoint: its layer i's modules are model.layers.{L + i}.*
    (the decoder block's `block.` dropped)."""
    m = re.match(r"^layers\.(\d+)\.(block\.)?(.*)$", path)
    return f"model.layers.{num_layers + int(m.group(1))}.{m.group(3)}" if m else path


def quantize_modules(root: nn.Module, checkpoint_name, quantization: QuantConfig) -> None:
    """Replaces each linear layer and routed-expert set of `root` that the checkpoint
    quantizes (found by `checkpoint_name(module path)`) with the quantized module of its
    scheme, and gives the RMSNorms the checkpoint has a bias for (ModelSlim's anti-outlier
    `*norm.bias`) that bias. Run on the meta device, before parameters are allocated."""
    for path, parent in list(root.named_modules()):
        for child_name, child in list(parent.named_children()):
            ckpt = checkpoint_name(f"{path}.{child_name}" if path else child_name)
            if type(child) is Linear:
                if (method := quantization.method_for(ckpt + ".weight")) is not None:
                    quantized = QuantLinear(child.in_features, child.out_features, method)
                    setattr(parent, child_name, quantized)
            elif isinstance(child, RoutedExperts):
                first = f"{ckpt}.{child.first_expert}.gate_proj.weight"
                if (method := quantization.method_for(first)) is not None:
                    if why := method.experts_problem(child.intermediate_size):
                        raise CheckpointError(f"{ckpt}: {why}")
                    setattr(parent, child_name, QuantRoutedExperts(child, method))
            elif isinstance(child, RMSNorm) and ckpt + ".bias" in quantization.norm_biases:
                child.bias = nn.Parameter(torch.empty_like(child.weight))


def _dequantize_absorbed(module: nn.Module) -> None:
    """MLA's kv_b_proj is read as float by the absorbed attention (w_kc / w_vc): a quantized
    one is replaced by a float Linear of its dequantised weight (as SGLang and vLLM do)."""
    for m in module.modules():
        if isinstance(m, MLAAttention) and isinstance(m.kv_b_proj, QuantLinear):
            kv_b = m.kv_b_proj
            plain = Linear(kv_b.in_features, kv_b.out_features, bias=False)
            plain.weight = nn.Parameter(kv_b.dequantize())
            m.kv_b_proj = plain


def fuse_weights(module: nn.Module) -> None:
    """Serving layout: each decoder layer stacks the weights that one matmul can read
    (`DecoderLayer.fuse_weights`). Parameters stay as loaded (views of the stacks)."""
    for m in module.modules():
        if isinstance(m, DecoderLayer):
            m.fuse_weights()


def _empty_on_cpu(module: nn.Module) -> nn.Module:
    """`module.to_empty(device="cpu")`: every parameter and buffer replaced by an uninitialised
    CPU tensor of its shape and dtype (shared ones untied). to_empty's empty_like of a meta
    tensor runs through torch._refs, which imports torch.fx's symbolic shapes (seconds of a
    start on 2 cores)."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=p.dtype, device="cpu")
            setattr(m, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(m.named_buffers(recurse=False)):
            m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    return module


def _reset_rotary(model, mtp, config) -> None:
    """Non-persistent rope caches were built on meta; rebuild them for real."""
    from srt_ascend.layers.rotary import RotaryEmbedding
    from srt_ascend.models.deepseek_v3 import rope_params_of

    for m in (model, mtp):
        if m is None:
            continue
        for mod in m.modules():
            if isinstance(mod, RotaryEmbedding):
                fresh = RotaryEmbedding(
                    mod.dim, mod.max_position, rope_params_of(config), mod.interleave
                )
                mod.cos_cache, mod.sin_cache = fresh.cos_cache, fresh.sin_cache


def _cast(module: nn.Module, dtype: torch.dtype, device) -> None:
    module.to(device)
    kept = {id(p) for m in module.modules() if isinstance(m, QuantModule) for p in m.parameters()}
    for p in module.parameters():
        if id(p) not in kept:
            p.data = p.data.to(dtype)
    for mod in module.modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if bname in ("cos_cache", "sin_cache", "e_score_correction_bias"):
                continue
            setattr(mod, bname, buf.to(dtype))
