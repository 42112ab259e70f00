"""--stream-interval N (SGLang's meaning): a streamed request gets its first token at once,
then outputs every N tokens, and the last output carries the rest with the finish reason;
the tokens are those of an unstreamed run. An unstreamed request's outputs leave the
scheduler at its first token, every FORCE_STREAM_INTERVAL (50) tokens and at its finish,
as SGLang sends them; its response is the same."""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from srt_ascend import Engine
from srt_ascend.managers.scheduler_decode import FORCE_STREAM_INTERVAL, _force_stream_interval

GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}
SPEC = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}


def _streamed_lengths(engine: Engine) -> tuple[list[int], list[int]]:
    """Cumulative output lengths of each streamed response, and the final output ids."""
    tm = engine.tokenizer_manager
    req = tm.make_request(tm.tokenize(PROMPTS[0]), dict(GREEDY), stream=True)

    async def run():
        return [out async for out in tm.generate_one(req)]

    outs = engine._run(run())
    return [len(o["output_ids"]) for o in outs], outs[-1]["output_ids"]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
def test_stream_interval_sends_every_n_tokens(model_path, spec):
    kw = SPEC if spec else {}
    engine = Engine(model_path=model_path, dtype="float32", stream_interval=4, **kw)
    try:
        ref = engine.generate(PROMPTS[0], GREEDY)["output_ids"]
        lengths, ids = _streamed_lengths(engine)
        assert ids == ref
        assert lengths[0] >= 1 and lengths[-1] == GREEDY["max_new_tokens"]
        sent = [b - a for a, b in zip(lengths, lengths[1:])]
        # every output but the first and the last brings 4 or more tokens (MTP: a step may
        # commit up to 3, so an output brings 4 to 6)
        assert all(4 <= n <= (6 if spec else 4) for n in sent[:-1]), lengths
        assert 1 <= sent[-1] <= (6 if spec else 4), lengths
        if not spec:
            assert lengths == [1, 5, 9, 13, 14]
    finally:
        engine.shutdown()


def test_stream_interval_one_streams_every_token(model_path):
    engine = Engine(model_path=model_path, dtype="float32")
    try:
        lengths, _ = _streamed_lengths(engine)
        assert lengths == list(range(1, GREEDY["max_new_tokens"] + 1))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
def test_unstreamed_requests_leave_the_scheduler_every_50_tokens(model_path, spec):
    """120 tokens unstreamed: outputs at the first token, whenever 50 or more wait (MTP: a step
    commits up to 3) and at the finish; the tokens and the response equal a streamed run's
    last, and the streamed run still sends every token."""
    kw = SPEC if spec else {}
    engine = Engine(model_path=model_path, dtype="float32", **kw)
    try:
        sched = engine.tokenizer_manager.scheduler
        emit, sent = sched.emit, {}

        def counting(outputs):
            for o in outputs:
                sent.setdefault(o.rid.split("#")[0], []).append(o.completion_tokens)
            emit(outputs)

        sched.emit = counting
        long = {**GREEDY, "max_new_tokens": 120}
        unstreamed = engine.generate(PROMPTS[1], long, rid="quiet")
        streamed = list(engine.generate(PROMPTS[1], long, rid="loud", stream=True))
    finally:
        engine.shutdown()
    assert unstreamed["output_ids"] == streamed[-1]["output_ids"]
    assert unstreamed["text"] == streamed[-1]["text"]
    quiet, loud = sent["quiet"], sent["loud"]
    assert quiet[0] == 1 and quiet[-1] == 120, quiet
    gaps = [b - a for a, b in zip(quiet, quiet[1:])]
    assert all(FORCE_STREAM_INTERVAL <= g <= FORCE_STREAM_INTERVAL + 2 for g in gaps[:-1]), quiet
    assert 2 <= len(quiet) <= 4 and 1 <= gaps[-1] <= FORCE_STREAM_INTERVAL + 2, quiet
    assert len(loud) >= (40 if spec else 120), loud  # a streamed request: every step


def test_force_stream_interval_reads_sglangs_variable(monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_FORCE_STREAM_INTERVAL", raising=False)
    assert _force_stream_interval() == 50
    monkeypatch.setenv("SGLANG_FORCE_STREAM_INTERVAL", "7")
    assert _force_stream_interval() == 7
    for bad in ("0", "-3", "abc", ""):
        monkeypatch.setenv("SGLANG_FORCE_STREAM_INTERVAL", bad)
        caplog.clear()
        assert _force_stream_interval() == 50
        assert "SGLANG_FORCE_STREAM_INTERVAL" in caplog.text
