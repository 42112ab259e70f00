"""The accept length greedy verification can deliver, on the text a server actually verifies.

    python benchmark/accept_bound.py [--num-prompts 12] [--output-len 128] [--json-out FILE]

`mtp_agreement.py` measures the draft teacher-forced over held-out *files*: human-written
tokens. A server verifies drafts against the model's own greedy continuation instead. This
script takes the held-out prompts of `serving.py --dataset heldout`, generates each greedy
continuation with the engine (float32, speculation off), then teacher-forces prompt +
continuation through the dense main model and the MTP module. From the first decode step on,
the K=1 draft for token t+2 is the MTP top-1 read from (h_t, token t+1); greedy verification
accepts it exactly when it equals the generated token t+2. The expected K=1 accept length is
1 + that agreement: the figure to hold the server's mean accept length against (same prompts).
"""

from __future__ import annotations

import argparse
import json

import torch
from spec_decode import prompts as heldout_prompts

from srt_ascend import Engine
from srt_ascend.managers.tokenizer_manager import load_tokenizer
from srt_ascend.models.loader import load_model
from srt_ascend.server_args import SHIPPED_MODEL


@torch.inference_mode()
def agreement(model, mtp, ids: list[int], prompt_len: int) -> tuple[int, int]:
    """(agreeing positions, scored positions) over the decode steps of one sequence."""
    x = torch.tensor([ids])
    s = len(ids)
    hidden = model(x, torch.arange(s))  # [1, S, d]
    out = mtp(x[:, 1:], hidden[:, :-1], torch.arange(s - 1), step=0)  # position t -> t+2
    draft = mtp.compute_logits(out).argmax(-1)[0, : s - 2]  # t = 0 .. S-3
    first = prompt_len - 1  # the first draft: after prefill, predicting output token 2
    hits = draft[first:] == x[0, first + 2 :]
    return int(hits.sum()), int(hits.numel())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    tok = load_tokenizer(a.model_path)
    prompt_ids = [tok.encode(t) for t in heldout_prompts(a.num_prompts)]
    engine = Engine(model_path=a.model_path, dtype="float32")
    try:
        params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
        outs = engine.generate(input_ids=prompt_ids, sampling_params=params)
    finally:
        engine.shutdown()
    model, mtp = load_model(a.model_path, dtype=torch.float32, load_mtp=True)
    hits = total = 0
    for ids, o in zip(prompt_ids, outs):
        h, n = agreement(model.eval(), mtp.eval(), ids + o["output_ids"], len(ids))
        hits, total = hits + h, total + n
    res = {
        "prompts": len(prompt_ids),
        "output_len": a.output_len,
        "scored_positions": total,
        "agreement_on_greedy_continuations": round(hits / total, 4),
        "expected_accept_length_k1": round(1 + hits / total, 3),
    }
    print(json.dumps(res))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
