"""Plain decoding's forward and greedy sampling in one graph (GraphKind.argmax_vocab): which
batches may take it, that its replay hands back the argmax of the logits the plain decode
graph computes (the tokens `sample_tokens` would choose), and ForwardBatch.build's one packed
host->device copy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from srt_ascend.decoding import DecoderHandles
from srt_ascend.decoding.plain import PlainDecoder
from srt_ascend.model_executor.forward_batch import ForwardMode, pack_to_device
from srt_ascend.model_executor.model_runner import ModelRunner
from srt_ascend.platforms import get_platform
from srt_ascend.sampling.sample_step import greedy_without_logprobs, sample_tokens
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs

# ---- which batches may replay the greedy graph ------------------------------------------------


@dataclass
class _Req:
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0))
    origin_input_ids: list[int] = field(default_factory=lambda: [5, 6])
    output_ids: list[int] = field(default_factory=lambda: [7])
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    grammar: object = None
    penalty_state: object = None


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, **kw})


@pytest.mark.parametrize(
    "other, greedy",
    [
        (_Req(), True),
        (_Req(return_logprob=True), False),  # logprobs read the logits
        (_Req(sampling_params=_params(temperature=0.7)), False),  # sampled
        (_Req(sampling_params=_params(frequency_penalty=0.5)), False),  # penalties
        (_Req(sampling_params=_params(logit_bias={"3": 1.0})), False),  # a bias
        (_Req(sampling_params=_params(min_new_tokens=4)), False),  # a stop mask pending
        (_Req(grammar=object()), False),  # a grammar mask
    ],
)
def test_greedy_graph_only_for_all_greedy_batches_without_logprobs(other, greedy):
    assert greedy_without_logprobs([_Req(), other]) is greedy
    assert greedy_without_logprobs([other]) is greedy


def test_min_new_tokens_counts_the_launch_time_tokens():
    req = _Req(sampling_params=_params(min_new_tokens=2), output_ids=[7])
    assert not greedy_without_logprobs([req])
    assert greedy_without_logprobs([req], generated=[2])  # the step in flight counted


# ---- the graph: forward + argmax, identical tokens -----------------------------------------


@pytest.fixture(scope="module")
def runner(tiny_mtp_factory) -> ModelRunner:
    args = ServerArgs(
        model_path=tiny_mtp_factory().path,
        dtype="float32",
        context_length=48,
        max_running_requests=8,
        max_total_tokens=1024,
        enable_cpu_graph=True,
        cuda_graph_bs=(2, 4),
    )
    runner = ModelRunner(args, get_platform("cpu"))
    decoder = PlainDecoder(args, DecoderHandles(runner, kv=None, commit=None, eos_ids=[]))
    runner.capture_graphs(decoder.graph_kinds())
    runner.decoder = decoder
    return runner


def _decode_batch(runner: ModelRunner, n: int, seed: int):
    """A decode batch of `n` requests over random KV of different lengths."""
    g = torch.Generator().manual_seed(seed)
    pool, lens = runner.kv_pool, [5 + 3 * i for i in range(n)]
    rows = runner.req_to_token_pool.alloc(n)
    locs = []
    for row, length in zip(rows, lens):
        slots = runner.allocator.alloc(length + 1)
        runner.req_to_token_pool.req_to_token[row, : length + 1] = slots
        for layer in range(runner.num_layers):
            c_kv = torch.randn(length, pool.kv_lora_rank, generator=g)
            k_pe = torch.randn(length, pool.qk_rope_head_dim, generator=g)
            pool.set_mla_kv_buffer(layer, slots[:length], c_kv, k_pe)
        locs.append(slots[length:])
    ids = torch.randint(3, runner.vocab_size, (n,), generator=g).tolist()
    seq = [length + 1 for length in lens]
    fb = runner.build_forward_batch(ForwardMode.DECODE, ids, rows, seq, [1] * n, torch.cat(locs))
    return fb, rows


@pytest.mark.parametrize("n", [1, 3, 4, 6])  # buckets 2 (padded), 4 (padded, full); 6: eager
def test_greedy_graph_gives_the_sampler_tokens(runner, n):
    decoder, graphs = runner.decoder, runner.graph_runner
    assert {"decode", "decode_greedy"} <= set(graphs.kinds)
    fb, rows = _decode_batch(runner, n, seed=n)
    try:
        before = dict(graphs.replays)
        _, logits = runner.forward_logits(fb, decoder.kind)
        want = sample_tokens(logits, [_Req() for _ in range(n)], runner.vocab_size, [])
        hidden, tokens = runner.forward_greedy(fb, decoder.greedy_kind)
        replayed = {k: v - before.get(k, 0) for k, v in graphs.replays.items()}
        assert tokens.dtype == torch.int64 and tokens.shape == (n,) and hidden.shape[0] == n
        assert tokens.tolist() == want.token_ids.tolist()
        if n <= 4:  # each kind replayed its own graph once
            assert replayed.get("decode") == 1 and replayed.get("decode_greedy") == 1
            out = graphs.run(fb, decoder.greedy_kind)
            assert out.logits is None and out.tokens.tolist() == tokens.tolist()
        else:  # no bucket holds it: eager, the argmax outside
            assert not any(replayed.values())
    finally:
        runner.req_to_token_pool.free(list(rows))
        runner.allocator.free(fb.out_cache_loc)  # the KV slots before it stay taken: plenty


SAMPLED = [  # seeded over every setting, a greedy row, an unseeded one
    {"temperature": 0.8, "seed": 1},
    {"temperature": 1.0, "top_k": 5, "seed": 2},
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.8, "min_p": 0.02, "seed": 3},
    {"temperature": 0.9},
    {"temperature": 1.1, "seed": 4},
]


@pytest.mark.parametrize("n", [1, 3, 4, 6])
def test_sampled_graph_gives_the_sampler_tokens(runner, n):
    """`decode_sampled` (GraphKind.sampled): forward and sampling in one graph, its settings
    and uniforms one block (static_sampling.decode_block) copied in before the replay: the
    seeded and greedy rows' tokens are `sample_tokens`' over the `decode` graph's logits
    (the same streams: counts 3 + i); 6 requests: no bucket holds them, None (eager)."""
    decoder, graphs = runner.decoder, runner.graph_runner
    fb, rows = _decode_batch(runner, n, seed=n)
    reqs = [_Req(sampling_params=_params(**SAMPLED[i])) for i in range(n)]
    generated = [3 + i for i in range(n)]
    try:
        before = dict(graphs.replays)
        _, logits = runner.forward_logits(fb, decoder.kind)
        want = sample_tokens(logits, reqs, runner.vocab_size, [], generated).token_ids.tolist()
        out = decoder.sampled_decode(fb, reqs, decoder.sampled_kinds, generated)
        replayed = {k: v - before.get(k, 0) for k, v in graphs.replays.items()}
        if n > 4:
            assert out is None and not replayed.get("decode_sampled")
            return
        hidden, tokens = out
        assert tokens.dtype == torch.int64 and tokens.shape == (n,) and hidden.shape[0] == n
        # top-k or top-p set, or a greedy row: the variant with the masks' sort
        assert replayed.get("decode_filtered" if n > 1 else "decode_sampled") == 1
        kept = [i for i in range(n) if "seed" in SAMPLED[i] or not SAMPLED[i]["temperature"]]
        assert [tokens.tolist()[i] for i in kept] == [want[i] for i in kept]
    finally:
        runner.req_to_token_pool.free(list(rows))
        runner.allocator.free(fb.out_cache_loc)


def test_sampled_graph_refuses_what_modifies_the_logits(runner):
    """Penalties, a logit bias, min_new_tokens ahead or logprobs: no sampled graph (None),
    the caller samples from the logits."""
    decoder = runner.decoder
    fb, rows = _decode_batch(runner, 2, seed=9)
    try:
        for kw in ({"frequency_penalty": 0.5}, {"logit_bias": {"5": 1.0}}, {"min_new_tokens": 9}):
            reqs = [_Req(sampling_params=_params(temperature=0.8, **kw)) for _ in range(2)]
            assert decoder.sampled_decode(fb, reqs, decoder.sampled_kinds) is None, kw
        asks = [_Req(sampling_params=_params(temperature=0.8), return_logprob=True)] * 2
        assert decoder.sampled_decode(fb, asks, decoder.sampled_kinds) is None
    finally:
        runner.req_to_token_pool.free(list(rows))
        runner.allocator.free(fb.out_cache_loc)


# ---- ForwardBatch.build: one packed copy -----------------------------------------------------


def test_pack_sends_host_parts_as_views_of_one_tensor():
    loc = torch.tensor([9, 8], dtype=torch.int32)
    ids, pos, rows, lens, ext, out_loc = pack_to_device(
        [[1, 2], [3, 4], [0, 1], [4, 5], [1, 1], loc], "meta"
    )
    for t, n in ((ids, 2), (pos, 2), (rows, 2), (lens, 2), (ext, 2), (out_loc, 2)):
        assert t.device.type == "meta" and t.dtype == torch.int64 and t.shape == (n,)
    packed = ids._base
    assert packed is not None and packed.shape == (12,)
    assert all(t._base is packed for t in (pos, rows, lens, ext, out_loc))


def test_pack_on_the_host_keeps_tensors_and_values():
    buf = torch.zeros(2, dtype=torch.int64)  # a launched step's input, filled later
    ids, pos, loc = pack_to_device([buf, [7, 8], torch.tensor([3, 4])], "cpu")
    assert ids is buf  # on the device already: the batch's own buffer, not a copy
    assert pos.tolist() == [7, 8] and loc.tolist() == [3, 4]
    empty, more = pack_to_device([[], [1]], "cpu")
    assert empty.shape == (0,) and more.tolist() == [1]


def test_build_makes_one_host_to_device_copy(runner, monkeypatch):
    from srt_ascend.model_executor import forward_batch

    copies = []
    real = forward_batch.to_device
    monkeypatch.setattr(
        forward_batch, "to_device", lambda t, d, *a: copies.append(t.shape) or real(t, d, *a)
    )
    fb = forward_batch.ForwardBatch.build(
        ForwardMode.EXTEND, [5, 6, 7, 8], [1, 2], [3, 4], [2, 2], torch.tensor([10, 11, 12, 13]),
        runner.req_to_token_pool, runner.kv_pool, runner.attn_backend, init_metadata=False,
    )  # fmt: skip
    assert len(copies) == 1  # ids, positions, rows, lengths, query lengths: one tensor
    assert fb.positions.tolist() == [1, 2, 2, 3]
    assert fb.input_ids.tolist() == [5, 6, 7, 8] and fb.req_pool_indices.tolist() == [1, 2]
    assert fb.seq_lens.tolist() == [3, 4] and fb.extend_seq_lens.tolist() == [2, 2]
    assert fb.out_cache_loc.tolist() == [10, 11, 12, 13]


def test_compiled_forwards_keep_one_decode_kind(runner):
    """With --enable-torch-compile the plain decoder captures (and compiles) `decode` alone:
    its launch never asks for the greedy kind, which no graph would hold."""
    args = dataclasses.replace(runner.server_args, enable_torch_compile=True)
    handles = DecoderHandles(runner, kv=None, commit=None, eos_ids=[])
    assert [k.name for k in PlainDecoder(args, handles).graph_kinds()] == ["decode"]
    assert PlainDecoder(args, handles).greedy_kind is None
    eager = PlainDecoder(runner.server_args, handles)
    names = ["decode", "decode_greedy", "decode_sampled", "decode_filtered"]
    assert [k.name for k in eager.graph_kinds()] == names
