"""Stop conditions: EOS / stop_token_ids, stop strings and regexes, a terminated grammar,
max_new_tokens, context length."""

from __future__ import annotations

from srt_ascend.managers.schedule_batch import FinishReason, Req
from srt_ascend.sampling.sampling_params import compile_stop_regex

# stop_regex is searched in the text of the output's last STOP_REGEX_TAIL_TOKENS tokens, so a
# check costs the same at every length (a match longer than that text is not seen).
STOP_REGEX_TAIL_TOKENS = 64


class StopChecker:
    def __init__(self, tokenizer, eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer  # anything with decode(list[int]) -> str
        self.eos_ids = sorted(set(eos_ids))

    def check(self, req: Req, context_len: int) -> FinishReason | None:
        """Called after each committed token; returns why the request is done, if it is."""
        p = req.sampling_params
        last = req.output_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated:  # nothing may follow
            return FinishReason("stop", matched=last)
        if len(req.output_ids) >= p.min_new_tokens:
            if not p.ignore_eos and last in self.eos_ids:
                return FinishReason("stop", matched=last)
            if p.stop_token_ids and last in p.stop_token_ids:
                return FinishReason("stop", matched=last)
            if p.stop:
                matched = self._stop_string(req)
                if matched is not None:
                    return FinishReason("stop", matched=matched, stop_text=matched)
            if p.stop_regex:
                found = self._stop_regex(req)
                if found is not None:
                    pattern, text = found
                    return FinishReason("stop", matched=pattern, stop_text=text)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason("length", length=p.max_new_tokens)
        if req.seq_len >= context_len:
            return FinishReason("length", length=len(req.output_ids))
        return None

    def _stop_string(self, req: Req) -> str | None:
        """Decodes just enough trailing tokens to contain the longest stop string."""
        stops = req.sampling_params.stop
        tail_tokens = max(len(s) for s in stops) + 4
        tail = self.tokenizer.decode(req.output_ids[-tail_tokens:])
        for s in stops:
            if s in tail:
                return s
        return None

    def _stop_regex(self, req: Req) -> tuple[str, str] | None:
        """(pattern, the text it matched) of the first stop_regex found in the output's tail.
        RE2 searches in time linear in the tail, whatever the pattern (patterns were compiled,
        and refused if RE2 cannot take them, when the request was made)."""
        tail = self.tokenizer.decode(req.output_ids[-STOP_REGEX_TAIL_TOKENS:])
        for pattern in req.sampling_params.stop_regex:
            m = compile_stop_regex(pattern).search(tail)
            if m is not None:
                return pattern, m.group(0)
        return None
