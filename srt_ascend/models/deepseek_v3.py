"""DeepSeek-V3 (MLA + DeepSeekMoE) for the runtime and for training.

Two attention forms share one set of weights:
- absorbed (runtime): q_nope is folded through W_UK into the latent space and attention runs
  over the cached latent `c_kv` and rope key `k_pe` through an AttentionBackend;
- expanded (training / dense reference): K and V are materialised from the latent and
  attention is causal over a [B, S] block with SDPA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from srt_ascend.distributed import SINGLE, TPGroup
from srt_ascend.layers.layernorm import RMSNorm
from srt_ascend.layers.linear import Linear, bmm
from srt_ascend.layers.moe import DeepseekMoE, DenseMLP
from srt_ascend.layers.quantization import QuantStack, stack_linears
from srt_ascend.layers.rotary import RotaryEmbedding, softmax_scale
from srt_ascend.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from srt_ascend.layers.weight_stack import WeightStack

if TYPE_CHECKING:
    from srt_ascend.model_executor.forward_batch import ForwardBatch


def rope_params_of(config) -> dict:
    """The rope dict, whichever name the config uses (transformers 5: rope_parameters)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


class MLAAttention(nn.Module):
    """Under tensor parallelism a rank owns num_attention_heads / tp heads: q_b_proj (or
    q_proj) and kv_b_proj hold those heads' rows (column-parallel), o_proj those heads'
    input columns (row-parallel: its output is a partial sum, all-reduced by DecoderLayer).
    The latent projections q_a_proj, kv_a_proj_with_mqa and their norms are replicated, and
    so is the latent KV cache, which every head reads."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        hidden, h = config.hidden_size, self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        if bias and tp.size > 1:  # o_proj's bias would be summed tp times
            raise ValueError("attention_bias models are not supported with --tp-size > 1")
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = Linear(self.q_lora_rank, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = Linear(
            self.kv_lora_rank, h * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = Linear(h * self.v_head_dim, hidden, bias=bias)
        rope = rope_params_of(config)
        self.rotary_emb = RotaryEmbedding(
            self.qk_rope_head_dim,
            config.max_position_embeddings,
            rope,
            interleave=bool(getattr(config, "rope_interleave", True)),
        )
        self.scale = softmax_scale(self.qk_head_dim, rope)
        # run time: [q_a_proj; kv_a_proj_with_mqa]
        self.qkv_a: WeightStack | QuantStack | None = None

    def fuse_weights(self) -> None:
        """q_a_proj and kv_a_proj_with_mqa read the same input: one stacked linear (SGLang's
        fused_qkv_a_proj_with_mqa), float or quantized (`stack_linears`). Not with biases
        (DeepSeek-V3 has none)."""
        if self.q_lora_rank is not None:
            self.qkv_a = stack_linears([self.q_a_proj, self.kv_a_proj_with_mqa])
        self._refresh_absorbed()  # built once after loading (compiled forwards only read it)

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [*P, hidden] -> q_nope [*P,H,nope], q_pe [*P,H,rope], c_kv [*P,R], k_pe [*P,rope]."""
        q, c_kv, k_pe = self._latents(x, with_q=True)
        q = q.view(*x.shape[:-1], self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        return q_nope, q_pe, c_kv, k_pe

    def _latents(self, x: torch.Tensor, with_q: bool):
        """x [*P, hidden] -> q [*P, H * qk] (None unless `with_q`: q_b_proj is skipped, not
        the stacked q_a / kv_a linear, whose bits must not change), normed c_kv [*P, R], k_pe
        before its rotation [*P, rope]."""
        q = None
        if self.qkv_a is not None and self.qkv_a.intact():
            q_a, kv_a = self.qkv_a.linear(x).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            if with_q:
                q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            kv_a = self.kv_a_proj_with_mqa(x)
            if with_q and self.q_lora_rank is None:
                q = self.q_proj(x)
            elif with_q:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return q, self.kv_a_layernorm(c_kv), k_pe

    def _w_kc_vc(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into contiguous batched-matmul operands (SGLang's w_kc /
        w_vc): W_UK [H, nope, R] and W_UV^T [H, R, v]. Cached, and rebuilt by eager forwards
        whenever kv_b_proj's weight is replaced or modified in place. A compiled forward reads
        the cache as it is (no data-pointer or version check in the graph): the compiler runs
        the forward eagerly before tracing it, and freezes the weights it was traced with."""
        if not torch.compiler.is_compiling():
            self._refresh_absorbed()
        return self._w_kc, self._w_vc

    def _refresh_absorbed(self) -> None:
        w = self.kv_b_proj.weight
        version = -1 if w.is_inference() else w._version  # inference tensors have none
        key = (w.data_ptr(), version, w.dtype, w.device)
        if getattr(self, "_absorbed_key", None) == key:
            return
        # Plain tensors even when first built under inference_mode.
        with torch.inference_mode(False), torch.no_grad():
            heads = w.view(
                self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
            )
            self._w_kc = heads[:, : self.qk_nope_head_dim].contiguous()
            self._w_vc = heads[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous()
        self._absorbed_key = key

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Absorbed MLA over the paged latent cache. x [T, hidden] -> [T, hidden]."""
        q_nope, q_pe, c_kv, k_pe = self._project(x, positions)
        w_kc, w_vc = self._w_kc_vc()
        q_latent = bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)  # [T, H, R]
        o_latent = forward_batch.attn_backend.forward(
            q_latent, q_pe, c_kv, k_pe, self.layer_id, self.scale, forward_batch
        )
        out = bmm(o_latent.to(x.dtype).transpose(0, 1), w_vc)  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))

    def write_kv(
        self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch
    ) -> None:
        """Only the KV `forward` writes at these positions: the latents of x [T, hidden],
        by the same ops (so the same bits), without the queries or attention. A position's
        KV depends on its own input only."""
        _, c_kv, k_pe = self._latents(x, with_q=False)
        k_pe = self.rotary_emb.rotate_k(positions, k_pe)
        pool = forward_batch.token_to_kv_pool
        pool.set_mla_kv_buffer(self.layer_id, forward_batch.out_cache_loc, c_kv, k_pe)

    def forward_dense(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Expanded MLA, causal over each row. positions [S]; x [B, S, hidden]."""
        b, s, _ = x.shape
        q_nope, q_pe, c_kv, k_pe = self._project(x, positions)
        kv = self.kv_b_proj(c_kv).view(b, s, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, S, qk]
        k_pe = k_pe.unsqueeze(2).expand(b, s, self.num_heads, self.qk_rope_head_dim)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        pad = self.qk_head_dim - self.v_head_dim
        if pad > 0:  # equal head dims let SDPA take its fused (flash) CPU kernel
            v = F.pad(v, (0, pad))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        out = out[..., : self.v_head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DecoderLayer(nn.Module):
    """Under tensor parallelism attention and MLP each return a partial sum (row-parallel
    o_proj; down projections over this rank's share of the intermediate rows): one
    all-reduce after each, before the residual add.

    Under data-parallel attention (`tp.dp_size` > 1) attention is split within this rank's
    DP group only (`tp.attn_group`, whose all-reduce sums its partial sums), and the MLP over
    all ranks: it runs on every DP group's tokens (`dp_gather`), and each group takes back the
    total of its own rows (`dp_scatter`); with `--moe-a2a-backend all_to_all` a MoE layer
    instead sends each token of its group to its experts' ranks and back
    (`DeepseekMoE.forward_all_to_all`), while dense MLPs keep the gather. A forward with no
    tokens (IDLE: a DP group without requests) skips attention and still joins the MLP's
    collectives. A captured forward's counts are fixed (every group's padded rows), so its
    gather and reduction have fixed shapes (model_executor/dp_graph.py)."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.attn_tp = tp.attn_group
        self.self_attn = MLAAttention(config, layer_id, self.attn_tp)
        self.is_moe = bool(layer_id >= config.first_k_dense_replace and config.n_routed_experts)
        if self.is_moe:
            self.mlp: nn.Module = DeepseekMoE(config, tp)
        else:
            inter = tp.shard(config.intermediate_size, "intermediate_size")
            self.mlp = DenseMLP(config.hidden_size, inter)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse_weights(self) -> None:
        """Run-time weight stacks (serving only; training keeps the plain parameters)."""
        self.self_attn.fuse_weights()
        self.mlp.fuse_weights()

    def forward(self, positions, x, forward_batch: ForwardBatch | None):
        h = self.input_layernorm(x)
        if forward_batch is None:
            x = x + self.attn_tp.all_reduce(self.self_attn.forward_dense(positions, h))
        elif not forward_batch.forward_mode.is_idle():
            x = x + self.attn_tp.all_reduce(self.self_attn(positions, h, forward_batch))
        h = self.post_attention_layernorm(x)
        counts = None if forward_batch is None else forward_batch.dp_token_counts
        if counts is None:
            return x + self.tp.all_reduce(self._mlp(h, forward_batch))
        if not any(counts):  # every DP group idle: no MLP collective at all
            return x
        if self.is_moe and self.mlp.all_to_all is not None:  # tokens go to their experts
            return x + self.mlp.forward_all_to_all(h, _routing_free(forward_batch, h))
        every_group = self._mlp(self.tp.dp_gather(h, counts), forward_batch)
        return x + self.tp.dp_scatter(every_group, counts)

    def write_kv(self, positions, x, forward_batch: ForwardBatch) -> None:
        """The KV `forward` writes at these positions (MLAAttention.write_kv), nothing else:
        no attention, MLP or collective."""
        self.self_attn.write_kv(positions, self.input_layernorm(x), forward_batch)

    def _mlp(self, h: torch.Tensor, forward_batch: ForwardBatch | None) -> torch.Tensor:
        """This rank's partial sum of the MLP over h."""
        if self.is_moe and forward_batch is not None and _routing_free(forward_batch, h):
            return self.mlp(h, static_shapes=True)  # no routing-dependent shapes
        return self.mlp(h)


def _routing_free(fb: ForwardBatch, x: torch.Tensor) -> bool:
    """Forwards whose MoE must not size anything by the routing: graph captures, and every
    forward on an accelerator (the sparse path reads the per-expert counts to the host, a sync
    per layer; a grouped-GEMM kernel reading them on the device would lift this)."""
    return fb.static_shapes or x.device.type != "cpu"


class DeepseekV3Model(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp.attn_group
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch: ForwardBatch | None = None):
        """Returns the final-normed hidden states (what the LM head and the MTP module read)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, forward_batch)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    """Main model. `forward` takes flattened tokens [T] with a ForwardBatch (runtime) or
    [B, S] tokens with forward_batch=None (dense causal, used by training and references).
    `tp`: the tensor-parallel group this rank's shard belongs to (one rank: the whole model);
    under data-parallel attention the embedding and LM head are split like attention, within
    the rank's DP group."""

    def __init__(self, config, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp.attn_group)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, forward_batch: ForwardBatch | None = None):
        """-> final-normed hidden [..., hidden]; `compute_logits` turns rows of it into logits."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
