"""Train the shipped tiny DeepSeek-V3 + MTP checkpoint, offline and reproducibly.

    python -m srt_ascend.tools.train_tiny [--out DIR] [--minutes-cap M]

Corpus: CPython's standard-library sources (srt_ascend.tools.corpus), 1 file in 20 held out by
path hash. Tokenizer: byte-level BPE (vocab 8192) trained with `tokenizers` on the training
files. Objective: next-token cross-entropy for the main model plus, for the MTP layer, a mix
of cross-entropy on token t+2 and a KL term towards the main model's own (detached)
distribution for t+2, whose weight ramps up during training: the draft is trained to agree
with the target it will be verified against. Router biases follow DeepSeek-V3's
auxiliary-loss-free balancing (bias += gamma * sign(mean load - load)).
The step count and seed are fixed; the same Python version and torch give the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from srt_ascend.tools.corpus import list_files, split
from srt_ascend.utils import tune_glibc_malloc

SEED = 20261129
VOCAB_SIZE = 8192
SEQ_LEN = 256
BATCH = 8
STEPS = 2400  # joint main + MTP training
DRAFT_STEPS = 800  # then MTP-only distillation towards the frozen main model
LR, MIN_LR_FRAC, WARMUP = 2e-3, 0.1, 150
DRAFT_LR = 1e-3
DRAFT_DISTILL = 0.8
MTP_WEIGHT = 0.5
DISTILL_MAX = 0.7  # final share of the KL-to-main term in the MTP loss
BIAS_GAMMA = 1e-3
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)

# config.json as written (every key of DeepSeek-V3's published config.json except its
# `auto_map`, which names remote-code files not shipped here, and `quantization_config`: the
# weights are bf16). Values say what this checkpoint does: sigmoid router scores with a
# selection bias (`noaux_tc`), grouped top-k, every layer after the first an MoE layer, no
# auxiliary balance loss (balancing is the bias update), one MTP layer.
MODEL_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    aux_loss_alpha=0.0,  # no sequence-wise balance loss was used in training
    bos_token_id=0,
    eos_token_id=1,
    ep_size=1,
    first_k_dense_replace=1,
    hidden_act="silu",
    hidden_size=256,
    initializer_range=0.02,  # build_models' normal init
    intermediate_size=768,
    kv_lora_rank=64,
    max_position_embeddings=4096,
    model_type="deepseek_v3",
    moe_intermediate_size=256,
    moe_layer_freq=1,
    n_group=4,
    n_routed_experts=8,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=8,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_key_value_heads=8,
    num_nextn_predict_layers=1,
    pad_token_id=2,
    pretraining_tp=1,
    q_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    rms_norm_eps=1e-6,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024,
        "type": "yarn",
    },
    rope_theta=10000.0,
    routed_scaling_factor=1.0,
    scoring_func="sigmoid",
    seq_aux=True,
    tie_word_embeddings=False,
    topk_group=2,
    topk_method="noaux_tc",
    torch_dtype="bfloat16",
    use_cache=True,
    v_head_dim=32,
    vocab_size=VOCAB_SIZE,
)


def checkpoint_config() -> dict:
    """The config.json this tool writes: a deep copy of MODEL_CONFIG (transformers'
    DeepseekV3Config standardises the rope_scaling dict it is given in place)."""
    return json.loads(json.dumps(MODEL_CONFIG))


def train_tokenizer(texts: list[str], out_dir: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    add_bos_post_processor(tok)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "add_bos_token": True,
                "model_max_length": MODEL_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )
    return tok


def add_bos_post_processor(tok) -> None:
    """Encoding a prompt prepends <|bos|>, as every training document starts with it."""
    from tokenizers import processors

    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):  # the post-processor puts <|bos|> first
        assert enc.ids[0] == bos
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int16 if VOCAB_SIZE < 2**15 else np.int32)


def build_models(config):
    from srt_ascend.models.deepseek_mtp import DeepseekV3ModelMTP
    from srt_ascend.models.deepseek_v3 import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(config)
    mtp = DeepseekV3ModelMTP(config, model.model.embed_tokens, model.lm_head)
    for module in (model, mtp):
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                torch.nn.init.ones_(p)
            else:
                torch.nn.init.normal_(p, std=0.02)
    return model, mtp


def batch_at(tokens: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(tokens) - SEQ_LEN - 2, size=BATCH)
    return torch.stack([tokens[s : s + SEQ_LEN + 2] for s in starts]).long()


def losses(model, mtp, window: torch.Tensor, distill: float):
    """window [B, S+2]: main predicts w[t+1] at t; MTP at t reads (h_t, w[t+1]), predicts w[t+2]."""
    ids, y1, y2 = window[:, :SEQ_LEN], window[:, 1 : SEQ_LEN + 1], window[:, 2:]
    pos = torch.arange(SEQ_LEN)
    hidden = model(ids, pos)
    logits = model.compute_logits(hidden)
    main_ce = F.cross_entropy(logits.view(-1, VOCAB_SIZE), y1.reshape(-1))
    mtp_logits = mtp.compute_logits(mtp(y1, hidden, pos))
    mtp_ce = F.cross_entropy(mtp_logits.reshape(-1, VOCAB_SIZE), y2.reshape(-1))
    teacher = F.log_softmax(logits[:, 1:].detach(), dim=-1)  # main's view of t+2
    student = F.log_softmax(mtp_logits[:, :-1], dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
    total = main_ce + MTP_WEIGHT * ((1 - distill) * mtp_ce + distill * kl)
    return total, main_ce.detach(), mtp_ce.detach(), kl.detach()


def draft_losses(model, mtp, window: torch.Tensor):
    """Phase 2: the main model is frozen; the MTP layer learns to agree with its t+2 view."""
    ids, y1, y2 = window[:, :SEQ_LEN], window[:, 1 : SEQ_LEN + 1], window[:, 2:]
    pos = torch.arange(SEQ_LEN)
    with torch.no_grad():
        hidden = model(ids, pos)
        teacher = F.log_softmax(model.compute_logits(hidden[:, 1:]), dim=-1)
    mtp_logits = mtp.compute_logits(mtp(y1, hidden, pos))
    mtp_ce = F.cross_entropy(mtp_logits.reshape(-1, VOCAB_SIZE), y2.reshape(-1))
    student = F.log_softmax(mtp_logits[:, :-1], dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
    return (1 - DRAFT_DISTILL) * mtp_ce + DRAFT_DISTILL * kl, mtp_ce.detach(), kl.detach()


def update_router_biases(modules) -> None:
    """Aux-loss-free balancing: nudge each expert's bias toward equal load (DeepSeek-V3 2.1.2)."""
    from srt_ascend.layers.moe import TopkRouter

    for module in modules:
        for m in module.modules():
            if isinstance(m, TopkRouter) and getattr(m, "_load", None) is not None:
                load = m._load.float()
                m.e_score_correction_bias += BIAS_GAMMA * torch.sign(load.mean() - load)
                m._load = None


def _track_load(router, inputs, output) -> None:
    _, ids = output
    counts = torch.bincount(ids.flatten(), minlength=router.n_experts)
    router._load = counts if getattr(router, "_load", None) is None else router._load + counts


def _step(opt, loss, params, routed_modules) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    with torch.no_grad():
        update_router_biases(routed_modules)


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(model, mtp, config, out_dir: str) -> None:
    from safetensors.torch import save_file

    L = config.num_hidden_layers
    tensors = {}
    for name, t in model.state_dict().items():
        tensors.update(_checkpoint_names(name, t))
    for i, layer in enumerate(mtp.layers):
        for name, t in layer.state_dict().items():
            name = name.removeprefix("block.")
            tensors.update(_checkpoint_names(f"model.layers.{L + i}.{name}", t))
    out = {}
    for k, v in tensors.items():
        keep_fp32 = k.endswith("e_score_correction_bias")
        out[k] = v.detach().to(torch.float32 if keep_fp32 else torch.bfloat16).contiguous()
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _checkpoint_names(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacked experts back to DeepSeek-V3's per-expert names."""
    if name.endswith(".experts.w13"):
        base, inter = name[: -len(".w13")], t.shape[1] // 2
        out = {}
        for e in range(t.shape[0]):
            out[f"{base}.{e}.gate_proj.weight"] = t[e, :inter]
            out[f"{base}.{e}.up_proj.weight"] = t[e, inter:]
        return out
    if name.endswith(".experts.w2"):
        return {f"{name[: -len('.w2')]}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    return {name: t}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_out = os.path.join(
        os.path.dirname(__file__), "..", "checkpoints", "deepseek-v3-tiny-mtp"
    )
    p.add_argument("--out", default=os.path.normpath(default_out), help="output directory")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (shipped: default)")
    p.add_argument("--draft-steps", type=int, default=DRAFT_STEPS, help="MTP-only steps")
    p.add_argument("--max-files", type=int, default=0, help="smoke runs: use the first N files")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def _corpus_tokens(out_dir: str, max_files: int) -> tuple[torch.Tensor, int]:
    """Train the tokenizer on the training files (written to `out_dir`) and encode them.
    Returns the training tokens and the number of training files."""
    train_files, held_files = split(list_files())
    if max_files:
        train_files = train_files[:max_files]
    texts = [f.read() for f in train_files]
    t0 = time.time()
    tok = train_tokenizer(texts, out_dir)
    tokens = torch.from_numpy(encode_docs(tok, texts).astype(np.int64))
    print(
        f"tokenizer + encode: {time.time() - t0:.0f}s; {len(train_files)} train files, "
        f"{len(held_files)} held out, {len(tokens)} train tokens",
        flush=True,
    )
    return tokens, len(train_files)


def _log(log: list[dict], rec: dict) -> None:
    log.append(rec)
    print(json.dumps(rec), flush=True)


def _train_joint(model, mtp, params, tokens, rng, steps: int, log_every: int, log, t0) -> None:
    """Phase 1: main + MTP together, the MTP loss's KL-to-main share ramping to DISTILL_MAX."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps)
        distill = DISTILL_MAX * step / max(1, steps - 1)
        total, main_ce, mtp_ce, kl = losses(model, mtp, batch_at(tokens, rng), distill)
        _step(opt, total, params, (model, mtp))
        if step % log_every == 0 or step == steps - 1:
            rec = dict(phase=1, step=step, main_ce=round(main_ce.item(), 4))
            rec.update(mtp_ce=round(mtp_ce.item(), 4), kl=round(kl.item(), 4))
            _log(log, dict(rec, lr=lr_at(step, steps), seconds=round(time.time() - t0)))


def _train_draft(model, mtp, tokens, rng, steps: int, log_every: int, log, t0) -> None:
    """Phase 2: the MTP layer alone, distilled towards the frozen main model (cosine lr)."""
    draft_params = list(mtp.parameters())
    draft_opt = torch.optim.AdamW(draft_params, lr=DRAFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(steps):
        cosine = 1 + math.cos(math.pi * step / max(1, steps))
        lr = DRAFT_LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * cosine)  # the shipped order
        for g in draft_opt.param_groups:
            g["lr"] = lr
        total, mtp_ce, kl = draft_losses(model, mtp, batch_at(tokens, rng))
        _step(draft_opt, total, draft_params, (mtp,))
        if step % log_every == 0 or step == steps - 1:
            rec = dict(phase=2, step=step, mtp_ce=round(mtp_ce.item(), 4))
            _log(log, dict(rec, kl=round(kl.item(), 4), lr=lr, seconds=round(time.time() - t0)))


def _write_json(path: str, obj: dict, indent: int = 2, newline: bool = False) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
        if newline:
            f.write("\n")


def main(argv: list[str] | None = None) -> None:
    from transformers import DeepseekV3Config

    args = _parse_args(argv)
    tune_glibc_malloc()
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    os.makedirs(args.out, exist_ok=True)
    tokens, n_train_files = _corpus_tokens(args.out, args.max_files)

    config = DeepseekV3Config(**checkpoint_config())
    model, mtp = build_models(config)
    hooks = [
        m.register_forward_hook(_track_load)
        for mod in (model, mtp)
        for m in mod.modules()
        if m.__class__.__name__ == "TopkRouter"
    ]
    params = list(model.parameters()) + list(mtp.parameters())
    n_params = sum(p.numel() for p in params)
    log: list[dict] = []
    t0 = time.time()
    _train_joint(model, mtp, params, tokens, rng, args.steps, args.log_every, log, t0)
    _train_draft(model, mtp, tokens, rng, args.draft_steps, args.log_every, log, t0)
    for h in hooks:
        h.remove()

    save_checkpoint(model, mtp, config, args.out)
    _write_json(os.path.join(args.out, "config.json"), checkpoint_config(), newline=True)
    generation = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    _write_json(os.path.join(args.out, "generation_config.json"), generation)
    record = dict(seed=SEED, steps=args.steps, draft_steps=args.draft_steps, batch=BATCH)
    record.update(seq_len=SEQ_LEN, lr=LR, params=n_params, train_files=n_train_files)
    record.update(train_tokens=len(tokens), wall_seconds=round(time.time() - t0))
    _write_json(
        os.path.join(args.out, "training_log.json"),
        dict(record, torch=torch.__version__, log=log),
        indent=1,
    )
    print(f"saved {args.out} ({n_params / 1e6:.2f} M parameters)")


if __name__ == "__main__":
    main()
