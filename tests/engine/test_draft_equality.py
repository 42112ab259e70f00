"""The runtime's drafts are the MTP module's drafts, whatever the cache did.

Greedy verification hides a wrong draft (it only costs speed), so the lossless tests pass with
garbage drafts. Here every draft chain the engine runs is recorded with the committed tokens
it started from, and recomputed densely: the main model over the committed tokens (no KV
cache), then the MTP module over (h_p, t_{p+1}) and, for each further step, over its own
output and draft appended. Engines run with radix hits, chunked prefill, page sizes 1 and 16,
retraction under a small KV pool, both verify layouts and K = 1..3.
"""

from __future__ import annotations

import pytest
import torch

from srt_ascend import Engine
from srt_ascend.models.loader import load_model
from srt_ascend.speculative.draft_length import FixedDraftLength
from srt_ascend.speculative.mtp_worker import MTPWorker

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


@pytest.fixture(scope="module")
def dense(model_path):
    model, mtp = load_model(model_path, dtype=torch.float32, load_mtp=True)
    model.eval()
    mtp.eval()
    assert mtp.num_layers == 1, "the chain below re-applies one layer"

    @torch.inference_mode()
    def drafts(ids: list[int], k: int) -> list[tuple[int, float]]:
        """(argmax, top-2 gap) of d_1..d_k recomputed densely from committed ids."""
        x = torch.tensor([ids])
        h = model(x, torch.arange(len(ids)))[0]  # [L, D]
        tokens, hidden = list(ids[1:]), list(h[:-1])
        out = []
        for step in range(k):
            n = len(tokens)
            o = mtp(torch.tensor([tokens]), torch.stack(hidden)[None], torch.arange(n), step=step)
            logits = mtp.compute_logits(o[0, -1])
            top = logits.topk(2)
            d = int(top.indices[0])
            out.append((d, float(top.values[0] - top.values[1])))
            tokens.append(d)
            hidden.append(o[0, -1])
        return out

    return drafts


def _record(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Every draft chain the engine runs, with the committed tokens it started from."""
    records: list[tuple[list[int], list[int]]] = []
    chain = MTPWorker.draft_chain

    def recorded(self, reqs, loc):
        out = chain(self, reqs, loc)
        for r, d in zip(reqs, out.tokens.tolist()):
            records.append((list(r.all_ids), d))
        return out

    monkeypatch.setattr(MTPWorker, "draft_chain", recorded)
    return records


def _check(name: str, dense, records, k: int) -> None:
    assert len(records) > 20
    for ids, got in records:
        want = dense(ids, k)
        for j, (d, (ref, gap)) in enumerate(zip(got, want)):
            if gap < NEAR_TIE:
                break  # later drafts follow a different (equally valid) token
            assert d == ref, f"{name}: draft {j + 1} after {len(ids)} tokens: {d} != dense {ref}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_drafts_equal_dense_mtp(model_path, dense, monkeypatch, name):
    records = _record(monkeypatch)
    engine = Engine(
        model_path=model_path, dtype="float32", speculative_algorithm="MTP", **CONFIGS[name]
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
    engine = Engine(
        model_path=model_path,
        dtype="float32",
        speculative_algorithm="MTP",
        speculative_num_steps=2,
        speculative_adaptive=True,
    )
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
