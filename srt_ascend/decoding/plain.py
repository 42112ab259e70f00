"""Plain decoding: one token per request per step."""

from __future__ import annotations

from srt_ascend.decoding.base import DECODERS, PLAIN, Decoder, StepRequest


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
        self.decode_and_commit(reqs, loc, self.kind)
        return reqs
