"""MTP speculative decoding vs none, in-process, side by side in one run (bf16 by default);
and the accept length greedy verification can deliver (`--accept-bound`).

    python benchmark/spec_decode.py [--dtype bfloat16] [--output-len 128] [--ks 1 2 3]
        [--concurrency 1 4 16] [--waves 3] [--verifies expand fia] [--round-graph-pair]
        [--json-out FILE] [--plot FILE.png]
    python benchmark/spec_decode.py --accept-bound [--num-prompts 12] [--output-len 128]

Workload: held-out stdlib snippets (never trained on), greedy, `output-len` tokens each
(ignore_eos). For each concurrency c, requests run in waves of c concurrent requests; the
time per output token (TPOT) of a wave is its wall time / output-len, and the median over
waves is reported. Configurations: speculation off, MTP with expand verify, MTP with FIA
verify, for each K (`--round-graph-pair`: graphs on everywhere, and each MTP configuration
with its whole round as one graph beside per-forward graphs). Also reported: mean accept
length (1 + accepted drafts per verify), and in bf16 how many requests' outputs equal the
speculation-off outputs token for token (batches of different shapes round differently in
bf16; near-ties can flip: reported, not hidden).

`--accept-bound`: the accept length greedy verification can deliver on the text a server
verifies. `mtp_agreement.py` scores the draft teacher-forced over held-out *files* (human-written
tokens); a server verifies drafts against the model's own greedy continuation. This generates
each greedy continuation of the first `--num-prompts` held-out prompts (the prompts of
`serving.py --dataset heldout`) with the engine (float32, speculation off), then teacher-forces
prompt + continuation through the dense main model and the MTP module: from the first decode
step on, the K=1 draft for token t+2 is the MTP top-1 read from (h_t, token t+1), accepted
exactly when it equals the generated token t+2. The expected K=1 accept length is 1 + that
agreement: the figure to hold a server's mean accept length against (same prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from plots import plot_spec_rows

from srt_ascend import Engine
from srt_ascend.managers.tokenizer_manager import load_tokenizer
from srt_ascend.models.loader import load_model
from srt_ascend.server_args import SHIPPED_MODEL
from srt_ascend.tools.corpus import list_files, split


def prompts(n: int) -> list[str]:
    _, held = split(list_files())
    out = []
    for i, f in enumerate(held):
        text = f.read()
        if len(text) > 2000:
            start = (i * 7919) % (len(text) - 1000)
            out.append(text[start : start + 300])
        if len(out) == n:
            break
    return out


def accept_length(outs: list[dict]) -> float:
    """Tokens committed per verify step over the outputs' meta_info (0.0 with MTP off): what
    the HTTP server's `avg_spec_accept_length` reports, for these requests only."""
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / verify if verify else 0.0


def run_config(model_path, dtype, spec: dict, conc: int, ps: list[str], out_len: int):
    engine = Engine(model_path=model_path, dtype=dtype, **spec)
    try:
        params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
        engine.generate(ps[0], {**params, "max_new_tokens": 4})  # warm-up
        tpots, outs = [], []
        for i in range(0, len(ps), conc):
            t0 = time.perf_counter()
            outs += engine.generate(ps[i : i + conc], params)
            tpots.append((time.perf_counter() - t0) / out_len)
        return statistics.median(tpots), accept_length(outs), [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()


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


def accept_bound(model_path: str, num_prompts: int, output_len: int) -> dict:
    tok = load_tokenizer(model_path)
    prompt_ids = [tok.encode(t) for t in prompts(num_prompts)]
    engine = Engine(model_path=model_path, dtype="float32")
    try:
        params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        outs = engine.generate(input_ids=prompt_ids, sampling_params=params)
    finally:
        engine.shutdown()
    model, mtp = load_model(model_path, dtype=torch.float32, load_mtp=True)
    hits = total = 0
    for ids, o in zip(prompt_ids, outs):
        h, n = agreement(model.eval(), mtp.eval(), ids + o["output_ids"], len(ids))
        hits, total = hits + h, total + n
    return {
        "prompts": len(prompt_ids),
        "output_len": output_len,
        "scored_positions": total,
        "agreement_on_greedy_continuations": round(hits / total, 4),
        "expected_accept_length_k1": round(1 + hits / total, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=SHIPPED_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--waves", type=int, default=3, help="waves per concurrency level")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="PNG of TPOT and accept length (matplotlib)")
    p.add_argument("--accept-bound", action="store_true", help="the accept length bound instead")
    p.add_argument("--verifies", nargs="+", default=["expand", "fia"], help="MTP verify paths")
    p.add_argument(
        "--round-graph-pair",
        action="store_true",
        help="graphs on (--enable-cpu-graph, a bucket per concurrency) in every configuration, "
        "and each MTP one twice: the whole round as one graph, and per-forward graphs "
        "(--disable-mtp-round-graph)",
    )
    p.add_argument("--num-prompts", type=int, default=12, help="prompts of --accept-bound")
    a = p.parse_args()
    if a.accept_bound:
        res = accept_bound(a.model_path, a.num_prompts, a.output_len)
        print(json.dumps(res))
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(res, f, indent=1)
        return
    configs = {"off": {}}
    graphs = {}
    if a.round_graph_pair:
        graphs = {"enable_cpu_graph": True, "cuda_graph_bs": tuple(a.concurrency)}
        configs["off"] = graphs
    for k in a.ks:
        for verify in a.verifies:
            spec = {
                "speculative_algorithm": "MTP",
                "speculative_num_steps": k,
                "speculative_verify": verify,
                **graphs,
            }
            if a.round_graph_pair:
                configs[f"{verify}-k{k}-round"] = spec
                configs[f"{verify}-k{k}-per-forward"] = {**spec, "disable_mtp_round_graph": True}
            else:
                configs[f"{verify}-k{k}"] = spec
    rows = []
    for conc in a.concurrency:
        ps = prompts(conc * a.waves)
        base = None
        for name, spec in configs.items():
            tpot, acc, outs = run_config(a.model_path, a.dtype, spec, conc, ps, a.output_len)
            if base is None:
                base = (tpot, outs)
            same = sum(o == b for o, b in zip(outs, base[1]))
            row = dict(
                config=name,
                concurrency=conc,
                tpot_ms=round(tpot * 1e3, 2),
                speedup=round(base[0] / tpot, 3),
                accept_length=round(acc, 3),
                identical_outputs=f"{same}/{len(outs)}",
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(dict(dtype=a.dtype, output_len=a.output_len, rows=rows), f, indent=1)
    if a.plot:
        plot_spec_rows(rows, a.plot, "concurrency", "tpot_ms", "TPOT (dotted: MTP off)")


def print_table(rows) -> None:
    print("\n| concurrency | config | TPOT ms | speed-up vs off | accept length | identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['config']} | {r['tpot_ms']} | {r['speedup']}x | "
            f"{r['accept_length']} | {r['identical_outputs']} |"
        )


if __name__ == "__main__":
    main()
