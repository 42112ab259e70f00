"""The Responses API's store: responses kept for `GET /v1/responses/{id}` and for
`previous_response_id`, bounded in count and in bytes."""

from __future__ import annotations

from collections import OrderedDict

import orjson

STORE_LIMIT = 1024  # responses kept at most
STORE_MAX_BYTES = 64 << 20  # their serialized size at most (64 MiB)


class ResponseStore:
    """Stored responses, oldest evicted first once there are more than `max_items` or they
    take more than `max_bytes`.

    Each entry is kept serialized (orjson), so the bytes counted are the memory held: a
    response's body and its conversation (earlier turns, its input, its output). A response
    larger than `max_bytes` on its own is not kept (`put` returns False), so the store never
    holds more than `max_bytes` whatever the requests.
    """

    def __init__(self, max_items: int = STORE_LIMIT, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.nbytes = 0  # the serialized size of every entry kept

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict, conversation: list[dict]) -> bool:
        """Keeps (body, conversation) under `response_id` (replacing an entry with that id),
        evicting the oldest entries past the bounds; False when it is too large to keep."""
        self._drop(response_id)
        data = orjson.dumps([body, conversation])
        if len(data) > self.max_bytes:
            return False
        self._entries[response_id] = data
        self.nbytes += len(data)
        while len(self._entries) > self.max_items or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        """(body, conversation) of a kept response, new objects the caller owns; None when
        it was never kept or has been evicted."""
        data = self._entries.get(response_id)
        if data is None:
            return None
        body, conversation = orjson.loads(data)
        return body, conversation

    def _drop(self, response_id: str) -> None:
        data = self._entries.pop(response_id, None)
        if data is not None:
            self.nbytes -= len(data)
