"""--stream-interval N (SGLang's meaning): a streamed request gets its first token at once,
then outputs every N tokens, and the last output carries the rest with the finish reason;
the tokens are those of an unstreamed run."""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from srt_ascend import Engine

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
