"""Incremental detokenization with SGLang's output conventions."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
HOLD_BACK_MAX_CHARS = 256  # the longest start of a stop string a stream holds back


@dataclass
class DecodeState:
    """Cumulative text of one request, decoded incrementally (SGLang's offsets).

    `committed` is the text of `output_ids[:read_offset]`. Each step decodes only the window
    `output_ids[surr_offset:]` and keeps what follows the decoded surrogate context
    `output_ids[surr_offset:read_offset]`, so byte-level merges and leading-space rules at the
    window start come out as in a full decode, while a step costs O(window), not O(output).
    The window moves forward only when its new text does not end in an incomplete UTF-8
    sequence; until then the tail is held back (and stays in the window for the next step).
    The resulting `text` equals `decode(output_ids)` with a trailing U+FFFD run stripped
    while unfinished, and exactly `decode(output_ids)` on the final step.
    """

    skip_special_tokens: bool = True
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    committed: str = ""
    surr_offset: int = 0
    read_offset: int = 0

    def update(self, tokenizer, new_ids: list[int], final: bool, drop_last: bool = False) -> str:
        """Appends `new_ids` and returns the cumulative text (also kept in `self.text`).
        `drop_last` (final steps only): the text leaves out the last token, a matched stop
        token that is trimmed as SGLang's detokenizer trims it (`output_ids` keep it)."""
        self.output_ids.extend(new_ids)
        skip = self.skip_special_tokens
        end = len(self.output_ids) - 1 if final and drop_last else len(self.output_ids)
        if end < self.read_offset:
            # the dropped token was committed by an earlier step: decode the whole output
            self.text = tokenizer.decode(self.output_ids[:end], skip_special_tokens=skip)
            return self.text
        window = self.output_ids[self.surr_offset : end]
        context_len = self.read_offset - self.surr_offset
        surr_text = tokenizer.decode(window[:context_len], skip_special_tokens=skip)
        new_text = tokenizer.decode(window, skip_special_tokens=skip)[len(surr_text) :]
        if final:
            self.text = self.committed + new_text
        elif new_text and not new_text.endswith(REPLACEMENT):
            self.committed += new_text
            self.surr_offset, self.read_offset = self.read_offset, len(self.output_ids)
            self.text = self.committed
        else:
            self.text = self.committed + new_text.rstrip(REPLACEMENT)
        return self.text


def trim_stop(text: str, stop_text: str | None, no_stop_trim: bool) -> str:
    """The text a stop string or stop_regex matched (`stop_text`, None when the request did
    not stop on one) and whatever follows it are removed from the returned text (a matched
    stop token is left out by `DecodeState.update`'s `drop_last`)."""
    if no_stop_trim or not stop_text:
        return text
    idx = text.find(stop_text)
    return text[:idx] if idx != -1 else text


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings ordered for `hold_back_stop_prefix` (built once per request)."""

    ordered: tuple[str, ...]  # sorted, without repeats
    firsts: frozenset[str]  # their first characters

    @classmethod
    def of(cls, stops: list[str]) -> StopStrings:
        ordered = tuple(sorted({s for s in stops if s}))
        return cls(ordered, frozenset(s[0] for s in ordered))


def hold_back_stop_prefix(text: str, stops: StopStrings) -> str:
    """A streamed text without its longest tail that begins a stop string: that text is
    trimmed if the stop string completes, so it is sent only once it cannot (streamed chunks
    then add up to the final text). Tails up to HOLD_BACK_MAX_CHARS characters are checked,
    each by a binary search of the sorted stop strings, so a step costs the same however many
    and however long the stop strings are."""
    tail = text[-HOLD_BACK_MAX_CHARS:]
    ordered = stops.ordered
    for i, ch in enumerate(tail):
        if ch not in stops.firsts:
            continue
        rest = tail[i:]
        j = bisect.bisect_left(ordered, rest)
        # the stop strings that begin with `rest` sort from j on (`rest` itself first if it
        # is one: complete, it would have ended the output, so only a longer one counts)
        if any(len(s) > len(rest) and s.startswith(rest) for s in ordered[j : j + 2]):
            return text[: len(text) - len(rest)]
    return text
