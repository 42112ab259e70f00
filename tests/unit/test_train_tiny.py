"""The shipped-model trainer (smoke run) and its corpus split."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from srt_ascend.models.loader import load_model
from srt_ascend.tools import corpus, train_tiny


def test_train_tiny_smoke_run_loads_back(tmp_path):
    out = str(tmp_path / "ckpt")
    train_tiny.main(["--out", out, "--steps", "2", "--draft-steps", "1", "--max-files", "5"])
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_log.json",
    } <= set(os.listdir(out))
    with open(os.path.join(out, "training_log.json")) as f:
        log = json.load(f)
    assert log["steps"] == 2 and log["draft_steps"] == 1 and log["train_files"] == 5
    assert [r["phase"] for r in log["log"]] == [1, 1, 2]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == train_tiny.checkpoint_config()  # DeepSeek-V3's keys

    model, mtp = load_model(out, dtype=torch.float32, load_mtp=True)
    assert model.config.vocab_size == train_tiny.VOCAB_SIZE and mtp.num_layers == 1

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert [tok.token_to_id(t) for t in train_tiny.SPECIAL_TOKENS] == [0, 1, 2]
    text = 'def f(x):\n    return {"héllo": x ** 2}  # ünïcode ✓\n'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert 0 not in ids and tok.decode(ids) == text
    assert tok.decode(tok.encode(text).ids) == text  # special tokens dropped on decode
    assert max(ids) < model.config.vocab_size

    ids_t = torch.tensor([[0] + ids[:15]])
    with torch.no_grad():
        h = model(ids_t, torch.arange(ids_t.shape[1]))
        logits = model.compute_logits(h)
        draft = mtp.compute_logits(mtp(ids_t[:, 1:], h[:, :-1], torch.arange(ids_t.shape[1] - 1)))
    assert torch.isfinite(logits).all() and torch.isfinite(draft).all()
    # Two steps from a 0.02-std init: still close to uniform over the vocabulary.
    assert abs(torch.logsumexp(logits, -1).mean() - torch.log(torch.tensor(8192.0))) < 1.0

    # The agreement benchmark runs on the output (ragged last window, padded batches).
    json_out = str(tmp_path / "agreement.json")
    bench = load_benchmark()
    result = bench.main(
        [
            "--model-path",
            out,
            "--max-tokens",
            "700",
            "--window",
            "100",
            "--batch",
            "3",
            "--json-out",
            json_out,
        ]
    )
    with open(json_out) as f:
        assert json.load(f) == result
    n, w, c = result["tokens"], result["windows"], result["counts"]
    assert n == 700 and w >= 7
    assert (c["main_n"], c["d1_n"], c["d2_n"]) == (n - w, n - 2 * w, n - 3 * w)
    assert result["expected_accept_length_k1"] == 1 + result["agreement"]
    assert 1000 < result["main_perplexity"] < 2 * 8192


def test_held_out_depends_only_on_relpath():
    a = corpus.CorpusFile("json/decoder.py", "/somewhere/json/decoder.py")
    b = corpus.CorpusFile("json/decoder.py", "/elsewhere/lib/python3.11/json/decoder.py")
    assert a.held_out == b.held_out
    for rel in ["os.py", "json/decoder.py", "asyncio/base_events.py", "x/y/z.py"]:
        digest = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        assert corpus.CorpusFile(rel, "/any/" + rel).held_out == (digest % 20 == 0)


def test_stdlib_split_is_deterministic_and_about_five_percent():
    files = corpus.list_files()
    assert files == corpus.list_files()
    assert len(files) > 500
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    train, held = corpus.split(files)
    assert len(train) + len(held) == len(files)
    assert not {f.relpath for f in train} & {f.relpath for f in held}
    assert 0.03 < len(held) / len(files) < 0.07
    assert all(f.held_out for f in held) and not any(f.held_out for f in train)
    for f in files:
        parts = f.relpath.split(os.sep)
        assert "site-packages" not in parts and "dist-packages" not in parts
        assert f.path.endswith(".py") and os.path.isfile(f.path)


def test_list_files_skips_site_packages(tmp_path):
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/readme.txt",
        "site-packages/numpy/c.py",
        "dist-packages/d.py",
        "pkg/__pycache__/b.cpython-311.py",
    ]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n")
    rels = [f.relpath for f in corpus.list_files(str(tmp_path))]
    assert rels == ["a.py", os.path.join("pkg", "b.py")]


def load_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmark" / "mtp_agreement.py"
    spec = importlib.util.spec_from_file_location("mtp_agreement", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


VOCAB = 16


class NextIdModel(torch.nn.Module):
    """Main model stand-in: hidden at t is one-hot(token t); it predicts token t + 1."""

    def forward(self, ids, positions, forward_batch=None):
        return F.one_hot(ids, VOCAB).float()

    def compute_logits(self, hidden):
        return hidden.roll(1, dims=-1)  # one-hot(id + 1)


class DraftFromToken(NextIdModel):
    """MTP stand-in reading token t+1: predicts token t+1 + 1, i.e. the main model's own
    greedy prediction at t+1 (full agreement, whatever the text)."""

    def forward(self, next_ids, hidden, positions, forward_batch=None, step=0):
        assert positions.shape[0] == next_ids.shape[1]
        assert int(positions[0]) == step  # step 1 runs at positions 1 ..
        return F.one_hot(next_ids, VOCAB).float()


class DraftFromHidden(DraftFromToken):
    """MTP stand-in that ignores token t+1 and repeats the main prediction from h_t."""

    def forward(self, next_ids, hidden, positions, forward_batch=None, step=0):
        return hidden


def test_agreement_counts_align_positions():
    """score_batch against stand-ins whose right answers are known, over a padded batch of
    windows of 9, 5 and 12 tokens."""
    bench = load_benchmark()
    gen = torch.Generator().manual_seed(0)
    lens = [9, 5, 12]
    by_one = [[(i + k) % VOCAB for i in range(n)] for k, n in enumerate(lens)]
    by_three = [[(3 * i + k) % VOCAB for i in range(n)] for k, n in enumerate(lens)]
    random = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]
    for windows, acc in [(by_one, 1.0), (by_three, 0.0), (random, None)]:
        c = bench.Counts()
        bench.score_batch(NextIdModel(), DraftFromToken(), windows, c)
        assert (c.main_n, c.d1_n, c.d2_n) == (sum(lens) - 3, sum(lens) - 6, sum(lens) - 9)
        r = bench.summarize(c)
        assert r["agreement"] == r["depth2_agreement"] == 1.0
        assert r["expected_accept_length_k1"] == 2.0
        if acc is not None:
            assert r["main_top1_accuracy"] == r["mtp_top1_accuracy"] == acc
            assert r["depth2_top1_accuracy"] == acc
    c = bench.Counts()
    bench.score_batch(NextIdModel(), DraftFromHidden(), by_one, c)
    assert c.d1_agree == 0 and c.d2_agree == 0  # h_t alone predicts t+1, never t+2 here
    c = bench.Counts()
    bench.score_batch(NextIdModel(), DraftFromHidden(), [[5] * 10], c)
    assert c.d1_agree == c.d1_n == 8 and c.d2_agree == c.d2_n == 7
    assert c.main_correct == 0
    assert abs(c.main_nll / c.main_n - math.log(math.e + VOCAB - 1)) < 1e-5
