"""Streaming a batch costs time linear in its size: `Serving.stream_all` hands out each
request's outputs as they come, and its cost per output does not grow with the batch.

The requests come from a stand-in for the tokenizer manager whose requests produce in small
groups, one group per pass of the event loop, as a scheduler step serves a few of a long
queue (the runtime's part is not what is measured here). The test times streaming batches
of 1000 and 8000 requests (the best of three runs each, garbage collection off): linear
handling takes about 8 times as long for 8 times the requests (7.5 to 9.6 measured), waiting
on every request's next output at once grows faster (25.6 measured on the code before the
fix): the bound, 14, is met by growth up to about N^1.27 and fails above."""

from __future__ import annotations

import asyncio
import gc
import time

from srt_ascend.entrypoints.serving import Serving
from srt_ascend.managers.io_struct import TokenizedGenerateReq
from srt_ascend.sampling.sampling_params import SamplingParams
from srt_ascend.server_args import ServerArgs

OUTPUTS = 4
GROUP = 8
SMALL, LARGE, RATIO_BOUND = 1000, 8000, 14.0


class StaggeredOutputs:
    """What Serving reads of a TokenizerManager: `generate_one`. Requests produce in groups
    of GROUP, one group per pass of the event loop (as a scheduler step serves a batch of
    the queue), each OUTPUTS outputs, the last with a finish reason. Its own cost is linear:
    each request waits on its group's event, set once."""

    def __init__(self) -> None:
        self.events: dict[int, asyncio.Event] = {}

    def event(self, group: int) -> asyncio.Event:
        return self.events.setdefault(group, asyncio.Event())

    async def drive(self, n: int) -> None:
        """Lets the groups produce, one per pass of the loop."""
        for group in range(-(-n // GROUP)):
            self.event(group).set()
            await asyncio.sleep(0)

    async def generate_one(self, req: TokenizedGenerateReq):
        await self.event(int(req.rid[1:]) // GROUP).wait()
        for k in range(1, OUTPUTS + 1):
            await asyncio.sleep(0)
            finish = {"type": "length", "length": k} if k == OUTPUTS else None
            meta = {"finish_reason": finish, "prompt_tokens": 1, "completion_tokens": k}
            yield {"text": "", "output_ids": list(range(k)), "meta_info": meta}


def _stream_time(serving: Serving, n: int) -> float:
    params = SamplingParams(max_new_tokens=OUTPUTS)
    reqs = [TokenizedGenerateReq(f"r{i}", [1], params, stream=True) for i in range(n)]
    serving.tm.events.clear()

    async def stream() -> list[int]:
        driver = asyncio.ensure_future(serving.tm.drive(n))
        seen = [i async for i, _ in serving.stream_all(reqs)]
        await driver
        return seen

    gc.collect()
    gc.disable()  # a collection's cost depends on every live object, not on this work
    try:
        start = time.perf_counter()
        seen = asyncio.run(stream())
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    assert sorted(seen) == sorted(list(range(n)) * OUTPUTS)
    return elapsed


def test_streaming_a_batch_is_linear_in_its_size():
    serving = Serving(StaggeredOutputs(), ServerArgs())
    small = min(_stream_time(serving, SMALL) for _ in range(3))
    large = min(_stream_time(serving, LARGE) for _ in range(3))
    assert large / small < RATIO_BOUND, (small, large)


def test_a_failing_request_ends_the_stream_and_cancels_the_others():
    class OneFails(StaggeredOutputs):
        async def generate_one(self, req):
            if req.rid == "r1":
                raise ValueError("bad request r1")
            async for out in super().generate_one(req):
                yield out

    serving = Serving(OneFails(), ServerArgs())
    params = SamplingParams(max_new_tokens=OUTPUTS)
    reqs = [TokenizedGenerateReq(f"r{i}", [1], params, stream=True) for i in range(3)]

    async def stream():
        return [i async for i, _ in serving.stream_all(reqs)]

    try:
        asyncio.run(stream())
    except ValueError as e:
        assert "bad request r1" in str(e)
    else:
        raise AssertionError("the failing request's error did not reach the stream")
