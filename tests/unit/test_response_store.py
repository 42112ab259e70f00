"""The Responses API's store is bounded in bytes as well as in count: a few huge responses
cannot grow the server's memory past STORE_MAX_BYTES."""

from __future__ import annotations

import gc
import sys
import types

from srt_ascend.entrypoints.openai_responses import ResponsesRequest, ResponsesServing
from srt_ascend.entrypoints.response_store import STORE_MAX_BYTES, ResponseStore


def test_response_store_is_bounded_in_bytes_and_count():
    store = ResponseStore(max_items=3, max_bytes=10_000)
    text = "x" * 3000
    for i in range(5):
        assert store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": text}])
        assert store.nbytes <= 10_000
    assert len(store) == 3 and store.get("r0") is None and store.get("r1") is None
    body, turn = store.get("r4")
    assert body == {"id": "r4"} and turn == [{"role": "user", "content": text}]
    assert not store.put("huge", {"id": "huge"}, [{"role": "user", "content": "y" * 20_000}])
    assert store.get("huge") is None and store.get("r4") is not None
    small = ResponseStore(max_items=2, max_bytes=10_000)
    for i in range(3):
        small.put(f"s{i}", {"id": f"s{i}"}, [])
    assert [small.get(f"s{i}") is not None for i in range(3)] == [False, True, True]


def deep_size(root: object) -> int:
    """Bytes of every object reachable from `root` (each counted once), classes and modules
    left out: what a store holds in memory."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def test_responses_route_keeps_at_most_the_byte_bound():
    """100 stored responses of 2 MB through the route's finishing step: what the store holds
    stays within STORE_MAX_BYTES (64 MiB); before the bound it held all 200 MB."""
    serving = ResponsesServing(serving=None, chat_ids=None)
    obj = ResponsesRequest(input="hi")
    meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": 1, "completion_tokens": 1}
    meta["cached_tokens"] = 0
    for i in range(100):
        head = {"id": f"resp_{i}", "object": "response"}
        out = {"text": chr(ord("a") + i % 26) * (2 << 20), "meta_info": meta}
        serving._finish(head, obj, [{"role": "user", "content": "hi"}], out)
    held = deep_size(serving.store)
    assert held <= STORE_MAX_BYTES + (1 << 20), f"the store holds {held / 2**20:.0f} MiB"
    assert serving.store.get("resp_99") is not None and serving.store.get("resp_0") is None
