"""Incremental detokenization with SGLang's output conventions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeState:
    """Cumulative text of one request; holds back an incomplete trailing UTF-8 sequence."""

    skip_special_tokens: bool = True
    output_ids: list[int] = field(default_factory=list)
    text: str = ""

    def update(self, tokenizer, new_ids: list[int], final: bool) -> str:
        self.output_ids.extend(new_ids)
        text = tokenizer.decode(self.output_ids, skip_special_tokens=self.skip_special_tokens)
        if not final:
            text = text.rstrip("\ufffd")
        self.text = text
        return text


def trim_stop(text: str, finish_reason: dict | None, no_stop_trim: bool) -> str:
    """A matched stop string and whatever follows it are removed from the returned text."""
    if no_stop_trim or not finish_reason or finish_reason.get("type") != "stop":
        return text
    matched = finish_reason.get("matched")
    if isinstance(matched, str) and matched:
        idx = text.find(matched)
        if idx != -1:
            return text[:idx]
    return text
