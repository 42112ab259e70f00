"""How often does the MTP draft agree with the main model? Measured on held-out text.

    python benchmark/mtp_agreement.py [--model-path DIR] [--max-tokens N]
                                      [--dtype float32|bfloat16] [--json-out FILE]

Data: the held-out files of the training corpus (srt_ascend.tools.corpus: CPython stdlib
sources, 1 file in 20 by path hash, never trained on). Each file becomes bos + its tokens, cut
into non-overlapping windows of --window tokens (the last one may be shorter), in path order,
until --max-tokens tokens have been used.

Per window, teacher-forced (every input is the true token):
- the main model runs dense (forward_batch=None): hidden h_t and logits at every position t;
  main perplexity and top-1 accuracy score its prediction of token t+1;
- the MTP module reads (h_t, token t+1) at position t and predicts token t+2. Its top-1 is
  scored against the true token t+2 (accuracy) and against the main model's own greedy
  prediction at position t+1 (agreement: what greedy speculative decoding accepts);
- depth 2 applies the module again (step 1) to (its own output hidden at t, true token t+2)
  at position t+1, predicting token t+3; scored against token t+3 and against the main model's
  greedy prediction at position t+2.
With one draft token (K=1) the expected number of tokens per verify step is 1 + agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import srt_ascend

# The shipped checkpoint, wherever the package lives (the script may run from any directory).
DEFAULT_MODEL = os.path.join(
    os.path.dirname(srt_ascend.__file__), "checkpoints", "deepseek-v3-tiny-mtp"
)


@dataclass
class Counts:
    """Sums over scored positions (each metric has its own count: a window of n tokens scores
    n-1 main positions, n-2 depth-1 positions and n-3 depth-2 positions)."""

    main_n: int = 0
    main_nll: float = 0.0
    main_correct: int = 0
    d1_n: int = 0
    d1_correct: int = 0
    d1_agree: int = 0
    d2_n: int = 0
    d2_correct: int = 0
    d2_agree: int = 0


def held_out_windows(tokenizer, bos: int, window: int, max_tokens: int) -> tuple[list, int]:
    """Non-overlapping windows of bos + file tokens over the held-out files, in path order.
    Returns (windows as lists of ids, number of files read)."""
    from srt_ascend.tools.corpus import list_files, split

    _, held = split(list_files())
    windows, total, n_files = [], 0, 0
    for f in held:
        if total >= max_tokens:
            break
        # bos explicitly; the tokenizer's own post-processor (if any) is not relied on
        ids = [bos] + tokenizer.encode(f.read(), add_special_tokens=False).ids
        n_files += 1
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window][: max_tokens - total]
            if len(chunk) >= 4:  # enough for a depth-2 position
                windows.append(chunk)
                total += len(chunk)
            if total >= max_tokens:
                break
    return windows, n_files


@torch.inference_mode()
def score_batch(model, mtp, windows: list[list[int]], counts: Counts) -> None:
    """Adds one batch of windows (right-padded; causal attention keeps padding invisible to
    the real positions, and padded positions are masked out of every count)."""
    s = max(len(w) for w in windows)
    ids = torch.zeros(len(windows), s, dtype=torch.int64)
    for b, w in enumerate(windows):
        ids[b, : len(w)] = torch.tensor(w)
    lens = torch.tensor([len(w) for w in windows])[:, None]  # [B, 1]
    col = torch.arange(s)[None, :]  # [1, S]

    hidden = model(ids, torch.arange(s))  # [B, S, d]
    logits = model.compute_logits(hidden)  # [B, S, V]: position t predicts token t+1
    greedy = logits.argmax(-1)  # [B, S]
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    valid = col[:, : s - 1] < lens - 1  # positions t with a token t+1
    counts.main_n += int(valid.sum())
    counts.main_nll += float(nll[valid].double().sum())
    counts.main_correct += int(((greedy[:, :-1] == ids[:, 1:]) & valid).sum())

    # Depth 1: MTP at t reads (h_t, token t+1) -> predicts token t+2.
    out1 = mtp(ids[:, 1:], hidden[:, :-1], torch.arange(s - 1), step=0)  # [B, S-1, d]
    draft1 = mtp.compute_logits(out1).argmax(-1)[:, : s - 2]  # t = 0 .. S-3
    valid = col[:, : s - 2] < lens - 2
    counts.d1_n += int(valid.sum())
    counts.d1_correct += int(((draft1 == ids[:, 2:]) & valid).sum())
    counts.d1_agree += int(((draft1 == greedy[:, 1:-1]) & valid).sum())

    # Depth 2: the module again at t+1 on (its output hidden at t, token t+2) -> token t+3.
    out2 = mtp(ids[:, 2:], out1[:, :-1], torch.arange(1, s - 1), step=1)  # [B, S-2, d]
    draft2 = mtp.compute_logits(out2).argmax(-1)[:, : s - 3]  # t = 0 .. S-4
    valid = col[:, : s - 3] < lens - 3
    counts.d2_n += int(valid.sum())
    counts.d2_correct += int(((draft2 == ids[:, 3:]) & valid).sum())
    counts.d2_agree += int(((draft2 == greedy[:, 2:-1]) & valid).sum())


def summarize(c: Counts) -> dict:
    agreement = c.d1_agree / max(c.d1_n, 1)
    return {
        "main_perplexity": float(torch.tensor(c.main_nll / max(c.main_n, 1)).exp()),
        "main_top1_accuracy": c.main_correct / max(c.main_n, 1),
        "mtp_top1_accuracy": c.d1_correct / max(c.d1_n, 1),
        "agreement": agreement,
        "depth2_top1_accuracy": c.d2_correct / max(c.d2_n, 1),
        "depth2_agreement": c.d2_agree / max(c.d2_n, 1),
        "expected_accept_length_k1": 1.0 + agreement,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=200_000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="windows per forward")
    p.add_argument("--json-out", default=None, help="also write the JSON result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from tokenizers import Tokenizer

    from srt_ascend.models.loader import load_model

    args = parse_args(argv)
    t0 = time.time()
    model, mtp = load_model(args.model_path, dtype=getattr(torch, args.dtype), load_mtp=True)
    model.eval()
    mtp.eval()
    tokenizer = Tokenizer.from_file(os.path.join(args.model_path, "tokenizer.json"))
    bos = tokenizer.token_to_id("<|bos|>")
    if bos is None:
        bos = model.config.bos_token_id
    windows, n_files = held_out_windows(tokenizer, bos, args.window, args.max_tokens)
    if not windows:
        raise SystemExit("no held-out windows (is --max-tokens at least 4?)")
    counts = Counts()
    for i in range(0, len(windows), args.batch):
        score_batch(model, mtp, windows[i : i + args.batch], counts)
        print(
            f"\r{min(i + args.batch, len(windows))}/{len(windows)} windows",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)

    result = {
        "model_path": args.model_path,
        "dtype": args.dtype,
        "held_out_files": n_files,
        "windows": len(windows),
        "tokens": sum(len(w) for w in windows),
        "window": args.window,
        **summarize(counts),
        "counts": asdict(counts),
        "seconds": round(time.time() - t0, 1),
    }
    rows = [
        ("main model", "next token t+1", result["main_top1_accuracy"], None),
        ("MTP depth 1", "token t+2", result["mtp_top1_accuracy"], result["agreement"]),
        ("MTP depth 2", "token t+3", result["depth2_top1_accuracy"], result["depth2_agreement"]),
    ]
    print(
        f"{result['tokens']} held-out tokens, {result['windows']} windows of <= {args.window} "
        f"from {n_files} files, {args.dtype}; main perplexity {result['main_perplexity']:.3f}"
    )
    print(f"{'predictor':<12} {'target':<15} {'top-1 acc':>9} {'agrees w/ main greedy':>22}")
    for name, target, acc, agree in rows:
        agree_s = "-" if agree is None else f"{agree:.4f}"
        print(f"{name:<12} {target:<15} {acc:>9.4f} {agree_s:>22}")
    print(f"expected accept length, K=1: {result['expected_accept_length_k1']:.4f}")
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
