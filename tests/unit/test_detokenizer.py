"""Incremental detokenization: the streamed text equals a full decode at every step
(trailing incomplete UTF-8 held back), including tokens that split multi-byte characters,
and each step decodes only a window of the output, not all of it."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from srt_ascend.managers.detokenizer import DecodeState, StopStrings, hold_back_stop_prefix
from srt_ascend.server_args import SHIPPED_MODEL

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "漢字とかなの混じった文章、そして絵文字 🚀🎉 と Ελληνικά.",
    "naïve café — “quotes” and ∑ maths ≤ ∞ 👩‍👩‍👧",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)


def _splits_a_character(tokenizer, ids: list[int]) -> bool:
    return any("\ufffd" in tokenizer.decode([i]) for i in ids)


def _stream(tokenizer, ids: list[int], chunks: list[int], skip: bool) -> None:
    state = DecodeState(skip_special_tokens=skip)
    pos = 0
    for n, size in enumerate(chunks):
        new = ids[pos : pos + size]
        pos += size
        final = n == len(chunks) - 1
        text = state.update(tokenizer, new, final)
        full = tokenizer.decode(ids[:pos], skip_special_tokens=skip)
        assert text == (full if final else full.rstrip("\ufffd")), (pos, text, full)
        assert state.text == text


@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode_at_every_step(tokenizer, skip):
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if text != TEXTS[0]:
            assert _splits_a_character(tokenizer, ids), "the test needs split characters"
        ids = ids[:7] + [specials[0]] + ids[7:]  # a special token in the middle
        for _ in range(10):
            chunks, left = [], len(ids)
            while left:
                chunks.append(min(left, rng.randint(1, 4)))
                left -= chunks[-1]
            _stream(tokenizer, ids, chunks, skip)


def test_random_ids_including_invalid_utf8(tokenizer):
    rng = random.Random(1)
    vocab = tokenizer.vocab_size
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        _stream(tokenizer, ids, [1] * len(ids), skip=True)


def test_each_step_decodes_a_bounded_window(tokenizer):
    """O(new tokens): the decoded window stays small however long the output grows."""
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(TEXTS[0] * 20, add_special_tokens=False)
    state = DecodeState()
    for i, t in enumerate(ids):
        state.update(Counting(), [t], final=i == len(ids) - 1)
    assert len(ids) > 300
    assert max(calls) <= 8
    assert state.text == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_a_matched_stop_token_is_left_out_of_the_final_text(tokenizer, skip):
    """SGLang's trim: the final text of an output that ended on a stop token (EOS, or an
    ordinary token from stop_token_ids) is the decode of the output without it (output_ids
    keep it), also when the token came in an earlier, unfinished step."""
    rng = random.Random(2)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for stop in (tokenizer.eos_token_id, ids[3]):
            out = ids + [stop]
            for head in (out[:-1], out):  # the stop token in the final step, or before it
                state = DecodeState(skip_special_tokens=skip)
                pos = 0
                while pos < len(head):
                    size = min(len(head) - pos, rng.randint(1, 4))
                    state.update(tokenizer, head[pos : pos + size], final=False)
                    pos += size
                final = state.update(tokenizer, out[pos:], final=True, drop_last=True)
                assert final == tokenizer.decode(ids, skip_special_tokens=skip)
                assert state.output_ids == out


def test_a_stream_holds_back_the_start_of_a_stop_string():
    """The longest tail that begins a stop string is held back (it is trimmed if the stop
    string completes); a held text only grows as the output does."""
    assert hold_back_stop_prefix("f, f,", StopStrings.of([", f!"])) == "f, f"
    assert hold_back_stop_prefix("xabcab", StopStrings.of(["abcabd", "b!"])) == "x"
    assert hold_back_stop_prefix("hello", StopStrings.of(["lo!", "o"])) == "hel"
    assert hold_back_stop_prefix("hello", StopStrings.of(["xyz"])) == "hello"
    # a longer stop string than the one the tail completes
    assert hold_back_stop_prefix("xab", StopStrings.of(["ab", "abd", "abc"])) == "x"
    many = [f"{i:04d}" + "x" * 10**5 for i in range(300)]  # a step stays cheap: one search
    assert hold_back_stop_prefix("id 0299xx", StopStrings.of(many)) == "id "
    out, stop, held = "say: a, b, c, END", "C, END!", []
    for n in range(len(out) + 1):
        held.append(hold_back_stop_prefix(out[:n], StopStrings.of([stop, "END"])))
    assert all(b.startswith(a) for a, b in zip(held, held[1:]))
