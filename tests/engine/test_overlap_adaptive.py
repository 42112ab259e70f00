"""Adaptive K under overlap scheduling (forced on: eager forwards on CPU run serially by
default), on the shipped checkpoint in float32: each round's K is chosen at its launch (here a
scripted walk, K = 0 included), rounds overlap across changes of K, and tokens, logprobs and
seeded samples equal plain decoding's; requests that finish, are aborted or are retracted while
K = 0 rounds deferred their MTP passes leave the prefix cache the MTP KV the serial loop leaves.
The scenarios and their runner are test_overlap's (overlap_scenarios.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from engine_prompts import PROMPTS
from lossless import PROMPTS as LOSSLESS_PROMPTS
from overlap_scenarios import (
    COMMON,
    GREEDY,
    MTP,
    ON,
    SCENARIOS,
    SMALL_POOL,
    idle_problem,
    retraction,
    run_all,
    same_logprobs,
    seeded,
    serial_retraction_run,
)

from srt_ascend import Engine
from srt_ascend.speculative.draft_length import FixedDraftLength


@pytest.fixture(scope="module")
def overlapped(model_path) -> dict:
    """Plain decoding under overlap: the scenarios the adaptive rounds are compared with."""
    names = ("greedy", "seeded", "logprobs", "stop_string", "abort_in_flight", "late_join")
    return run_all(model_path, {name: SCENARIOS[name] for name in names}, **ON)


@pytest.fixture(scope="module")
def serial_retraction(model_path) -> tuple:
    return serial_retraction_run(model_path)


class WalkDraftLength(FixedDraftLength):
    """Adaptive K made to vary: each round runs the next K of `walk`, over and over (0: the
    plain decoder's step, its MTP pass deferred); learns like the real policies. `ran`
    counts the rounds run while it was the decoder's policy (`walk_rounds`), `at` the
    rounds it was advanced for."""

    def __init__(self, max_k: int, walk) -> None:
        super().__init__(max_k, [1])
        self.walk, self.at, self.ran = tuple(walk), 0, 0

    def peek(self, estimates):
        return self.walk[self.at % len(self.walk)]

    def advance(self, batch):
        self.at += 1


# two graph buckets: the start profile of step costs (which the scripted K ignores) stays short
ADAPTIVE = {**ON, **MTP, "speculative_adaptive": True, "cuda_graph_bs": (1, 16)}
# K changes between overlapped rounds with drafts (2 -> 1 -> 2), drafts -> K = 0 -> K = 0, and
# K = 0 -> drafts (which runs serially: the deferred passes first)
WALK = (2, 1, 0, 0, 2, 2, 1, 0, 1)


@dataclasses.dataclass
class Rounds:
    """What `walk_rounds` saw: each overlapped round's (prev K or None, K), the launches
    refused (the scheduler then runs `step`), and the scripted policy."""

    launched: list = dataclasses.field(default_factory=list)
    refused: int = 0
    walk: WalkDraftLength | None = None


def walk_rounds(rounds: Rounds, walk=WALK):
    """A setup that scripts the engine's K (`WalkDraftLength` over `walk`) and notes the
    rounds in `rounds`: each launched or stepped round counted in the policy it ran under."""

    def setup(engine: Engine) -> None:
        decoder = engine.tokenizer_manager.scheduler.decoder
        decoder.draft_length = rounds.walk = WalkDraftLength(2, walk)
        launch, step = decoder.launch, decoder.step

        def noting(reqs, prev):
            out = launch(reqs, prev)
            if out is None:
                rounds.refused += 1
            else:
                decoder.draft_length.ran += 1
                rounds.launched.append((None if prev is None else prev.k, out.k))
            return out

        def stepping(reqs):
            decoder.draft_length.ran += 1
            return step(reqs)

        decoder.launch, decoder.step = noting, stepping

    return setup


def plain_rounds(scenario):
    """`scenario` with every round K = 0, then the walk again."""

    def run(engine: Engine):
        decoder = engine.tokenizer_manager.scheduler.decoder
        walk, decoder.draft_length = decoder.draft_length, WalkDraftLength(2, (0,))
        try:
            return scenario(engine)
        finally:
            decoder.draft_length = walk

    return run


class ScriptedK(FixedDraftLength):
    """Adaptive K scripted by round: the Ks of `first`, one per round run, then `then`
    (`ran` as `WalkDraftLength`'s)."""

    def __init__(self, max_k: int, first, then: int) -> None:
        super().__init__(max_k, [1])
        self.first, self.then, self.ran = list(first), then, 0

    def peek(self, estimates):
        return self.first[0] if self.first else self.then

    def advance(self, batch):
        self.first = self.first[1:]


def both_ways(engine: Engine, run, first=(), then: int = 0) -> list:
    """`run()` with K scripted (`ScriptedK`) under overlap, then again with every round run
    by `step` (as the serial loop runs them), the prefix cache flushed before each."""
    decoder = engine.tokenizer_manager.scheduler.decoder
    walk, outs = decoder.draft_length, []
    try:
        for serial in (False, True):
            assert idle_problem(engine) is None and engine.flush_cache()
            decoder.draft_length = ScriptedK(2, first, then)
            if serial:
                decoder.can_overlap = lambda reqs: False
            outs.append(run())
    finally:
        decoder.draft_length = walk
        decoder.__dict__.pop("can_overlap", None)
    return outs


def mtp_kv_cached(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The MTP layer's KV over the cached prefix of `ids` (every position but the last)."""
    scheduler = engine.tokenizer_manager.scheduler
    runner = scheduler.runner
    slots = scheduler.tree.match_prefix(ids).device_indices
    assert len(slots) == len(ids) - 1
    return runner.kv_pool.get_key_buffer(runner.config.num_hidden_layers)[slots].clone()


def finished_in_plain_round(engine: Engine) -> tuple:
    """A request finishing in an overlapped K = 0 round: the MTP passes its K = 0 rounds
    deferred run before the prefix cache takes its slots (`MTPDecoder.finish`), as the
    serial loop's K = 0 step that finishes it runs them (`MTPWorker.defer`). Returns the MTP
    layer's KV over its cached positions both ways (a pass not run leaves what the slots
    held before) and the K of each overlapped round that finished a request."""
    decoder = engine.tokenizer_manager.scheduler.decoder
    prompt = engine.tokenizer_manager.tokenize(PROMPTS[2])
    ended: list[int] = []
    finish = decoder.finish

    def noting(step):
        out = finish(step)
        ended.extend(step.k for r in out if r.finished)
        return out

    def run():
        out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 9})
        return mtp_kv_cached(engine, prompt + out["output_ids"])

    decoder.finish = noting
    try:
        return both_ways(engine, run), ended
    finally:
        del decoder.finish


def aborted_in_plain_rounds(engine: Engine) -> tuple:
    """A streamed request closed while its K = 0 rounds overlap: the MTP passes they
    deferred run before the prefix cache takes its slots (`Decoder.leaving`). Returns the
    MTP layer's KV over its cached positions, and that of a request with the same tokens
    that finishes in serial K = 0 steps (their passes run when it finishes)."""
    tm = engine.tokenizer_manager
    decoder = tm.scheduler.decoder
    prompt = tm.tokenize(PROMPTS[3])
    long = {**GREEDY, "max_new_tokens": 200}

    async def cut():
        agen = tm.generate_one(tm.make_request(prompt, long, stream=True))
        async for out in agen:
            if len(out["output_ids"]) >= 6:
                break
        await agen.aclose()
        return out["output_ids"]

    def run(serial: bool):
        assert idle_problem(engine) is None and engine.flush_cache()
        decoder.draft_length = ScriptedK(2, [], 0)
        if serial:
            decoder.can_overlap = lambda reqs: False
            engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n})
        else:
            ids[:] = asyncio.run_coroutine_threadsafe(cut(), engine.loop).result()
            assert idle_problem(engine) is None
        return mtp_kv_cached(engine, prompt + ids[:n])

    walk, ids, n = decoder.draft_length, [], 6
    try:
        return run(False), run(True)
    finally:
        decoder.draft_length = walk
        decoder.__dict__.pop("can_overlap", None)


def seeded_plain_after_drafts(engine: Engine) -> tuple:
    """A seeded sampled request whose K = 2 round is followed by K = 0 rounds: the K = 0
    round launched after the drafting one is refused (its sampling stream is that of the
    count the drafting round leaves, unknown at launch) and runs serially; the tokens are
    those of serial rounds. Returns both runs' tokens and the K of each round whose
    successor's launch was refused."""
    decoder = engine.tokenizer_manager.scheduler.decoder
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    refused: list[int] = []
    launch = decoder.launch

    def noting(reqs, prev):
        out = launch(reqs, prev)
        if out is None and prev is not None:
            refused.append(prev.k)
        return out

    def run():
        return engine.generate(PROMPTS[0], params)["output_ids"]

    decoder.launch = noting
    try:
        return both_ways(engine, run, first=[2]), refused
    finally:
        decoder.launch = launch


ADAPTIVE_SCENARIOS = {
    name: SCENARIOS[name]
    for name in ("greedy", "logprobs", "stop_string", "abort_in_flight", "late_join")
}


def unpinned(scenario):
    """`scenario` with seeded sampled requests left to the policy (here the scripted walk)
    instead of pinned to the server's K (`MTPDecoder.own_length`): the walk then takes them
    through K = 0 rounds, as requests asking 0 drafts beside drafting ones go through them."""

    def run(engine: Engine):
        decoder = engine.tokenizer_manager.scheduler.decoder
        decoder.pin_seeded = False
        try:
            return scenario(engine)
        finally:
            decoder.pin_seeded = True

    return run


ADAPTIVE_SCENARIOS["seeded"] = unpinned(plain_rounds(seeded))
ADAPTIVE_SCENARIOS["finished_in_plain_round"] = finished_in_plain_round
ADAPTIVE_SCENARIOS["seeded_plain_after_drafts"] = unpinned(seeded_plain_after_drafts)
ADAPTIVE_SCENARIOS["aborted_in_plain_rounds"] = aborted_in_plain_rounds


@pytest.fixture(scope="module")
def adaptive(model_path) -> tuple[dict, Rounds]:
    """ADAPTIVE_SCENARIOS on one engine with the scripted walk of K, and its rounds."""
    rounds = Rounds()
    return run_all(model_path, ADAPTIVE_SCENARIOS, walk_rounds(rounds), **ADAPTIVE), rounds


def test_adaptive_k_rounds_overlap_and_equal_plain(adaptive, overlapped):
    """--speculative-adaptive under overlap: each round's K is chosen at its launch (here
    scripted to change between rounds, K = 0 included), rounds overlap across changes of K,
    and tokens and logprobs equal plain decoding's, seeded samples too where every round
    runs K = 0 (the plain decoder's sampling, at the exact count); an abort mid-streak and
    arrivals that end a streak leave the KV invariant intact. Before adaptive K overlapped,
    every adaptive round ran serially."""
    on, rounds = adaptive
    for name in ADAPTIVE_SCENARIOS:
        if name not in overlapped and name != "seeded":
            continue
        (out, cached), problem, n_on, _ = on[name]
        assert problem is None and n_on > 0, name
        plain = overlapped[name][0][0]
        if name == "logprobs":
            assert same_logprobs(out, plain)
        else:
            assert out == plain, name
    pairs = {(a, b) for a, b in rounds.launched if a is not None}
    assert {(2, 1), (1, 0), (0, 0)} <= pairs, pairs  # K changed under overlap
    assert (0, 2) not in pairs and (0, 1) not in pairs  # the catch-up ran serially
    # one round, one choice: a launch refused (K = 0 -> drafts) and the `step` run instead
    # advanced the policy twice, so the walk (the adaptive policy's exploration) skipped a K
    assert rounds.refused > 0
    assert rounds.walk.at == rounds.walk.ran, (rounds.walk.at, rounds.walk.ran)


def test_request_finished_in_plain_round_caches_its_mtp_kv(adaptive):
    """A request that finishes in an overlapped K = 0 round leaves the prefix cache the MTP
    KV the serial loop leaves (its deferred passes run before its slots are cached), not
    what the slots held before: requests that continue its output draft from that KV."""
    (((kv_on, kv_serial), ended), _), problem, n_on, _ = adaptive[0]["finished_in_plain_round"]
    assert problem is None and n_on > 0
    assert 0 in ended  # finished by an overlapped K = 0 round
    assert torch.allclose(kv_on, kv_serial, atol=1e-5, rtol=0)


def test_seeded_plain_round_after_drafts_runs_serially(adaptive):
    """A K = 0 round after a drafting round over a seeded sampled request falls back to a
    serial round (its stream's count is known on the host only once the drafting round is
    read); its tokens equal serial rounds'."""
    (((on, serial), refused), _), problem, n_on, _ = adaptive[0]["seeded_plain_after_drafts"]
    assert problem is None and n_on > 0
    assert on == serial
    assert 2 in refused  # the K = 0 round after the K = 2 one was not launched overlapped


# mostly K = 0: requests retracted with MTP passes deferred
RETRACT_WALK = (0, 0, 0, 2, 1, 0, 0, 2, 1, 0)


def noting_retractions(rounds: Rounds, retracted: list):
    """`walk_rounds` with RETRACT_WALK, and a note in `retracted` of each request retracted
    with deferred MTP passes: (its tokens, its prompt length, the MTP KV of its cached
    positions right after the retraction)."""

    def setup(engine: Engine) -> None:
        walk_rounds(rounds, RETRACT_WALK)(engine)
        kv = engine.tokenizer_manager.scheduler.kv
        retract = kv.retract

        def noting(victim, staying):
            deferred = victim.decoder_state is not None and victim.decoder_state.deferred
            ids, prompt_len = list(victim.all_ids), len(victim.origin_input_ids)
            retract(victim, staying)
            if deferred and victim.retracted:
                retracted.append((ids, prompt_len, mtp_kv_cached(engine, ids)))

        kv.retract = noting

    return setup


def retracted_again(retracted: list):
    """A scenario: the first request noted by `noting_retractions`, its tokens up to the
    retraction run again to a finish in serial K = 0 steps; (its MTP KV as the retraction
    cached it, as this finish caches it)."""

    def run(engine: Engine) -> tuple:
        ids, prompt_len, kv = retracted[0]
        sp = {**GREEDY, "max_new_tokens": len(ids) - prompt_len}

        def again():
            out = engine.generate(input_ids=ids[:prompt_len], sampling_params=sp)
            assert out["output_ids"] == ids[prompt_len:]
            return mtp_kv_cached(engine, ids)

        decoder = engine.tokenizer_manager.scheduler.decoder
        walk = decoder.draft_length
        try:
            assert engine.flush_cache()
            decoder.draft_length = ScriptedK(2, [], 0)
            decoder.can_overlap = lambda reqs: False
            return kv, again()
        finally:
            decoder.draft_length = walk
            del decoder.can_overlap

    return run


def test_adaptive_k_retractions_under_overlap(model_path, serial_retraction):
    """Retractions from a small KV pool while adaptive rounds of varying K overlap: the
    serial loop's tokens, the KV invariant intact; a request retracted with MTP passes
    deferred by its K = 0 rounds runs them as it leaves (`Decoder.leaving`): its cached
    positions have the MTP KV a finished request with its tokens leaves, not what their
    slots held before."""
    rounds, retracted = Rounds(), []
    scenarios = {"retraction": retraction, "retracted_again": retracted_again(retracted)}
    kw = {**ADAPTIVE, **SMALL_POOL}
    results = run_all(model_path, scenarios, noting_retractions(rounds, retracted), **kw)
    (on, problem_on, n_on, retracted_on) = results["retraction"]
    (off, problem_off, _, _) = serial_retraction
    assert problem_on is None and problem_off is None
    assert retracted_on > 0 and n_on > 0
    ks = {k for _, k in rounds.launched}
    assert 0 in ks and len(ks) > 1, rounds.launched
    assert on[0] == off[0]
    ((kv_retracted, kv_finished), _), problem, _, _ = results["retracted_again"]
    assert problem is None
    assert torch.allclose(kv_retracted, kv_finished, atol=1e-5, rtol=0)


def test_request_aborted_in_plain_rounds_caches_its_mtp_kv(adaptive):
    """A request aborted while its K = 0 rounds overlap leaves the prefix cache the MTP KV
    of its cached positions (the deferred passes run as it leaves), as a request with the
    same tokens that finishes does. Before, they kept what their slots held."""
    ((kv_aborted, kv_finished), _), problem, n_on, _ = adaptive[0]["aborted_in_plain_rounds"]
    assert problem is None and n_on > 0
    assert torch.allclose(kv_aborted, kv_finished, atol=1e-5, rtol=0)


def test_overlapped_rounds_draft_nothing_that_could_not_commit(model_path, baseline):
    """Under adaptive lengths an overlapped round (expand: ragged rows on the device) drafts
    for a request no more than could still commit: its tokens left less the one every step
    emits, less one more where the round in flight holds it (which commits at least one).
    Here the policy asks K = 2 every round; requests of 2 to 16 tokens reach their last
    tokens in overlapped rounds. Their tokens equal decoding's without MTP. (Before, only
    serial steps were capped: an overlapped round verified drafts past the last token.)"""
    lengths = [2, 3, 4, 5, 7, 16, 16, 16]
    engine = Engine(model_path=model_path, **COMMON, **ADAPTIVE, speculative_verify="expand")
    try:
        decoder = engine.tokenizer_manager.scheduler.decoder
        decoder.draft_length = WalkDraftLength(2, (2,))
        launch, seen = decoder.launch, []  # (drafts, drafts that could still commit) per row

        def noting(reqs, prev):
            could = [
                r.sampling_params.max_new_tokens
                - len(r.output_ids)
                - 1
                - (prev is not None and id(r) in prev.index)
                for r in reqs
            ]
            out = launch(reqs, prev)
            if out is not None:
                limits = out.limits or [out.k] * len(reqs)
                seen.extend(zip(limits, could))
            return out

        decoder.launch = noting
        params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
        outs = engine.generate(LOSSLESS_PROMPTS[: len(lengths)], params)
    finally:
        engine.shutdown()
    for i, (o, n) in enumerate(zip(outs, lengths)):
        assert o["output_ids"] == baseline[i]["output_ids"][:n], i
    assert all(k <= max(c, 0) for k, c in seen), seen
    assert any(k < 2 for k, _ in seen), seen  # capped rows ran in overlapped rounds
    assert any(k == 2 for k, _ in seen), seen
