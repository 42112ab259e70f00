"""The failure board of a multi-node server: two keys in the ranks' rendezvous store (the
TCPStore behind --dist-init-addr, served by rank 0 on node 0) through which the nodes tell
each other to stop.

A node whose rank dies posts why before it ends; every node's watcher reads the board and
ends with that line, so no node waits in a collective for a peer that is gone (a device
collective, NCCL's or HCCL's, never notices on its own; the process group's timeout,
--dist-timeout, is only the last resort). Node 0 posts that it stops before a normal
shutdown; a node that finds the store gone without that notice ends too (node 0 is gone).
"""

from __future__ import annotations

from datetime import timedelta

from srt_ascend.distributed.group import DistInit

FAILED_KEY = "srt_ascend/failed"
STOPPING_KEY = "srt_ascend/stopping"
CONNECT_TIMEOUT_S = 2.0  # one attempt to reach the store (it may not be up yet)


class StoreLost(RuntimeError):
    """The board's store went away (its node 0 is gone)."""


class FailureBoard:
    """One node's handle on the board. Not thread-safe: one watcher thread uses it."""

    def __init__(self, dist_init: DistInit) -> None:
        self.host, port = dist_init.addr.rsplit(":", 1)
        self.port = int(port)
        self._store = None  # connected on first use

    def _connect(self) -> bool:
        """Whether the store is reachable now (a failed attempt is not an error: node 0 may
        still be starting)."""
        if self._store is not None:
            return True
        import torch.distributed as dist

        try:
            self._store = dist.TCPStore(
                self.host,
                self.port,
                is_master=False,
                timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                wait_for_workers=False,
            )
        except Exception:  # noqa: BLE001 - not up yet; the next poll tries again
            return False
        return True

    def post(self, key: str, message: str) -> None:
        """Best effort: a node that cannot reach the board ends anyway, and its peers then
        find their collectives or the store broken."""
        try:
            if self._connect():
                self._store.set(key, message)
        except Exception:  # noqa: BLE001 - see above
            pass

    def read(self) -> tuple[str | None, bool]:
        """(the failure posted, if any; whether node 0 stops). StoreLost when the store was
        reached before and is gone now; (None, False) while it was never reached."""
        if not self._connect():
            return None, False
        try:
            failed, stopping = (self._store.check([k]) for k in (FAILED_KEY, STOPPING_KEY))
            message = self._store.get(FAILED_KEY).decode() if failed else None
        except Exception as e:
            raise StoreLost(str(e)) from e
        return message, stopping
