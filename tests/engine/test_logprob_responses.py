"""A request's logprob entries take their response form once, when they arrive: every later
response of the request shares those entries (it copies only the outer lists), so a step
costs the new tokens' logprobs, not all of them so far again. The OpenAI routes name tokens
through a cache that decodes each vocabulary id once."""

from __future__ import annotations

from engine_prompts import PROMPTS

from srt_ascend import Engine
from srt_ascend.entrypoints.serving import Serving

TOKENS = 40
TOP = 20


def test_streamed_responses_share_entries_built_once(model_path):
    engine = Engine(model_path=model_path, dtype="float32")
    try:
        tm = engine.tokenizer_manager
        params = {"max_new_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True}
        req = tm.make_request(
            tm.tokenize(PROMPTS[0]),
            params,
            return_logprob=True,
            top_logprobs_num=TOP,
            stream=True,
        )

        async def run():
            return [out async for out in tm.generate_one(req)]

        outs = engine._run(run())
    finally:
        engine.shutdown()
    metas = [o["meta_info"] for o in outs]
    assert len(metas) == TOKENS  # one response a token (--stream-interval 1)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        lengths = [len(m[key]) for m in metas]
        assert lengths == list(range(1, TOKENS + 1)), (key, lengths)
        last = metas[-1][key]
        for m in metas[:-1]:
            # the same entry objects: no response rebuilt an earlier position's entries
            assert all(a is b for a, b in zip(m[key], last)), key
        # and each response has its own outer list (a client may keep or change one)
        assert len({id(m[key]) for m in metas}) == TOKENS
    assert all(len(top) == TOP for top in metas[-1]["output_top_logprobs"])


class _CountingTokenizer:
    def __init__(self):
        self.calls = []

    def decode(self, ids):
        self.calls.append(tuple(ids))
        return f"<{ids[0]}>"


class _TM:
    def __init__(self):
        self.tokenizer = _CountingTokenizer()


def test_token_texts_decode_each_vocabulary_id_once():
    serving = Serving.__new__(Serving)  # only token_texts and its cache are used
    serving.tm = _TM()
    ids = [5, 7, 5, 9, 7, 7]
    assert serving.token_texts(ids) == ["<5>", "<7>", "<5>", "<9>", "<7>", "<7>"]
    assert serving.token_texts([9, 5, 11]) == ["<9>", "<5>", "<11>"]
    assert sorted(serving.tm.tokenizer.calls) == [(5,), (7,), (9,), (11,)]
