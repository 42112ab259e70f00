"""`serving.merge_streams` (the streams of a batch or of n samples, for /generate, the OpenAI
routes and Engine): a stream that ends in CancelledError of its own (it awaited a future
that was cancelled) ends the merge with it, and the other streams are closed; the merge
waited for that stream's end marker forever."""

from __future__ import annotations

import asyncio

from srt_ascend.entrypoints.serving import merge_streams


def test_a_stream_ending_cancelled_ends_the_merge_and_closes_the_others() -> None:
    closed = []

    async def cancelled_inside():
        yield {"step": 0}
        fut = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut  # raises CancelledError, as a cancelled compile future does

    async def never_ends():
        try:
            yield {"step": 0}
            await asyncio.Event().wait()
            yield {"step": 1}
        finally:
            closed.append(True)

    async def consume() -> tuple[str, int]:
        got = 0
        try:
            async for _ in merge_streams([cancelled_inside(), never_ends()]):
                got += 1
        except asyncio.CancelledError:
            return "cancelled", got
        return "ended", got

    async def main():
        task = asyncio.ensure_future(consume())
        done, _ = await asyncio.wait({task}, timeout=10)
        if not done:  # hung: end it, and say so
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "hung"
        return task.result()

    assert asyncio.run(main())[0] == "cancelled"
    assert closed == [True]
