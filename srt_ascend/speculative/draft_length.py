"""How many drafts K an MTP step verifies: fixed (--speculative-num-steps), or chosen per step
(--speculative-adaptive).

Adaptive rule. A step with K drafts over a batch in graph bucket b costs C(b, K) seconds (the
target forward over 1+K tokens per request, K-1 draft steps, the MTP pass over 1+K). Request r
is expected to emit E_r(K) = 1 + sum_{i=1..K} prod_{j<=i} a_r[j] tokens, where a_r[j] is r's
moving estimate of P(draft j accepted | drafts 1..j-1 accepted). The step takes the K in
0..K_max that maximises sum_r E_r(K) / C(b, K): expected tokens per second. K = 0 verifies no
draft: a one-token target forward whose token is sampled as in plain decoding, with the MTP
pass deferred (MTPDecoder), so its cost is a plain decode step's; the first step with drafts
after it pays the deferred passes (one MTP forward over the positions), which is kept out of
its cost entry: a switch costs about one MTP pass.

The cost table is measured while serving. The first bucket seen tries every K twice; a later
bucket tries K = 0 (the plain step it would mostly run anyway) and estimates its other entries
from the nearest measured bucket, scaled by the two buckets' K = 0 costs, until a step
measures them: trying every K at every new bucket made a short burst of 64 requests spend a
third of its steps exploring dear K = 3 steps. Each step's wall time joins its entry's last
COST_WINDOW samples, and the entry is their lower median: a spike (another process, a cold
cache) does not move it, while the load that serving itself puts beside a step (streaming and
detokenizing the tokens it emits, on the same cores) stays in; the minimum, used first, hid
that load (served at 16 requests on 2 cores, a K = 1 step looked 1.6x a K = 0 step by its
minimum and cost 2.2x by throughput). Every EXPLORE_EVERY-th step of a bucket re-measures the
entry measured longest ago (an estimated one first).
Estimates a_r start from the server-wide acceptance per position and move with each of r's
verify steps.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Sequence

from srt_ascend.registry import Registry

COST_WINDOW = 8  # step times an entry keeps (its cost is their lower median)
ACCEPT_WEIGHT = 0.1  # weight of a new verify outcome in a request's acceptance estimate
# (0.3 let one rejected draft swing a lone request's choice to K = 0 and back)
WARM_SAMPLES = 2  # samples an entry needs before the policy trusts it
EXPLORE_EVERY = 50  # steps of a bucket between two re-measurements of its stalest entry
PRIOR_ACCEPT = 0.5  # a position's acceptance before any draft was verified there


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """1 + sum_{i<=k} prod_{j<=i} acceptance[j-1]: tokens a step with k drafts emits on
    average, given the conditional acceptance of each draft position."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


class AcceptanceStats:
    """Server-wide drafts verified and accepted per draft position (0-based)."""

    def __init__(self, max_k: int) -> None:
        self.drafted = [0] * max_k  # drafts examined at position j (all before it accepted)
        self.accepted = [0] * max_k

    def record(self, k: int, accepted: int) -> None:
        for j in range(min(accepted + 1, k)):
            self.drafted[j] += 1
        for j in range(accepted):
            self.accepted[j] += 1

    def rates(self) -> list[float]:
        """Conditional acceptance per position (PRIOR_ACCEPT where none was examined)."""
        return [a / d if d else PRIOR_ACCEPT for a, d in zip(self.accepted, self.drafted)]


def update_estimate(estimate: list[float], k: int, accepted: int) -> None:
    """Moves a request's conditional acceptance per position towards one verify outcome:
    positions 1..accepted were accepted, position accepted+1 (if <= k) rejected, later ones
    were not examined and keep their value."""
    for j in range(min(accepted + 1, k)):
        outcome = 1.0 if j < accepted else 0.0
        estimate[j] += ACCEPT_WEIGHT * (outcome - estimate[j])


class CostTable:
    """Seconds per step by (batch bucket, K). A batch belongs to the smallest bucket that
    holds it (the largest one when none does)."""

    def __init__(self, buckets: Sequence[int], max_k: int) -> None:
        self.buckets = sorted(buckets)
        self.ks = list(range(max_k + 1))
        self.seconds: dict[tuple[int, int], float] = {}
        self.samples: Counter[tuple[int, int]] = Counter()
        self.recent: dict[tuple[int, int], deque[float]] = {}
        self.measured_at: dict[tuple[int, int], int] = {}  # bucket step of the last sample
        self.steps: Counter[int] = Counter()  # steps per bucket

    def bucket(self, batch: int) -> int:
        return next((b for b in self.buckets if b >= batch), self.buckets[-1])

    def observe(self, batch: int, k: int, seconds: float) -> None:
        key = (self.bucket(batch), k)
        self.samples[key] += 1
        recent = self.recent.setdefault(key, deque(maxlen=COST_WINDOW))
        recent.append(seconds)
        self.seconds[key] = statistics.median_low(recent)
        self.measured_at[key] = self.steps[key[0]]

    def cost(self, bucket: int, k: int) -> float | None:
        """Seconds of a step with K = k in `bucket`: measured, or estimated from the nearest
        bucket that measured both k and 0, times this bucket's K = 0 cost over that bucket's;
        None when neither is known."""
        if (bucket, k) in self.seconds:
            return self.seconds[bucket, k]
        refs = [b for b in self.buckets if (b, k) in self.seconds and (b, 0) in self.seconds]
        if not refs or (bucket, 0) not in self.seconds:
            return None
        ref = min(refs, key=lambda b: abs(b - bucket))
        return self.seconds[ref, k] * self.seconds[bucket, 0] / self.seconds[ref, 0]

    def to_measure(self, bucket: int) -> int | None:
        """The K this bucket's next step must run to keep the table honest: one with fewer
        than WARM_SAMPLES samples and no estimate (largest first; K = 0 first in a bucket
        that can borrow the others), or every EXPLORE_EVERY-th step the stalest; else None."""
        self.steps[bucket] += 1
        borrows = any(b != bucket for b, _ in self.seconds)
        if borrows and self.samples[bucket, 0] < WARM_SAMPLES:
            return 0
        missing = [  # under-sampled, unless estimated and never measured
            k
            for k in self.ks
            if self.samples[bucket, k] < WARM_SAMPLES
            and ((bucket, k) in self.seconds or self.cost(bucket, k) is None)
        ]
        if missing:
            return missing[-1]
        if self.steps[bucket] % EXPLORE_EVERY == 0:
            return min(self.ks, key=lambda k: self.measured_at.get((bucket, k), -1))
        return None

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{bucket: {K: seconds}} for /server_info and /metrics."""
        out: dict[str, dict[str, float]] = {}
        for (b, k), s in sorted(self.seconds.items()):
            out.setdefault(str(b), {})[str(k)] = s
        return out


DRAFT_LENGTHS: Registry[DraftLength] = Registry("draft length policy")


class DraftLength(ABC):
    """Chooses K for each step and learns from what the step did."""

    def __init__(self, max_k: int, buckets: Sequence[int]) -> None:
        self.max_k = max_k
        self.acceptance = AcceptanceStats(max_k)
        self.chosen: Counter[int] = Counter()  # steps per K

    @abstractmethod
    def choose(self, estimates: Sequence[list[float]]) -> int:
        """K for a step over requests with these acceptance estimates (one per request)."""

    def record(
        self, estimates: Sequence[list[float]], k: int, accepted: Sequence[int], seconds: float
    ) -> None:
        """After a step with K = k that took `seconds` over requests with these estimates
        (updated in place) that accepted `accepted` drafts each."""
        self.chosen[k] += 1
        for estimate, n in zip(estimates, accepted):
            self.acceptance.record(k, n)
            update_estimate(estimate, k, n)

    def initial_estimate(self) -> list[float]:
        return self.acceptance.rates()

    def stats(self) -> dict:
        return {"spec_draft_length_steps": {str(k): n for k, n in sorted(self.chosen.items())}}


@DRAFT_LENGTHS.register("fixed")
class FixedDraftLength(DraftLength):
    def choose(self, estimates):
        return self.max_k


@DRAFT_LENGTHS.register("adaptive")
class AdaptiveDraftLength(DraftLength):
    def __init__(self, max_k: int, buckets: Sequence[int]) -> None:
        super().__init__(max_k, buckets)
        self.costs = CostTable(buckets, max_k)

    def choose(self, estimates):
        bucket = self.costs.bucket(len(estimates))
        forced = self.costs.to_measure(bucket)
        if forced is not None:
            return forced
        return max(
            self.costs.ks,
            key=lambda k: (
                sum(expected_tokens(e, k) for e in estimates) / self.costs.cost(bucket, k)
            ),
        )

    def record(self, estimates, k, accepted, seconds):
        super().record(estimates, k, accepted, seconds)
        self.costs.observe(len(estimates), k, seconds)

    def stats(self) -> dict:
        return {**super().stats(), "spec_step_cost_seconds": self.costs.snapshot()}
