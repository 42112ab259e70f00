"""Token bytes and texts for OpenAI logprobs, as SGLang reports them: a byte-level BPE token
that holds only part of a character decodes to U+FFFD, so its true bytes come from its
vocabulary piece (GPT-2's byte-to-character map, inverted)."""

from __future__ import annotations

import functools

REPLACEMENT = "\ufffd"


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: vocabulary character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


class TokenBytes:
    """Raw bytes of a token id, for tokenizers whose vocabulary is byte-level BPE (probed
    once: "é" is the two pieces of its UTF-8 bytes there); other tokenizers fall back to the
    UTF-8 of the token's text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = tokenizer.encode("é", add_special_tokens=False)
        self.byte_level = "".join(tokenizer.convert_ids_to_tokens(ids)) == "Ã©"

    def raw(self, token_id: int) -> bytes | None:
        """The token's bytes, None where the vocabulary does not say (not byte-level)."""
        if not self.byte_level:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if not piece or any(ch not in decoder for ch in piece):
            return None
        return bytes(decoder[ch] for ch in piece)

    def bytes_of(self, token_id: int, text: str) -> list[int]:
        """OpenAI's chat logprob `bytes`: the token's own bytes (fragments of a character
        included, so a client can join them), else the UTF-8 of its text."""
        raw = self.raw(token_id) if REPLACEMENT in text else None
        return list(raw) if raw is not None else list(text.encode("utf-8"))

    def text_of(self, token_id: int, text: str) -> str:
        """A completion logprob's token string: its text, but a fragment of a character (bytes
        that are not UTF-8) as one latin-1 character per byte, so distinct fragments stay
        distinct (they are top_logprobs' keys)."""
        raw = self.raw(token_id) if REPLACEMENT in text else None
        if raw is None:
            return text
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("latin-1")
        return text
