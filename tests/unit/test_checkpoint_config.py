"""The shipped checkpoint's config.json carries DeepSeek-V3's published fields, with values that
say what the checkpoint does, and is what the training tool writes."""

from __future__ import annotations

import json
import os

import torch

from srt_ascend.models.loader import load_config, load_model
from srt_ascend.server_args import SHIPPED_MODEL
from srt_ascend.tools import train_tiny

# Top-level keys of DeepSeek-V3's own config.json, huggingface.co/deepseek-ai/DeepSeek-V3
# (blob/main/config.json; the same key set in DeepSeek-V3-0324 and DeepSeek-V3-Base).
DEEPSEEK_V3_CONFIG_KEYS = frozenset(
    """architectures attention_bias attention_dropout auto_map aux_loss_alpha bos_token_id
    eos_token_id ep_size first_k_dense_replace hidden_act hidden_size initializer_range
    intermediate_size kv_lora_rank max_position_embeddings model_type moe_intermediate_size
    moe_layer_freq n_group n_routed_experts n_shared_experts norm_topk_prob num_attention_heads
    num_experts_per_tok num_hidden_layers num_key_value_heads num_nextn_predict_layers
    pretraining_tp q_lora_rank qk_nope_head_dim qk_rope_head_dim quantization_config
    rms_norm_eps rope_scaling rope_theta routed_scaling_factor scoring_func seq_aux
    tie_word_embeddings topk_group topk_method torch_dtype transformers_version use_cache
    v_head_dim vocab_size""".split()
)
# Its rope_scaling keys (YaRN).
DEEPSEEK_V3_ROPE_SCALING_KEYS = frozenset(
    "beta_fast beta_slow factor mscale mscale_all_dim original_max_position_embeddings type".split()
)
# Left out on purpose: auto_map names configuration_deepseek.py / modeling_deepseek.py, which
# are not shipped (transformers has DeepseekV3Config built in); quantization_config describes
# FP8 weights and these are bf16; transformers_version is a stamp of the writer, not a field.
NOT_APPLICABLE = frozenset({"auto_map", "quantization_config", "transformers_version"})
EXTRA = frozenset({"pad_token_id"})  # the tokenizer's pad id, kept beside bos/eos

# Attributes SGLang 0.5.23 reads from the config without a default when it builds
# DeepseekV3ForCausalLM / its NextN draft model (sglang/srt/models/deepseek_v2.py and
# deepseek_nextn.py; `moe_layer_freq` is the one whose absence failed the load).
SGLANG_DEEPSEEK_READS = frozenset(
    """architectures first_k_dense_replace hidden_act hidden_size intermediate_size kv_lora_rank
    max_position_embeddings moe_intermediate_size moe_layer_freq n_group n_routed_experts
    n_shared_experts norm_topk_prob num_attention_heads num_experts_per_tok num_hidden_layers
    q_lora_rank qk_nope_head_dim qk_rope_head_dim rms_norm_eps routed_scaling_factor
    scoring_func tie_word_embeddings topk_group topk_method v_head_dim vocab_size""".split()
)


def shipped_config() -> dict:
    with open(os.path.join(SHIPPED_MODEL, "config.json")) as f:
        return json.load(f)


def test_shipped_config_has_deepseek_v3_keys():
    keys = set(shipped_config())
    assert DEEPSEEK_V3_CONFIG_KEYS - NOT_APPLICABLE - keys == set()
    assert keys - DEEPSEEK_V3_CONFIG_KEYS == EXTRA
    assert set(shipped_config()["rope_scaling"]) == DEEPSEEK_V3_ROPE_SCALING_KEYS


def test_training_tool_writes_the_shipped_config():
    assert train_tiny.checkpoint_config() == shipped_config()
    a, b = train_tiny.checkpoint_config(), train_tiny.checkpoint_config()
    a["rope_scaling"]["rope_type"] = "yarn"  # what DeepseekV3Config does to the dict it gets
    assert b == shipped_config() and a is not b


def test_config_values_describe_the_checkpoint():
    cfg = shipped_config()
    model, mtp = load_model(SHIPPED_MODEL, dtype=torch.float32, load_mtp=True)
    assert mtp.num_layers == cfg["num_nextn_predict_layers"] == 1
    layers = model.model.layers
    expect_moe = [
        i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0
        for i in range(cfg["num_hidden_layers"])
    ]
    assert [layer.is_moe for layer in layers] == expect_moe
    routers = [m for m in (*model.modules(), *mtp.modules()) if type(m).__name__ == "TopkRouter"]
    assert len(routers) == sum(expect_moe) + cfg["num_nextn_predict_layers"]
    for r in routers:
        assert (r.n_group, r.topk_group, r.top_k) == (
            cfg["n_group"],
            cfg["topk_group"],
            cfg["num_experts_per_tok"],
        )
        assert r.norm_topk_prob is cfg["norm_topk_prob"]
        assert r.routed_scaling_factor == cfg["routed_scaling_factor"]
    # topk_method noaux_tc: a trained selection bias that picks experts but does not weight
    # them; scoring_func sigmoid: the weights are sigmoid scores.
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert all(bool(r.e_score_correction_bias.abs().sum() > 0) for r in routers)
    r = routers[0]
    x = torch.randn(5, cfg["hidden_size"])
    weights, ids = r(x)
    scores = torch.sigmoid(x @ r.weight.float().T).gather(1, ids)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))
    assert cfg["ep_size"] == 1 and cfg["aux_loss_alpha"] == 0.0


def test_loaded_config_has_what_sglang_reads():
    cfg = load_config(SHIPPED_MODEL)
    assert {name for name in SGLANG_DEEPSEEK_READS if not hasattr(cfg, name)} == set()
    assert (cfg.moe_layer_freq, cfg.topk_method, cfg.scoring_func, cfg.ep_size) == (
        1,
        "noaux_tc",
        "sigmoid",
        1,
    )
