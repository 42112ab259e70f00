"""SGLang's periodic scheduler log lines, in its shape, for the people and tools that scrape them:

    Prefill batch. #new-seq: 2, #new-token: 37, #cached-token: 5, token usage: 0.01,
        #running-req: 1, #queue-req: 0
    Decode batch. #running-req: 3, #token: 412, token usage: 0.01, [accept len: 2.41, ]
        gen throughput (token/s): 95.13, #queue-req: 0

(each one line). A prefill line per prefill batch; a decode line every `--decode-log-interval`
decode steps, its throughput over the tokens generated since the previous decode line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("srt_ascend.scheduler")


@dataclass
class PoolUsage:
    """KV tokens in use (held by requests or the prefix cache) out of the pool's total."""

    used: int
    total: int

    @property
    def fraction(self) -> float:
        return self.used / max(self.total, 1)


@dataclass
class BatchLog:
    interval: int  # decode steps between two decode lines
    spec: bool  # speculative decoding: the decode line carries the accept length
    steps: int = 0
    tokens: int = 0  # generated since the last decode line
    verify_steps: int = 0  # request-steps since the last decode line (speculative)
    since: float = field(default_factory=time.monotonic)

    def prefill(
        self,
        new_seqs: int,
        new_tokens: int,
        cached: int,
        usage: PoolUsage,
        running: int,
        queue: int,
    ) -> None:
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            new_seqs,
            new_tokens,
            cached,
            usage.fraction,
            running,
            queue,
        )

    def decode(self, running: int, tokens: int, usage: PoolUsage, queue: int) -> None:
        """Counts one decode step over `running` requests that generated `tokens`; logs
        the decode line every `interval` steps."""
        self.steps += 1
        self.tokens += tokens
        self.verify_steps += running
        if self.steps % self.interval:
            return
        now = time.monotonic()
        accept = f"accept len: {self.tokens / max(self.verify_steps, 1):.2f}, " if self.spec else ""
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %s"
            "gen throughput (token/s): %.2f, #queue-req: %d",
            running,
            usage.used,
            usage.fraction,
            accept,
            self.tokens / max(now - self.since, 1e-9),
            queue,
        )
        self.tokens = self.verify_steps = 0
        self.since = now
