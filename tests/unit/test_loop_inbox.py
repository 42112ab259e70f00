"""The scheduler -> event loop hand-off (LoopInbox): every item delivered once, in order, and
the loop woken once per drain rather than once per put."""

from __future__ import annotations

import asyncio
import threading

from srt_ascend.managers.tokenizer_manager import LoopInbox


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts its thread-safe wake-ups."""

    wakes = 0

    def call_soon_threadsafe(self, *args, **kw):
        self.wakes += 1
        return super().call_soon_threadsafe(*args, **kw)


def test_puts_before_a_drain_share_one_wake_up_and_keep_their_order():
    loop, got = CountingLoop(), []
    inbox = LoopInbox(lambda items: got.append(list(items)))
    try:
        inbox.put(loop, [1, 2])
        inbox.put(loop, [3])  # the loop has not run yet: no second wake-up
        assert loop.wakes == 1 and got == []
        loop.run_until_complete(asyncio.sleep(0))
        assert got == [[1, 2, 3]]
        inbox.put(loop, [4])  # drained: the next put wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert loop.wakes == 2 and got == [[1, 2, 3], [4]]
    finally:
        loop.close()


def test_items_from_another_thread_all_arrive_in_order():
    loop, got = asyncio.new_event_loop(), []
    inbox = LoopInbox(got.extend)
    done = threading.Event()

    def sender():
        for i in range(2000):
            inbox.put(loop, [i])
        loop.call_soon_threadsafe(done.set)

    async def until_done():
        while not done.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the drain queued before `done.set` has run

    try:
        thread = threading.Thread(target=sender)
        thread.start()
        loop.run_until_complete(until_done())
        thread.join()
        assert got == list(range(2000))
    finally:
        loop.close()
