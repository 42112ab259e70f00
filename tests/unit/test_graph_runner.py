"""The graph runner on CPU (eager replay over static buffers): bucket choice, the FIA padding
rules of DESIGN section 8, replay == eager for every captured kind, and padded rows that never
change real rows or real KV."""

from __future__ import annotations

import random

import pytest
import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.layers.attention.fia_reference import MAX_QUERY_TOKENS_PER_REQ, to_cumulative
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.model_executor.graph_runner import (
    MIN_KV_WINDOW,
    fia_padded_query_lens,
    fia_spare_slots,
    graph_buckets,
    kv_windows,
)
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.server_args import ServerArgs
from srt_ascend.speculative.mtp_decoder import MTPDecoder

# ---- pure rules ----------------------------------------------------------------------------


def test_buckets_default_custom_and_capped():
    assert graph_buckets(None, 32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert graph_buckets(None, 80) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80]
    assert graph_buckets(None, 10) == [1, 2, 4, 8, 10]
    assert graph_buckets([3, 1, 7, 50], 8) == [1, 3, 7]
    assert graph_buckets([50], 8) == [8]


def test_fia_full_batch_pads_with_one_plus_k_per_request():
    k1, bucket = 3, 4
    slots = bucket + fia_spare_slots(bucket, k1 - 1)
    lens = fia_padded_query_lens([3, 3], slots, bucket * k1, k1)
    assert to_cumulative(lens)[:bucket] == [3, 6, 9, 12]  # [1+K, 2(1+K), ..., bucket(1+K)]
    assert to_cumulative(lens)[-1] == 12 and lens[bucket:] == [0] * (slots - bucket)


def test_fia_mixed_batch_gives_spare_slots_the_left_over_tokens():
    # Requests just arrived from a prefill have 1 token; the graph holds bucket(1+K) tokens.
    k1, bucket = 16, 4  # K = 15: the worst case for the 16-token limit
    slots = bucket + fia_spare_slots(bucket, k1 - 1)
    assert slots == 8
    lens = fia_padded_query_lens([1, 1, 1, 1], slots, bucket * k1, k1)
    assert lens == [1, 1, 1, 1, 16, 16, 16, 12]
    assert fia_padded_query_lens([1, 3, 1], 5, 12, 3) == [1, 3, 1, 3, 4]


def test_fia_padding_rule_holds_for_random_mixes():
    rng = random.Random(0)
    for _ in range(500):
        k1 = rng.randint(2, MAX_QUERY_TOKENS_PER_REQ)
        bucket = rng.randint(1, 33)
        real = [rng.choice([1, k1]) for _ in range(rng.randint(1, bucket))]
        slots = bucket + fia_spare_slots(bucket, k1 - 1)
        lens = fia_padded_query_lens(real, slots, bucket * k1, k1)
        assert lens[: len(real)] == real
        assert len(lens) == slots and sum(lens) == bucket * k1
        assert all(0 <= q <= MAX_QUERY_TOKENS_PER_REQ for q in lens)


def test_kv_windows_double_up_to_the_full_width():
    assert kv_windows(4096 + 17) == [64, 128, 256, 512, 1024, 2048, 4113]
    assert kv_windows(529) == [64, 128, 256, 529]
    assert kv_windows(127) == [127]  # no window nearly repeats the full width
    assert kv_windows(4113, smallest=4113) == [4113]  # one window: the full context


@pytest.mark.parametrize(
    ("q_lens", "slots", "total", "message"),
    [
        ([17], 2, 32, "query lengths"),
        ([3, 3, 3], 2, 6, "exceed"),
        ([1], 1, 3, "do not fit"),
    ],
)
def test_fia_padding_rejects_what_cannot_fit(q_lens, slots, total, message):
    with pytest.raises(ValueError, match=message):
        fia_padded_query_lens(q_lens, slots, total, 3)


# ---- the runner over a real (tiny, random) checkpoint ----------------------------------------

K = 3


def make_runner(
    path: str,
    verify: str,
    page_size: int = 1,
    smallest_kv_window: int = MIN_KV_WINDOW,
    platform=None,
    **args_overrides,
) -> ModelRunner:
    """A runner with the graphs the MTP decoder captures (the decoder's kinds are reachable
    as `runner.kinds`), on `platform` (default: the CPU one), ServerArgs overridden by
    `args_overrides`. Its req_to_token rows are 48 + 17 wide: with the default smallest KV
    window (64) every kind has one window."""
    args = ServerArgs(
        model_path=path,
        dtype="float32",
        context_length=48,
        max_running_requests=8,
        max_total_tokens=1024,
        page_size=page_size,
        speculative_algorithm="MTP",
        speculative_num_steps=K,
        speculative_verify=verify,
        enable_cpu_graph=True,
        cuda_graph_bs=(2, 4),
        **args_overrides,
    )
    runner = ModelRunner(args, platform or get_platform("cpu"))
    decoder = MTPDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
    runner.capture_graphs(decoder.graph_kinds(), smallest_kv_window)
    runner.kinds = {kind.name: kind for kind in decoder.graph_kinds()}
    return runner


class Requests:
    """Three requests with prompts of different lengths, prefilled eagerly (main model and
    MTP layers), each owning its own pages for `cap` positions. Without `prefill`, the
    prompts' KV is random latents instead (replay == eager holds for any KV)."""

    def __init__(
        self, runner: ModelRunner, lens=(5, 11, 8), cap: int = 32, seed: int = 0, prefill=True
    ):
        g = torch.Generator().manual_seed(seed)
        self.runner, self.lens, self.gen = runner, list(lens), g
        self.rows = runner.req_to_token_pool.alloc(len(lens))
        self.slots = []
        for row in self.rows:
            slots = runner.allocator.alloc(cap)
            runner.req_to_token_pool.req_to_token[row, :cap] = slots
            self.slots.append(slots)
        ids = torch.randint(3, runner.vocab_size, (sum(lens),), generator=g)
        loc = torch.cat([s[:n] for s, n in zip(self.slots, lens)])
        if not prefill:
            pool = runner.kv_pool
            for layer in range(runner.num_layers):
                c_kv = torch.randn(len(loc), pool.kv_lora_rank, generator=g)
                k_pe = torch.randn(len(loc), pool.qk_rope_head_dim, generator=g)
                pool.set_mla_kv_buffer(layer, loc, c_kv, k_pe)
            return
        fb = runner.build_forward_batch(ForwardMode.EXTEND, ids, self.rows, lens, lens, loc)
        hidden = runner.forward(fb)
        fb = runner.build_forward_batch(ForwardMode.DRAFT_EXTEND, ids, self.rows, lens, lens, loc)
        runner.forward_mtp(fb, hidden, 0)

    def batch(self, kind: str, q_lens=None):
        """The ForwardBatch a kind replays, for the requests' next positions."""
        r, n = self.runner, len(self.rows)
        k1 = K + 1
        if kind in ("decode", "draft_step"):
            q_lens = [1] * n
        q_lens = q_lens or [k1] * n
        seq = [length + q for length, q in zip(self.lens, q_lens)]
        loc = torch.cat([s[length:sq] for s, length, sq in zip(self.slots, self.lens, seq)])
        ids = torch.randint(3, r.vocab_size, (sum(q_lens),), generator=self.gen)
        if kind == "verify_expand":  # q single-token rows per request sharing its row
            rows = [row for row, q in zip(self.rows, q_lens) for _ in range(q)]
            seqs = [length + j + 1 for length, q in zip(self.lens, q_lens) for j in range(q)]
            return r.build_forward_batch(
                ForwardMode.TARGET_VERIFY, ids, rows, seqs, [1] * len(rows), loc,
                self.kind(kind).backend,
            )  # fmt: skip
        k = self.kind(kind)
        return r.build_forward_batch(k.mode, ids, self.rows, seq, q_lens, loc, k.backend)

    def kind(self, prefix: str):
        return next(k for n, k in self.runner.kinds.items() if n.startswith(prefix))


CASES = [  # (verify path, kind, MTP layer or None, query lengths)
    ("expand", "decode", None, None),
    ("expand", "verify_expand", None, None),
    ("fia", "verify_fia", None, None),
    ("fia", "verify_fia", None, [1, 4, 1]),  # mixed: requests without drafts
    ("fia", "draft_extend", 0, None),
    ("fia", "draft_step", 1, None),  # the repeated (last) MTP layer of a 2-layer checkpoint
]


@pytest.fixture(scope="module")
def runners(tiny_mtp_factory):
    ck = tiny_mtp_factory(num_mtp=2)
    return {v: make_runner(ck.path, v) for v in ("expand", "fia")}


def test_captures_every_kind_largest_bucket_first(runners):
    gr = runners["fia"].graph_runner
    # the 2-layer checkpoint: layer 1's pass over committed positions has its own kind
    assert set(gr.kinds) == {
        "decode", "verify_fia", "draft_extend", "draft_extend_l1", "draft_step1"
    }  # fmt: skip
    assert list(gr.graphs)[0][1] == 4 and len(gr.graphs) == 2 * len(gr.kinds)
    # every kind runs the LM head inside its graph but layer 1's pass (its KV only)
    assert [n for n, k in gr.kinds.items() if not k.logits] == ["draft_extend_l1"]
    assert set(runners["expand"].graph_runner.kinds) >= {"verify_expand"}


@pytest.mark.parametrize(("verify", "kind", "layer", "q_lens"), CASES)
def test_replay_matches_eager_and_padding_never_leaks(runners, verify, kind, layer, q_lens):
    runner = runners[verify]
    gr = runner.graph_runner
    reqs = Requests(runner)
    try:
        fb = reqs.batch(kind, q_lens)
        hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, generator=reqs.gen)
        graph_kind = reqs.kind(kind)
        assert graph_kind.mtp_layer == layer
        assert gr.can_run(fb, graph_kind)
        name = graph_kind.name
        before = gr.replays[name]
        replayed, logits = gr.run(fb, graph_kind, hidden if layer is not None else None)[:2]
        assert gr.replays[name] == before + 1
        eager = runner.forward_eager(fb, layer, hidden)
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-5)
        # the LM head ran inside the graph, over every real row
        assert logits.shape == (fb.num_tokens, runner.vocab_size)
        torch.testing.assert_close(logits, runner.compute_logits(eager), rtol=1e-4, atol=1e-4)

        # Same replay with garbage in every padding row (ids, positions, hidden, KV lengths,
        # request rows): real rows are bit-identical, and no KV outside slot 0 and the real
        # tokens' slots changes.
        g = gr.graphs[name, 4, gr.static_kv_len]
        kv = [runner.kv_pool.get_key_buffer(i).clone() for i in range(runner.num_layers)]
        b, n_tok, n_rows = gr.buf, fb.num_tokens, fb.batch_size
        b.input_ids[n_tok : g.num_tokens].random_(3, runner.vocab_size, generator=reqs.gen)
        b.positions[n_tok : g.num_tokens].random_(0, 40, generator=reqs.gen)
        b.hidden[n_tok : g.num_tokens].normal_(generator=reqs.gen)
        b.seq_lens[n_rows : g.num_rows].random_(0, 9, generator=reqs.gen)
        b.req_pool_indices[n_rows : g.num_rows] = reqs.rows[0]
        with torch.inference_mode():
            again = g.graph.replay(None)
        assert torch.equal(again[0][:n_tok], replayed)
        assert torch.equal(again[1][:n_tok], logits)
        touched = torch.cat([fb.out_cache_loc, torch.zeros(1, dtype=torch.int64)])
        for i, before_kv in enumerate(kv):
            after = runner.kv_pool.get_key_buffer(i).clone()
            after[touched], before_kv[touched] = 0, 0
            assert torch.equal(after, before_kv), f"padding wrote KV of layer {i}"
    finally:
        for s in reqs.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(reqs.rows)


def test_replay_gathers_only_the_window_its_longest_row_needs(tiny_mtp_factory):
    """torch_native kinds are captured per KV window (16, 32, then the whole 65-wide row): a
    replay takes the smallest window that holds its longest row, gathers only that window, and
    equals eager on both sides of each window edge; FIA (host lengths) keeps one window."""
    runner = make_runner(tiny_mtp_factory(num_mtp=2).path, "fia", smallest_kv_window=16)
    gr = runner.graph_runner
    assert gr.windows == [16, 32, 65]
    assert gr.graphs_per_kind() == {
        "decode": 6,
        "verify_fia": 2,
        "draft_extend": 6,
        "draft_extend_l1": 6,
        "draft_step1": 6,
    }
    cases = [  # (prompt lengths, decode's window, draft_extend's window: 1+K more positions)
        ((5, 15, 8), 16, 32),
        ((5, 16, 8), 32, 32),
        ((29, 9), 32, 65),
        ((60, 40, 2), 65, 65),
    ]
    for lens, decode_window, extend_window in cases:
        reqs = Requests(runner, lens=lens, cap=64)
        try:
            for kind, layer, window in (
                ("decode", None, decode_window),
                ("draft_extend", 0, extend_window),
                ("verify_fia", None, gr.static_kv_len),
            ):
                fb = reqs.batch(kind)
                hidden = torch.randn(fb.num_tokens, runner.config.hidden_size, generator=reqs.gen)
                hidden = hidden if layer is not None else None
                graph_kind = reqs.kind(kind)
                before = gr.window_replays[window]
                replayed = gr.replay(fb, graph_kind, hidden)
                assert gr.window_replays[window] == before + 1, (lens, kind)
                bucket = 4 if len(lens) > 2 else 2
                meta = gr.graphs[graph_kind.name, bucket, window].fb.attn_metadata
                if kind != "verify_fia":
                    assert meta.kv_slots.shape[1] == window  # the KV gathered per layer
                eager = runner.forward_eager(fb, layer, hidden)
                torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-5)
        finally:
            for s in reqs.slots:
                runner.allocator.free(s)
            runner.req_to_token_pool.free(reqs.rows)


def test_batches_a_graph_cannot_hold_run_eagerly(runners):
    runner = runners["fia"]
    reqs = Requests(runner, lens=(5, 7, 9))
    try:
        fb = reqs.batch("verify_fia")
        assert runner.graph_runner.can_run(fb, reqs.kind("verify_fia"))
        mixed = reqs.batch("draft_extend", [1, 4, 2])  # ragged MTP extend: eager
        assert not runner.graph_runner.can_run(mixed, reqs.kind("draft_extend"))
        prefill = reqs.batch("verify_fia")
        prefill.forward_mode = ForwardMode.EXTEND
        assert not runner.graph_runner.can_run(prefill, reqs.kind("verify_fia"))
    finally:
        for s in reqs.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(reqs.rows)
    too_many = Requests(runner, lens=tuple(range(3, 8)))  # 5 requests > largest bucket 4
    try:
        assert not runner.graph_runner.can_run(too_many.batch("decode"), too_many.kind("decode"))
    finally:
        for s in too_many.slots:
            runner.allocator.free(s)
        runner.req_to_token_pool.free(too_many.rows)


def test_paged_fia_replay_matches_eager(tiny_mtp_factory):
    runner = make_runner(tiny_mtp_factory(num_mtp=2).path, "fia", page_size=4)
    reqs = Requests(runner, lens=(3, 9))
    fb = reqs.batch("verify_fia")
    replayed = runner.graph_runner.replay(fb, reqs.kind("verify_fia"))
    torch.testing.assert_close(replayed, runner.forward_eager(fb, None, None), rtol=1e-4, atol=1e-5)


def test_runner_built_under_inference_mode(tiny_mtp_factory):
    """Weights created under inference_mode are inference tensors (no version counter): the
    cached absorbed MLA weights must still work, eager and replayed."""
    with torch.inference_mode():
        runner = make_runner(tiny_mtp_factory(num_mtp=2).path, "expand")
        reqs = Requests(runner, lens=(4, 6))
        fb = reqs.batch("decode")
        replayed = runner.graph_runner.replay(fb, reqs.kind("decode"))
        torch.testing.assert_close(replayed, runner.forward_eager(fb), rtol=1e-4, atol=1e-5)
