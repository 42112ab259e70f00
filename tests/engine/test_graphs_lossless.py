"""The lossless invariant with graphs on: greedy outputs (float32, shipped checkpoint) are
token-identical to eager decoding without speculation, for plain decode and for MTP with
either verify path, while batches move between captured buckets and eager (too large)
batches, and while the KV window a torch_native graph gathers changes with the batch's longest
row (windows 64, 128, 256, then the whole 529-wide row; the prompts run 11..122 tokens plus 16
new ones). On CPU the graphs are eager replays over the graph runner's static buffers."""

from __future__ import annotations

import orjson
import pytest
from lossless import GREEDY, PROMPTS, assert_same_greedy, run

from srt_ascend import Engine

# 12 running requests: full batches run eagerly (> 8), shrinking ones replay buckets 1-8;
# plain decode runs 8 at most, so every step replays and its batches cross KV windows.
GRAPHS = {
    "enable_cpu_graph": True,
    "cuda_graph_bs": (1, 2, 4, 8),
    "context_length": 512,
    "max_running_requests": 12,
}
SPEC = {"speculative_algorithm": "MTP"}
CONFIGS = {  # name: (server args, kinds that must replay, KV windows that must be replayed)
    "decode": ({"max_running_requests": 8}, {"decode"}, {64, 128}),
    "mtp-k1-expand": (
        {**SPEC, "speculative_verify": "expand"},
        {"verify_expand", "draft_extend"},
        set(),
    ),
    "mtp-k2-fia": (
        {**SPEC, "speculative_num_steps": 2},
        {"verify_fia", "draft_extend", "draft_step0"},
        set(),
    ),
    "mtp-k3-fia-page4-chunked": (
        {**SPEC, "speculative_num_steps": 3, "page_size": 4, "chunked_prefill_size": 64},
        {"verify_fia", "draft_extend", "draft_step0"},
        set(),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_with_graphs(model_path, baseline, name):
    extra, kinds, windows = CONFIGS[name]
    outs, state = run(model_path, **{**GRAPHS, **extra})
    assert_same_greedy(name, outs, baseline)
    replays = state["graph_replays"]
    assert state["graph_batch_sizes"] == [1, 2, 4, 8]
    assert kinds <= {k for k, n in replays.items() if n > 0}, replays
    replayed = state["graph_kv_window_replays"]
    assert windows <= {int(w) for w, n in replayed.items() if n > 0}, replayed
    orjson.dumps(state)  # what /server_info sends: JSON object keys must be strings


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_graph_kind_replays_forward_and_argmax(model_path, baseline, overlap):
    """Plain decoding of greedy requests without logprobs replays `decode_greedy` (the
    forward ending with the argmax: one graph, tokens out) at every step and never `decode`,
    serial or overlapped, token-identical to the eager baseline; with logprobs (the "decode"
    case above) `decode` replays and `decode_greedy` never does."""
    flags = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    args = {**GRAPHS, "max_running_requests": 8, **flags}
    outs, state = run(model_path, return_logprob=False, **args)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert [o["output_ids"] for o in outs] == [b["output_ids"] for b in baseline]
    replays = state["graph_replays"]
    assert replays.get("decode_greedy", 0) > 0 and not replays.get("decode"), replays
    _, with_logprobs = run(model_path, prompts=PROMPTS[:4], **args)
    replays = with_logprobs["graph_replays"]
    assert replays.get("decode", 0) > 0 and not replays.get("decode_greedy"), replays


@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_graph_kind_replays_forward_and_sampling(model_path, overlap):
    """Plain decoding of sampled batches without logprobs (seeded and not, top-k / top-p /
    min-p, a greedy request beside them) replays `decode_filtered` (forward and sampling in
    one graph) and never `decode`, serial or overlapped: the seeded and greedy requests'
    tokens equal those of the same batch asking logprobs, which samples from the `decode`
    graph's logits (and never replays `decode_filtered`)."""
    flags = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    engine = Engine(
        model_path=model_path, dtype="float32", **{**GRAPHS, "max_running_requests": 8}, **flags
    )
    params = sampled_params(7)
    try:
        outs = engine.generate(PROMPTS[:7], params)
        sampled = dict(engine.get_internal_state()["graph_replays"])
        with_logprobs = engine.generate(PROMPTS[:7], params, return_logprob=True)
        replays = engine.get_internal_state()["graph_replays"]
    finally:
        engine.shutdown()
    # top-k / top-p rows and a greedy one: the variant with the masks (`decode_filtered`)
    assert sampled.get("decode_filtered", 0) > 0 and not sampled.get("decode"), sampled
    assert replays["decode"] > 0 and replays["decode_filtered"] == sampled["decode_filtered"]
    kept = [i for i, p in enumerate(params) if "seed" in p or not p["temperature"]]
    assert [outs[i]["output_ids"] for i in kept] == [with_logprobs[i]["output_ids"] for i in kept]


ROUNDS = {  # name: (K, verify, overlap, chunked prefill)
    "k1-expand-serial-chunked": (1, "expand", False, True),
    "k2-fia-overlap": (2, "fia", True, False),
    "k3-expand-overlap-chunked": (3, "expand", True, True),
}


@pytest.mark.parametrize("name", list(ROUNDS))
def test_mtp_round_graph_greedy_identical(model_path, baseline, name):
    """All-greedy batches without logprobs replay each MTP round as one graph (drafts,
    verify, greedy acceptance, MTP pass, next d_1), serial or overlapped, over prompts with
    radix hits (two asked again once rows free up) and chunked prefills: token-identical to eager
    decoding without speculation, and no per-forward verify or draft step replays (the count
    proves the round graph ran, not the old path)."""
    k, verify, overlap, chunked = ROUNDS[name]
    flags = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    args = {**GRAPHS, **SPEC, "max_running_requests": 8, "speculative_num_steps": k, **flags}
    if chunked:
        args["chunked_prefill_size"] = 64
    engine = Engine(model_path=model_path, dtype="float32", speculative_verify=verify, **args)
    try:
        outs = engine.generate(PROMPTS[:10], GREEDY)
        again = engine.generate(PROMPTS[3:5], GREEDY)  # radix hits
        state = engine.get_internal_state()
    finally:
        engine.shutdown()
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs + again)
    want = [b["output_ids"] for b in baseline]
    assert [o["output_ids"] for o in outs + again] == want[:10] + want[3:5]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    assert (
        state["available_kv_tokens"] + state["cached_tokens_in_tree"]
        == (state["max_total_num_tokens"])
    ), "KV slots leaked"
    replays = {kind: n for kind, n in state["graph_replays"].items() if n}
    assert replays.get(f"mtp_round_k{k}", 0) > 0, replays
    # a prefill's MTP pass may replay draft_extend (a prompt tail of 1+K tokens); no round
    # runs a per-forward verify or draft step
    assert not [kind for kind in replays if kind.startswith(("verify", "draft_step"))], replays


SAMPLED_ROUNDS = {  # name: (K, verify, overlap, acceptance rule, top-k / top-p / greedy rows)
    "k1-expand-serial-token": (1, "expand", False, "token", True),
    "k2-fia-overlap-block": (2, "fia", True, "block", True),
    "k2-expand-overlap-token-unfiltered": (2, "expand", True, "token", False),
    "k3-expand-overlap-token": (3, "expand", True, "token", True),
    "k3-fia-serial-block-unfiltered": (3, "fia", False, "block", False),
}


def sampled_params(n: int, filtered: bool = True) -> list[dict]:
    """Seeded requests over temperature, top-k, top-p and min-p, one greedy and one unseeded
    request beside them (one batch); not `filtered`: temperature and min-p only (the round
    graph's variant without the masks' sort)."""
    kinds = [
        {"temperature": 0.8, "seed": 11},
        {"temperature": 1.0, "top_k": 20, "seed": 12},
        {"temperature": 0.7, "top_p": 0.9, "seed": 13},
        {"temperature": 0},
        {"temperature": 1.2, "min_p": 0.05, "seed": 14},
        {"temperature": 0.9},
    ]
    if not filtered:
        kinds = [k for k in kinds if k["temperature"] and "top_k" not in k and "top_p" not in k]
    return [{**kinds[i % len(kinds)], "max_new_tokens": 12, "ignore_eos": True} for i in range(n)]


@pytest.mark.parametrize("name", list(SAMPLED_ROUNDS))
def test_mtp_round_graph_sampled_identical(model_path, name):
    """Batches of sampled requests (seeded and not, top-k / top-p / min-p, a greedy one
    beside them) replay each MTP round as the round graph's sampled variant (draft sampling,
    the acceptance rule, the next d_1 drawn inside it) with no per-forward verify or draft
    step, serial or overlapped, token-wise or block acceptance: the seeded and greedy
    requests' tokens equal those of the per-forward kinds (--disable-mtp-round-graph)."""
    k, verify, overlap, rule, filtered = SAMPLED_ROUNDS[name]
    flags = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    args = {**GRAPHS, **SPEC, "max_running_requests": 8, "speculative_num_steps": k, **flags}
    params = sampled_params(7, filtered)
    runs = []
    for off in (False, True):
        engine = Engine(
            model_path=model_path,
            dtype="float32",
            speculative_verify=verify,
            speculative_accept_method=rule,
            disable_mtp_round_graph=off,
            **args,
        )
        try:
            outs = engine.generate(PROMPTS[:7], params)
            state = engine.get_internal_state()
        finally:
            engine.shutdown()
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        kept = [
            o["output_ids"] for o, p in zip(outs, params) if "seed" in p or not p["temperature"]
        ]
        runs.append((kept, {kind: n for kind, n in state["graph_replays"].items() if n}))
    (on, replays), (off_tokens, off_replays) = runs
    assert on == off_tokens
    assert replays.get(f"mtp_round_sampled_k{k}", 0) > 0, replays
    assert not [kind for kind in replays if kind.startswith(("verify", "draft_step"))], replays
    assert not [kind for kind in off_replays if kind.startswith("mtp_round")], off_replays
