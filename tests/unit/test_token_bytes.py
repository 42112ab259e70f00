"""Token bytes for OpenAI logprobs: a byte-level BPE token's own bytes (fragments of a
character included), and distinct names for fragments."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from srt_ascend.entrypoints.token_bytes import TokenBytes
from srt_ascend.server_args import SHIPPED_MODEL

TEXT = "漢字🚀 naïve — def f(x):\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL, local_files_only=True)


def test_token_bytes_join_to_the_text(tokenizer):
    tb = TokenBytes(tokenizer)
    assert tb.byte_level
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = [tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in texts  # the text splits characters over tokens
    assert b"".join(bytes(tb.bytes_of(i, t)) for i, t in zip(ids, texts)).decode() == TEXT
    names = [tb.text_of(i, t) for i, t in zip(ids, texts)]
    assert all(n == t for n, t in zip(names, texts) if "\ufffd" not in t)
    fragments = {n for n, t in zip(names, texts) if "\ufffd" in t}
    assert len(fragments) > 1 and "\ufffd" not in "".join(fragments)


def test_other_tokenizers_fall_back_to_the_text():
    class Pieces:  # a SentencePiece-like vocabulary: "é" is one piece of its own
        def encode(self, text, add_special_tokens=False):
            return [5]

        def convert_ids_to_tokens(self, ids):
            return ["é"] if isinstance(ids, list) else "é"

    tb = TokenBytes(Pieces())
    assert not tb.byte_level
    assert tb.bytes_of(5, "é") == list("é".encode()) and tb.text_of(5, "\ufffd") == "\ufffd"
