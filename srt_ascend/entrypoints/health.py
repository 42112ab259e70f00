"""/health_generate's probe: a one-token generation through the whole runtime, bounded so
that a keyless flood of probes cannot become a flood of generations.

- At most one probe generation is in flight: callers that arrive meanwhile wait for it and
  share its answer.
- An answer is reused for `ttl` seconds after it came.
- A new probe generation passes admission like any request (`Serving.admit`): a full queue
  (--max-queued-requests) or a draining server refuses it (ServerBusyError, HTTP 503), and
  while it runs it counts as a request in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0  # a probe without its token by then answers unhealthy
HEALTH_TTL_S = 1.0  # how long one probe's answer serves later callers


class HealthProbe:
    """`check()` -> whether a generation went through (see the module docstring).

    `admit()` raises ServerBusyError when the server takes no new request; `generate()`
    runs one probe generation to its end. Both are called on the event loop."""

    def __init__(
        self,
        admit: Callable[[], None],
        generate: Callable[[], Awaitable[None]],
        ttl: float = HEALTH_TTL_S,
        timeout: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self.admit = admit
        self.generate = generate
        self.ttl = ttl
        self.timeout = timeout
        self.generations = 0  # probe generations started (for tests and logs)
        self._running: asyncio.Future[bool] | None = None
        self._answer: tuple[float, bool] | None = None  # (monotonic time, healthy)

    async def check(self) -> bool:
        """True once a fresh or recent generation went through; False if it timed out or
        failed. ServerBusyError when a new probe is needed and admission refuses it. A
        caller that goes away does not cancel the probe others wait for."""
        if self._running is None:
            if self._answer is not None and time.monotonic() - self._answer[0] < self.ttl:
                return self._answer[1]
            self.admit()
            self.generations += 1
            self._running = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._running)

    async def _probe(self) -> bool:
        """The one probe generation; its answer is recorded even if it is cancelled (the
        server stopping), so later callers never wait on a dead probe."""
        healthy = False
        try:
            await asyncio.wait_for(self.generate(), self.timeout)
            healthy = True
        except asyncio.TimeoutError:
            logger.error("health_generate: no token within %.0f s", self.timeout)
        except Exception:  # a failed generation is an unhealthy server, not a 500
            logger.exception("health_generate: the probe generation failed")
        finally:
            self._answer = (time.monotonic(), healthy)
            self._running = None
        return healthy
