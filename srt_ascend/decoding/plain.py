"""Plain decoding: one token per request per step."""

from __future__ import annotations

from srt_ascend.decoding.base import DECODERS, PLAIN, Decoder, StepRequest
from srt_ascend.model_executor.forward_batch import ForwardMode
from srt_ascend.sampling.sample_step import sample_rows


@DECODERS.register(PLAIN)
class PlainDecoder(Decoder):
    def __init__(self, args, handles) -> None:
        super().__init__(args, handles)
        self.kind = self.decode_kind()

    def step(self, reqs: list[StepRequest]) -> list[StepRequest]:
        reqs, loc = self.h.kv.alloc_running(reqs, 1)
        if not reqs:
            return []
        fb = self.runner.build_forward_batch(
            ForwardMode.DECODE,
            [r.all_ids[-1] for r in reqs],
            [r.req_pool_idx for r in reqs],
            [r.kv_len + 1 for r in reqs],
            [1] * len(reqs),
            loc,
        )
        hidden = self.runner.forward(fb, self.kind)
        for r in reqs:
            r.kv_len += 1
        logits = self.runner.compute_logits(hidden)
        res = sample_rows(logits, reqs, self.vocab, self.h.eos_ids)
        for i, r in enumerate(reqs):
            lps = None if res.logprobs is None else res.logprobs[i : i + 1]
            tops = None if res.top_logprobs is None else res.top_logprobs[i : i + 1]
            self.h.commit(r, [res.token_ids[i]], lps, tops)
        return reqs
