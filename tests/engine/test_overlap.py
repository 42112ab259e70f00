"""Overlap scheduling (forced on: eager forwards on CPU run serially by default) gives what the
serial loop (`--disable-overlap-schedule`) gives, on the shipped checkpoint in float32: greedy
tokens, seeded samples, logprobs, `n > 1`, a stop string found one step late, a grammar request
beside overlapped ones, penalties (run serially), an abort while a step is in flight, retractions
from a small KV pool; and MTP rounds under overlap equal serial MTP rounds and plain decoding.
Each scenario runs on one engine per setting, which then must be idle with the KV invariant
intact (every slot and request row free or owned by the prefix cache)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from engine_prompts import PROMPTS

from srt_ascend import Engine
from srt_ascend.speculative.draft_length import FixedDraftLength

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
SMALL_POOL = {"max_total_tokens": 160, "chunked_prefill_size": 32}
COMMON = {"dtype": "float32", "num_threads": 2, "kv_invariant_check": "fatal"}
ON = {"enable_overlap_schedule": True}  # eager forwards on CPU: serial unless forced


def greedy(engine: Engine) -> list:
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def seeded(engine: Engine) -> list:
    params = [
        {"max_new_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 11 + i}
        for i in range(len(PROMPTS))
    ]
    params[1]["min_new_tokens"] = 12  # the stop mask counts the token in flight
    params[2]["top_k"] = 5
    return [o["output_ids"] for o in engine.generate(PROMPTS, params)]


def with_logprobs(outs: list) -> list:
    """Each output's tokens with its token and top logprobs."""
    meta = [o["meta_info"] for o in outs]
    return [
        (o["output_ids"], m["output_token_logprobs"], m["output_top_logprobs"])
        for o, m in zip(outs, meta)
    ]


def logprobs(engine: Engine) -> list:
    outs = engine.generate(PROMPTS[:4], GREEDY, return_logprob=True, top_logprobs_num=3)
    return with_logprobs(outs)


def n_samples(engine: Engine) -> list:
    sp = {"max_new_tokens": 16, "temperature": 0.8, "seed": 5, "n": 3}
    return [o["output_ids"] for o in engine.generate(PROMPTS[:2], sp)]


def stop_string(engine: Engine) -> list:
    """A stop string taken from the middle of a greedy output: the request that meets it is
    found finished after its next step was launched, whose token is dropped."""
    text = engine.generate(PROMPTS[0], GREEDY)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    params = [{**GREEDY, "stop": [stop]}] + [GREEDY] * 3
    outs = engine.generate(PROMPTS[:4], params)
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(outs[0]["output_ids"]) < GREEDY["max_new_tokens"]
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs]


def grammar_and_penalties(engine: Engine) -> list:
    """A regex request and a penalised one run their batches serially; the others overlap
    before they join and after they leave."""
    params = [GREEDY] * len(PROMPTS)
    params[2] = {"max_new_tokens": 10, "temperature": 0, "regex": r"[a-z]{2,6} = [0-9]{1,3}"}
    params[5] = {**GREEDY, "max_new_tokens": 6, "frequency_penalty": 0.5}
    outs = engine.generate(PROMPTS, params)
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]


def abort_in_flight(engine: Engine) -> list:
    """A streamed request closed after three chunks while the others decode: the abort lands
    between a launch and its commit."""
    tm = engine.tokenizer_manager
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def run():
        reqs = [tm.make_request(tm.tokenize(p), GREEDY) for p in PROMPTS[:4]]
        streamed = tm.make_request(tm.tokenize(PROMPTS[4]), long, stream=True)

        async def one(r):
            last = None
            async for out in tm.generate_one(r):
                last = out
            return last

        async def cut():
            agen, chunks = tm.generate_one(streamed), 0
            async for _ in agen:
                chunks += 1
                if chunks == 3:
                    break
            await agen.aclose()
            return chunks

        return await asyncio.gather(*(one(r) for r in reqs), cut())

    *outs, chunks = asyncio.run_coroutine_threadsafe(run(), engine.loop).result()
    assert chunks == 3
    return [o["output_ids"] for o in outs]


def late_join(engine: Engine) -> list:
    """Requests that arrive while a streamed one decodes: the overlapped steps end (their
    prefill runs serially) with the streamed request unfinished, and start again."""
    tm = engine.tokenizer_manager
    long = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def run():
        first = tm.make_request(tm.tokenize(PROMPTS[5]), long, stream=True)

        async def streamed():
            chunks, ids = 0, None
            async for out in tm.generate_one(first):
                chunks += 1
                ids = out["output_ids"]
                if chunks == 4:
                    others.set_result(None)
            return ids

        others = asyncio.get_running_loop().create_future()

        async def joined(p):
            await others
            r = tm.make_request(tm.tokenize(p), GREEDY)
            last = None
            async for out in tm.generate_one(r):
                last = out
            return last["output_ids"]

        return await asyncio.gather(streamed(), *(joined(p) for p in PROMPTS[:3]))

    return asyncio.run_coroutine_threadsafe(run(), engine.loop).result()


def seeded_logprobs(engine: Engine) -> list:
    """Sampled requests with seeds of their own, with and without top_p / top_k: tokens and
    logprobs (an MTP round's seeded streams follow its committed count, which an overlapped
    round has on the device only)."""
    params = [
        {"max_new_tokens": 10, "temperature": 0.7 + 0.2 * i, "seed": 101 + i, "ignore_eos": True}
        for i in range(4)
    ]
    params[1]["top_p"] = 0.9
    params[2]["top_k"] = 8
    params[3].update(top_p=0.8, top_k=20)
    outs = engine.generate(PROMPTS[:4], params, return_logprob=True, top_logprobs_num=2)
    return with_logprobs(outs)


def mixed_sampling(engine: Engine) -> list:
    """Seeded, unseeded sampled and greedy requests in one batch: the seeded and greedy
    ones' tokens (the unseeded ones draw from the global RNG)."""
    kinds = [
        {"temperature": 0.9, "top_p": 0.95, "seed": 7},
        {"temperature": 1.0},
        {"temperature": 0},
        {"temperature": 0.8, "top_k": 10, "seed": 8},
        {"temperature": 0.8},
        {"temperature": 1.0, "seed": 9},
    ]
    params = [{**kind, "max_new_tokens": 10, "ignore_eos": True} for kind in kinds]
    outs = engine.generate(PROMPTS[: len(params)], params)
    return [o["output_ids"] for o, p in zip(outs, params) if "seed" in p or not p["temperature"]]


def edge_requests(engine: Engine) -> list:
    """Requests that end inside their first rounds (max_new_tokens 1 and 2, greedy and
    seeded), one stopped by a stop token id met inside an accepted draft block, and a seeded
    sampled one whose min_new_tokens runs out mid-run (its batch turns from serial rounds to
    overlapped ones), all with input logprobs from logprob_start_len, top logprobs and
    token_ids_logprob."""
    ahead = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 6})["output_ids"]
    params = [
        {**GREEDY, "max_new_tokens": 1},
        {"max_new_tokens": 2, "temperature": 0.9, "seed": 4},
        {**GREEDY, "ignore_eos": False, "stop_token_ids": [ahead[5]]},
        {"max_new_tokens": 14, "temperature": 0.8, "seed": 5, "min_new_tokens": 6},
        {**GREEDY, "max_new_tokens": 2},
    ]
    outs = engine.generate(
        [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[4]],
        params,
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=2,
        token_ids_logprob=[5, 100],
    )
    assert outs[2]["meta_info"]["finish_reason"]["matched"] == ahead[5]
    meta = [o["meta_info"] for o in outs]
    keys = ("finish_reason", "input_token_logprobs", "output_token_ids_logprobs")
    return [(*lp, *(m[k] for k in keys)) for lp, m in zip(with_logprobs(outs), meta)]


def retraction(engine: Engine) -> list:
    prompts = PROMPTS + [p + " x" for p in PROMPTS]
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 12})
    return [o["output_ids"] for o in outs]


SCENARIOS = {
    f.__name__: f for f in (greedy, seeded, logprobs, n_samples, stop_string, grammar_and_penalties)
}
SCENARIOS["abort_in_flight"] = abort_in_flight
SCENARIOS["late_join"] = late_join


def idle_problem(engine: Engine) -> str | None:
    """Waits for the scheduler to go idle (an abort is handled after its client left), then
    the KV invariant's verdict."""
    scheduler = engine.tokenizer_manager.scheduler
    for _ in range(500):
        state = engine.get_internal_state()
        if not scheduler.has_work() and state["num_running_reqs"] == 0:
            return scheduler.idle_invariant_problem()
        time.sleep(0.01)
    return "the scheduler did not go idle"


def run_all(model_path: str, scenarios: dict, setup=None, **kw) -> dict:
    """Each scenario's result, the KV invariant after it, and how many steps overlapped;
    `setup(engine)` first, if given."""
    engine = Engine(model_path=model_path, **COMMON, **kw)
    try:
        if setup is not None:
            setup(engine)
        results = {}
        for name, scenario in scenarios.items():
            before = engine.get_internal_state()["num_overlapped_steps"]
            out = scenario(engine)
            problem = idle_problem(engine)
            state = engine.get_internal_state()
            overlapped = state["num_overlapped_steps"] - before
            # the prefix cache as the serial loop leaves it: a step's token found one step late
            # is dropped, its KV position freed (aborts aside, whose timing differs, and
            # unseeded samples, whose tokens differ)
            compared = name not in ("abort_in_flight", "mixed_sampling")
            cached = state["cached_tokens_in_tree"] if compared else None
            results[name] = ((out, cached), problem, overlapped, state["num_retractions"])
        return results
    finally:
        engine.shutdown()


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
    """`retraction` in the serial loop without MTP, with the small pool."""
    scenarios = {"retraction": retraction}
    return run_all(model_path, scenarios, disable_overlap_schedule=True, **SMALL_POOL)["retraction"]


def test_retractions_under_overlap(model_path, serial_retraction):
    scenarios = {"retraction": retraction}
    (off, problem_off, _, retracted_off) = serial_retraction
    (on, problem_on, overlapped_on, retracted_on) = run_all(
        model_path, scenarios, **ON, **SMALL_POOL
    )["retraction"]
    assert problem_off is None and problem_on is None
    assert retracted_off > 0 and retracted_on > 0 and overlapped_on > 0
    assert on == off


MTP = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
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


def same_logprobs(a: list, b: list) -> bool:
    """Outputs of `logprobs` equal: tokens exactly, logprobs within float32 noise (an
    overlapped round's attention is written in tensor ops over the device lengths)."""

    def flat(x):
        if isinstance(x, (list, tuple)):
            return [v for item in x for v in flat(item)]
        return [x]

    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(
        x == y if not isinstance(x, float) else abs(x - y) < 1e-4 for x, y in zip(fa, fb)
    )


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
