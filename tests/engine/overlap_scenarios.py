"""The overlap tests' scenarios and their runner (a module of its own: test_overlap and
test_overlap_adaptive import it by a name no other test directory uses). Each scenario runs
requests on an engine and returns what the serial loop must equal; `run_all` runs scenarios on
one engine per setting, which then must be idle with the KV invariant intact (every slot and
request row free or owned by the prefix cache)."""

from __future__ import annotations

import asyncio
import time

from engine_prompts import PROMPTS

from srt_ascend import Engine

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


MTP = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}


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


def serial_retraction_run(model_path: str) -> tuple:
    """`retraction` in the serial loop without MTP, with the small pool."""
    scenarios = {"retraction": retraction}
    return run_all(model_path, scenarios, disable_overlap_schedule=True, **SMALL_POOL)["retraction"]
