"""Plain decoding: one token per request per step."""

from __future__ import annotations

from srt_ascend.decoding.base import DECODERS, PLAIN, Decoder, StepRequest
from srt_ascend.model_executor.forward_batch import ForwardMode


@DECODERS.register(PLAIN)
class PlainDecoder(Decoder):
    def __init__(self, args, handles) -> None:
        super().__init__(args, handles)
        self.kind = self.decode_kind()

    def step(self, reqs: list[StepRequest]) -> list[StepRequest]:
        reqs, loc = self.h.kv.alloc_running(reqs, 1)
        if not reqs:
            self.idle_step()
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
        self.sample_and_commit(reqs, self.runner.compute_logits(hidden))
        return reqs
