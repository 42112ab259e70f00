"""Overlap scheduling (forced on: eager forwards on CPU run serially by default) gives what the
serial loop (`--disable-overlap-schedule`) gives, on the shipped checkpoint in float32: greedy
tokens, seeded samples, logprobs, `n > 1`, a stop string found one step late, a grammar request
beside overlapped ones, penalties (run serially), an abort while a step is in flight, retractions
from a small KV pool; and MTP rounds under overlap equal serial MTP rounds and plain decoding.
Each scenario runs on one engine per setting, which then must be idle with the KV invariant
intact (every slot and request row free or owned by the prefix cache)."""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS
from overlap_scenarios import (
    MTP,
    ON,
    SCENARIOS,
    SMALL_POOL,
    abort_in_flight,
    edge_requests,
    mixed_sampling,
    retraction,
    run_all,
    same_logprobs,
    seeded_logprobs,
    serial_retraction_run,
)

from srt_ascend import Engine


@pytest.fixture(scope="module")
def serial(model_path) -> dict:
    return run_all(model_path, SCENARIOS)  # eager forwards on CPU: serial by default


@pytest.fixture(scope="module")
def overlapped(model_path) -> dict:
    return run_all(model_path, SCENARIOS, **ON)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_overlap_equals_serial(serial, overlapped, name):
    out_off, problem_off, overlapped_off, _ = serial[name]
    out_on, problem_on, overlapped_on, _ = overlapped[name]
    assert problem_off is None and problem_on is None
    assert overlapped_off == 0
    assert overlapped_on > 0  # the overlapped path ran
    assert out_on == out_off


@pytest.fixture(scope="module")
def serial_retraction(model_path) -> tuple:
    return serial_retraction_run(model_path)


def test_retractions_under_overlap(model_path, serial_retraction):
    scenarios = {"retraction": retraction}
    (off, problem_off, _, retracted_off) = serial_retraction
    (on, problem_on, overlapped_on, retracted_on) = run_all(
        model_path, scenarios, **ON, **SMALL_POOL
    )["retraction"]
    assert problem_off is None and problem_on is None
    assert retracted_off > 0 and retracted_on > 0 and overlapped_on > 0
    assert on == off


# grammar_and_penalties runs its rounds serially: an overlapped streak ends and starts again
# around it; seeded sampled requests overlap (their streams picked on the device)
MTP_SCENARIOS = {
    name: SCENARIOS[name]
    for name in (
        "greedy",
        "logprobs",
        "stop_string",
        "abort_in_flight",
        "grammar_and_penalties",
        "late_join",
        "n_samples",
    )
}
MTP_SCENARIOS["seeded_logprobs"] = seeded_logprobs
MTP_SCENARIOS["mixed_sampling"] = mixed_sampling
MTP_SCENARIOS["edge_requests"] = edge_requests


def test_mtp_rounds_overlap_and_equal_serial_mtp_and_plain(model_path, overlapped):
    """MTP rounds launched before the round before them is read give what serial MTP rounds
    give (tokens, logprobs, stop strings, the prefix cache left behind, an abort mid-round,
    batches that fall back to serial rounds, arrivals that end a streak of overlapped
    rounds, seeded sampled requests alone, with `n > 1`, and beside unseeded sampled and
    greedy ones), and the plain decoder's greedy tokens; the KV invariant holds after each. The
    CPU's verify (fia) runs eagerly here, its attention over the device lengths."""
    on = run_all(model_path, MTP_SCENARIOS, **ON, **MTP)
    off = run_all(model_path, MTP_SCENARIOS, disable_overlap_schedule=True, **MTP)
    for name in MTP_SCENARIOS:
        (out_on, cached_on), problem_on, n_on, _ = on[name]
        (out_off, cached_off), problem_off, n_off, _ = off[name]
        assert problem_on is None and problem_off is None, name
        assert n_off == 0 and n_on > 0, name
        assert cached_on == cached_off, name
        if name in ("logprobs", "seeded_logprobs", "edge_requests"):
            assert same_logprobs(out_on, out_off), name
        else:
            assert out_on == out_off, name
    for name in ("greedy", "stop_string", "late_join"):
        assert on[name][0][0] == overlapped[name][0][0], name


def test_mtp_overlap_with_expand_verify_and_graphs(model_path, overlapped):
    """Batch-expanded verify replayed from CPU graphs under overlap: each replay's KV window
    comes from the host bounds of the lengths; the plain decoder's greedy tokens."""
    scenarios = {name: SCENARIOS[name] for name in ("greedy", "stop_string", "late_join")}
    kw = {"speculative_verify": "expand", "enable_cpu_graph": True, "cuda_graph_bs": (1, 8)}
    on = run_all(model_path, scenarios, **ON, **MTP, **kw)
    for name in scenarios:
        (out, _), problem, n_on, _ = on[name]
        assert problem is None and n_on > 0, name
        assert out == overlapped[name][0][0], name


def graph_replays(engine: Engine) -> dict:
    """A scenario that reads the graph replays so far (per kind)."""
    return dict(engine.get_internal_state()["graph_replays"])


def sampled_with_logprobs(engine: Engine) -> list:
    """A seeded sampled request asking logprobs (the per-forward kinds run its rounds)."""
    params = {"temperature": 0.9, "seed": 3, "max_new_tokens": 6, "ignore_eos": True}
    out = engine.generate(PROMPTS[0], params, return_logprob=True)
    return out["output_ids"]


def test_mtp_round_graph_aborts_and_fallbacks(model_path, overlapped):
    """All-greedy rounds replay as one graph per round (`mtp_round_k2`, no per-forward verify
    or draft step), serial and overlapped, with an abort mid-round: the plain decoder's greedy
    tokens, the KV invariant intact after it. A batch mixing seeded, unseeded sampled and
    greedy requests replays the round graph's sampled variant (`mtp_round_sampled_k2`, still
    no per-forward verify): its seeded and greedy tokens equal the per-forward kinds'
    (--disable-mtp-round-graph), serial and overlapped; a sampled request asking logprobs
    runs the per-forward kinds. Greedy tokens and stop strings through the round graph:
    `test_mtp_overlap_with_expand_verify_and_graphs`."""
    scenarios = {
        "abort_in_flight": abort_in_flight,
        "after_greedy": graph_replays,
        "mixed_sampling": mixed_sampling,
        "after_mixed": graph_replays,
        "sampled_with_logprobs": sampled_with_logprobs,
        "after_logprobs": graph_replays,
    }
    kw = {"speculative_verify": "expand", "enable_cpu_graph": True, "cuda_graph_bs": (1, 8)}
    mixed = []
    for flags in (ON, {"disable_overlap_schedule": True}):
        res = run_all(model_path, scenarios, **flags, **MTP, **kw)
        for name in scenarios:
            assert res[name][1] is None, name  # the KV invariant
        assert res["abort_in_flight"][0][0] == overlapped["abort_in_flight"][0][0]
        greedy, after = res["after_greedy"][0][0], res["after_mixed"][0][0]
        assert greedy.get("mtp_round_k2", 0) > 0, greedy
        assert not greedy.get("verify_expand") and not greedy.get("draft_step0"), greedy
        assert after.get("mtp_round_sampled_k2", 0) > 0, after
        assert not after.get("verify_expand") and not after.get("draft_step0"), after
        logprobs = res["after_logprobs"][0][0]
        assert logprobs.get("verify_expand", 0) > 0, logprobs
        mixed.append(res["mixed_sampling"][0][0])
    off = {"disable_mtp_round_graph": True, "disable_overlap_schedule": True}
    res = run_all(model_path, {"mixed_sampling": mixed_sampling}, **off, **MTP, **kw)
    assert mixed[0] == mixed[1] == res["mixed_sampling"][0][0]


def test_mtp_retractions_under_overlap(model_path):
    scenarios = {"retraction": retraction}
    kw = {**MTP, **SMALL_POOL}
    (off, problem_off, _, retracted_off) = run_all(
        model_path, scenarios, disable_overlap_schedule=True, **kw
    )["retraction"]
    (on, problem_on, n_on, retracted_on) = run_all(model_path, scenarios, **ON, **kw)["retraction"]
    assert problem_off is None and problem_on is None
    assert retracted_off > 0 and retracted_on > 0 and n_on > 0
    assert on[0] == off[0]


def test_idle_once_the_last_request_finishes(model_path):
    """The step that finds the last running request finished also finishes the step launched
    after it (whose token is dropped): the scheduler is idle when the last output goes out, so
    a cache flush sent right after it is not refused."""
    from srt_ascend.managers.io_struct import TokenizedGenerateReq
    from srt_ascend.managers.tp_ranks import build_scheduler, load_tokenizer
    from srt_ascend.platforms import get_platform
    from srt_ascend.sampling.sampling_params import SamplingParams
    from srt_ascend.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, dtype="float32", max_total_tokens=1024, **ON)
    outputs: list = []
    sched = build_scheduler(
        args, get_platform("cpu"), load_tokenizer(args.tokenizer), outputs.extend
    )
    try:
        for i, n in enumerate((4, 7)):
            params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            params.normalize()
            sched.handle(TokenizedGenerateReq(f"r{i}", [5, 17, 33 + i, 81], params))
        finished: set[str] = set()
        for _ in range(20):
            sched.step()
            finished |= {o.rid for o in outputs if o.finish_reason is not None}
            if len(finished) == 2:
                break
        assert finished == {"r0", "r1"}
        assert sched.num_overlapped_steps > 0
        assert not sched.has_work()
        assert sched.flush_cache()
        assert sched.idle_invariant_problem() is None
    finally:
        sched.worker.close()
