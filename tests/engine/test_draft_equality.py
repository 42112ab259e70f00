"""The runtime's drafts are the MTP module's drafts, whatever the cache did.

Greedy verification hides a wrong draft (it only costs speed), so the lossless tests pass with
garbage drafts. Here every draft chain the engine runs is recorded with the committed tokens
it started from, and recomputed densely: the main model over the committed tokens (no KV
cache), then the MTP module over (h_p, t_{p+1}) and, for each further step, over its own
output and draft appended. Engines run with radix hits, chunked prefill, page sizes 1 and 16,
retraction under a small KV pool, both verify layouts and K = 1..3.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from srt_ascend import Engine
from srt_ascend.models.loader import load_model
from srt_ascend.speculative.draft_length import FixedDraftLength
from srt_ascend.speculative.mtp_decoder import MTPDecoder
from srt_ascend.speculative.mtp_round_graph import MTPRoundGraphs
from srt_ascend.speculative.mtp_worker import MTPWorker, Starts

BASE = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
PROMPTS = [BASE, BASE + "description='x')\n", "class Stack:\n    def push", BASE + "prog=", "# a"]
GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}
NEAR_TIE = 1e-4  # a dense top-2 gap this small may order differently through paged attention

CONFIGS = {
    "K3-expand-chunked": dict(
        speculative_num_steps=3, speculative_verify="expand", chunked_prefill_size=16
    ),
    "K2-fia-page16": dict(speculative_num_steps=2, speculative_verify="fia", page_size=16),
    "K1-expand-retract": dict(
        speculative_num_steps=1,
        speculative_verify="expand",
        max_total_tokens=160,
        chunked_prefill_size=32,
    ),
}


def dense_drafts(path: str):
    """drafts(ids, starts, k) -> for each start s, (argmax, top-2 gap) of d_1..d_k recomputed
    densely from the committed ids[: s + 1]: the main model over them, then MTP step j (its
    layer, `layer_for_step`) over the tokens after each position with the main model's
    hidden, extended by the chain so far (the output that drafted each draft, and the draft).
    Attention is causal, so one forward over all of `ids` gives every prefix's main hidden
    and first MTP output; each later step runs the chains as one batch, every row
    right-padded (what follows a row's end cannot reach it)."""
    model, mtp = load_model(path, dtype=torch.float32, load_mtp=True)
    model.eval()
    mtp.eval()

    def top2(o: torch.Tensor) -> tuple[int, float]:
        top = mtp.compute_logits(o).topk(2)
        return int(top.indices[0]), float(top.values[0] - top.values[1])

    @torch.inference_mode()
    def drafts(ids: list[int], starts: list[int], k: int) -> list[list[tuple[int, float]]]:
        n = len(ids)
        h = model(torch.tensor([ids]), torch.arange(n))[0]  # [n, D]
        first = mtp(torch.tensor([ids[1:]]), h[None, :-1], torch.arange(n - 1), step=0)[0]
        chains = [[(first[s - 1], top2(first[s - 1]))] for s in starts]  # (output, draft)
        for step in range(1, k):
            width = max(starts) + step
            tokens = torch.zeros(len(starts), width, dtype=torch.long)
            hidden = h.new_zeros(len(starts), width, h.shape[-1])
            for i, s in enumerate(starts):
                drafted = [d for _, (d, _) in chains[i]]
                tokens[i, : s + step] = torch.tensor(ids[1 : s + 1] + drafted)
                hidden[i, :s] = h[:s]
                hidden[i, s : s + step] = torch.stack([o for o, _ in chains[i]])
            out = mtp(tokens, hidden, torch.arange(width), step=step)  # [chains, width, D]
            for i, s in enumerate(starts):
                o = out[i, s + step - 1]
                chains[i].append((o, top2(o)))
        return [[d for _, d in chain] for chain in chains]

    return drafts


@pytest.fixture(scope="module")
def dense(model_path):
    return dense_drafts(model_path)


@pytest.fixture(scope="module")
def three_layer_path(model_path, tmp_path_factory) -> str:
    """The shipped checkpoint with two more MTP layers (ids 5 and 6): copies of its one with
    every weight scaled elementwise by a seeded factor in [0.5, 1.5], so each layer drafts
    differently."""
    out = tmp_path_factory.mktemp("three_mtp_layers")
    for name in os.listdir(model_path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_path, name), out / name)
    config = json.loads((out / "config.json").read_text())
    first = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = 3
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(os.path.join(model_path, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    prefix = f"model.layers.{first}."
    for i in (1, 2):
        for key in sorted(k for k in tensors if k.startswith(prefix)):
            w = tensors[key]
            if "embed_tokens" not in key and "shared_head.head" not in key:
                w = (w.float() * (0.5 + torch.rand(w.shape, generator=gen))).to(w.dtype)
            tensors[f"model.layers.{first + i}." + key[len(prefix) :]] = w.clone()
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def _record(monkeypatch) -> list[tuple[Any, int, list[int]]]:
    """Every draft chain the engine runs: the request, the position L-1 it starts at (an
    overlapped round's on the device: its committed tokens are known only later) and its
    drafts. `_check` takes the tokens 0..L-1 once the engine is done."""
    records: list[tuple[Any, int, list[int]]] = []
    chain = MTPWorker.draft_chain

    def recorded(self, reqs, loc, first=None, starts=None, rows=None, generated=None, limits=None):
        out = chain(self, reqs, loc, first, starts, rows, generated, limits)
        if isinstance(starts, Starts):
            begin = starts.device.tolist()
        else:
            begin = [r.seq_len - 1 for r in reqs] if starts is None else list(starts)
        drafts = out.tokens.tolist()
        if limits is not None:  # the drafts past k_r are placeholders, never examined
            drafts = [d[: max(1, n)] for d, n in zip(drafts, limits)]
        records.extend(zip(reqs, begin, drafts))
        return out

    monkeypatch.setattr(MTPWorker, "draft_chain", recorded)
    # chains drafted inside a whole-round graph (speculative/mtp_round_graph) too
    run, graph_round = MTPRoundGraphs.run, MTPDecoder._graph_round

    def recorded_run(self, k, rows, starts, *rest):
        out = run(self, k, rows, starts, *rest)
        self.recorded = (starts.tolist(), out.drafts.tolist())
        return out

    def recorded_round(self, reqs, *rest):
        out = graph_round(self, reqs, *rest)
        records.extend(zip(reqs, *self.rounds.recorded))
        return out

    monkeypatch.setattr(MTPRoundGraphs, "run", recorded_run)
    monkeypatch.setattr(MTPDecoder, "_graph_round", recorded_round)
    return records


def _check(name: str, dense, records, k: int) -> None:
    """Every recorded chain against the dense drafts from its request's committed tokens."""
    by_request: dict[int, tuple[Any, list]] = {}
    for r, s, d in records:
        # a round launched after its request's last one (overlap: dropped) may start past it
        if s < len(r.all_ids):
            by_request.setdefault(id(r), (r, []))[1].append((s, d))
    assert sum(len(chains) for _, chains in by_request.values()) > 20
    for r, chains in by_request.values():
        wants = dense(list(r.all_ids), [s for s, _ in chains], k)
        for (s, got), want in zip(chains, wants):
            for j, (d, (ref, gap)) in enumerate(zip(got, want)):
                if gap < NEAR_TIE:
                    break  # later drafts follow a different (equally valid) token
                assert d == ref, f"{name}: draft {j + 1} after {s + 1} tokens: {d} != dense {ref}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_drafts_equal_dense_mtp(model_path, dense, monkeypatch, name):
    records = _record(monkeypatch)
    engine = Engine(
        model_path=model_path,
        dtype="float32",
        speculative_algorithm="MTP",
        enable_overlap_schedule=True,  # overlapped chains too (eager CPU: serial by default)
        **CONFIGS[name],
    )
    try:
        engine.generate(PROMPTS[:2], GREEDY)  # warm the radix cache
        engine.generate([p + tail for tail in ("", " x", " y", "\n") for p in PROMPTS], GREEDY)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    if "retract" in name:
        assert state["num_retractions"] > 0, "the small pool did not retract"
    _check(name, dense, records, CONFIGS[name]["speculative_num_steps"])


ADAPTIVE_K2 = {
    "dtype": "float32",
    "speculative_algorithm": "MTP",
    "speculative_num_steps": 2,
    "speculative_adaptive": True,
}


class DeferringPrefills(FixedDraftLength):
    """K = max_k at every step; prefills defer their MTP pass while `defer` is set (what
    adaptive K does when it expects the next steps to run K = 0)."""

    def __init__(self, max_k: int) -> None:
        super().__init__(max_k, [1])
        self.defer = True

    def prefers_plain(self, batch: int) -> bool:
        return self.defer


def test_prompt_only_prefill_that_defers_leaves_mtp_kv(model_path, dense, monkeypatch):
    """Prompt-only requests (max_new_tokens 0, what `n > 1` sends first to cache the prompt)
    whose prefill defers its MTP pass still write the MTP KV of every cached position:
    requests that then reuse the cached prompts draft what the dense module drafts."""
    records = _record(monkeypatch)
    engine = Engine(model_path=model_path, **ADAPTIVE_K2)
    try:
        policy = DeferringPrefills(2)
        engine.tokenizer_manager.scheduler.decoder.draft_length = policy
        engine.generate(PROMPTS, {**GREEDY, "max_new_tokens": 0})
        policy.defer = False
        engine.generate([p + tail for tail in ("", " x", "\n") for p in PROMPTS], GREEDY)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert state["cached_tokens_in_tree"] > 0
    _check("prompt-only", dense, records, 2)


class WalkingDraftLength(FixedDraftLength):
    """Adaptive K scripted: each round runs the next K of `walk`, over and over."""

    def __init__(self, max_k: int, walk) -> None:
        super().__init__(max_k, [1])
        self.walk, self.at = tuple(walk), 0

    def peek(self, estimates):
        return self.walk[self.at % len(self.walk)]

    def advance(self, batch):
        self.at += 1


def test_drafts_after_overlapped_plain_rounds_equal_dense_mtp(model_path, dense, monkeypatch):
    """Adaptive K under overlap, scripted through runs of K = 0 rounds: their MTP passes,
    deferred at each overlapped round's finish (a request that finishes there runs them
    then, for the prefix cache that requests continuing its output hit) and caught up by the
    next round with drafts, leave the MTP KV and d_1 the dense module gives."""
    records = _record(monkeypatch)
    engine = Engine(
        model_path=model_path,
        **ADAPTIVE_K2,
        cuda_graph_bs=(1, 16),
        enable_overlap_schedule=True,  # eager forwards on CPU: serial unless forced
    )
    try:
        decoder = engine.tokenizer_manager.scheduler.decoder
        decoder.draft_length = WalkingDraftLength(2, (0,))  # finished in K = 0 rounds
        tm = engine.tokenizer_manager
        first = [tm.tokenize(p) for p in PROMPTS[:2]]
        outs = engine.generate(input_ids=first, sampling_params=GREEDY)
        decoder.draft_length = WalkingDraftLength(2, (0, 0, 2, 1, 0, 2, 2, 0, 0, 0, 1))
        # the first requests' outputs from the prefix cache: their MTP KV from the passes
        # run when they finished
        again = [ids + o["output_ids"] + [13] for ids, o in zip(first, outs)]
        engine.generate(input_ids=again, sampling_params=GREEDY)
        engine.generate([p + tail for tail in ("", " x") for p in PROMPTS], GREEDY)
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert state["num_overlapped_steps"] > 0
    assert state["spec_draft_length_steps"]["0"] > 0
    _check("adaptive overlapped", dense, records, 2)


def test_multi_layer_checkpoint_drafts_equal_dense_mtp(three_layer_path, monkeypatch):
    """A checkpoint with three MTP layers: draft step j runs layer j, whose attention reads
    its own KV layer, written over committed positions by every MTP pass (prefill, after each
    verify) and over the chain's positions by the step that starts the layer. Drafts equal the
    dense module's, with radix hits and chunked prefill, both verify layouts, eagerly,
    through the per-forward graphs (the later layers' kinds replayed) and through the
    whole-round graph."""
    records = _record(monkeypatch)
    graphs = {"enable_cpu_graph": True, "cuda_graph_bs": (1, 2, 4, 8), "context_length": 512}
    per_forward = {**graphs, "disable_mtp_round_graph": True}
    runs = (("expand", {}), ("fia", per_forward), ("expand", graphs))
    for verify, extra in runs:
        engine = Engine(
            model_path=three_layer_path,
            dtype="float32",
            speculative_algorithm="MTP",
            speculative_num_steps=3,
            speculative_verify=verify,
            chunked_prefill_size=16,
            enable_overlap_schedule=True,
            **extra,
        )
        try:
            engine.generate(PROMPTS[:2], GREEDY)
            engine.generate([p + tail for tail in ("", " x") for p in PROMPTS], GREEDY)
            state = engine.get_internal_state()
        finally:
            engine.shutdown()
        replayed = {kind for kind, n in state["graph_replays"].items() if n > 0}
        if extra is per_forward:
            assert {"draft_step1", "draft_chain2_l2", "draft_extend_l1"} <= replayed, replayed
        elif extra:  # the whole round as one graph: its chains run every layer's step
            assert "mtp_round_k3" in replayed and "draft_step1" not in replayed, replayed
    _check("three MTP layers", dense_drafts(three_layer_path), records, 3)
