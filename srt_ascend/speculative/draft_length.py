"""How many drafts K an MTP step verifies: fixed (--speculative-num-steps), or chosen per step
(--speculative-adaptive).

Adaptive rule. A step with K drafts over a batch in graph bucket b costs C(b, K) seconds (the
target forward over 1+K tokens per request, K-1 draft steps, the MTP pass over 1+K). Request r
is expected to emit E_r(K) = 1 + sum_{i=1..K} prod_{j<=i} a_r[j] tokens, where a_r[j] is r's
moving estimate of P(draft j accepted | drafts 1..j-1 accepted). The step takes the K in
0..K_max that maximises sum_r E_r(K) / C(b, K): expected tokens per second, K = 0 unless
another K promises SPEC_MARGIN times its rate. K = 0 verifies no
draft: a one-token target forward whose token is sampled as in plain decoding, with the MTP
pass deferred (MTPDecoder), so its cost is a plain decode step's; the first step with drafts
after it pays the deferred passes (one MTP forward over the positions), which is kept out of
its cost entry: a switch costs about one MTP pass. A prefill whose next steps are expected to
run K = 0 (`prefers_plain`) defers its MTP pass over the prompt the same way.

The cost table starts from a profile taken before serving (`profile_costs`): the step's
forwards timed per bucket and K over a padding batch, P(b, K). Serving measures the steps it
runs: each step's wall time joins its entry's last COST_WINDOW samples, and the entry is their
lower median (a spike does not move it, while the load serving itself puts beside a step,
streaming and detokenizing on the same cores, stays in). An entry not measured yet is its
profile plus what the measured entry of its bucket nearest in K (or, with none in its bucket,
of the nearest measured bucket) took beyond its own profile: the host work around a step's
forwards, about the same for every K (3-5 ms per step at one request on 2 CPU cores, where the
forwards' own ratios hold within 10% at 4 requests; scaling the profile instead made K = 1 look
2.1x K = 0 at one request, against 1.7x measured). So no step runs a K only to learn its
cost at start (trying every K at every new bucket made a burst of 64 requests spend a third
of its steps exploring dear K = 3 steps). Each bucket measures a plausible K (expected tokens
per second within PLAUSIBLE of the best's, an unmeasured entry costed at most its profile)
that has fewer than WARM_SAMPLES samples every WARM_EVERY-th step, and its stalest plausible
entry every EXPLORE_EVERY-th step: the estimates are off by 10-20% once serving runs beside
the forwards, which only measuring corrects, and a K that cannot come close to the best is
never worth a step to measure.
Estimates a_r start from the server-wide acceptance per position and move with each of r's
verify steps.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Sequence

from tqdm import tqdm

from srt_ascend.registry import Registry

COST_WINDOW = 8  # step times an entry keeps (its cost is their lower median)
ACCEPT_WEIGHT = 0.1  # weight of a new verify outcome in a request's acceptance estimate
# (0.3 let one rejected draft swing a lone request's choice to K = 0 and back)
WARM_SAMPLES = 2  # samples a plausible entry gets soon after its bucket is first seen
WARM_EVERY = 4  # steps of a bucket between two of those early measurements
EXPLORE_EVERY = 50  # steps of a bucket between two re-measurements of its stalest entry
PLAUSIBLE = 0.8  # a K whose expected tokens per second is at least this times the best's
# Drafts must promise this much more than K = 0 (expected tokens per second): what speculation
# costs beyond its steps is not in the table (the passes that catch up deferred positions, the
# MTP pass over prompts, requests that no longer finish together and so prefill their
# successors one by one instead of in one batch)
SPEC_MARGIN = 1.05
PRIOR_ACCEPT = 0.5  # a position's acceptance before any draft was verified there
PROFILE_RUNS = 2  # timed runs per profiled entry (after one warm-up); the minimum is kept


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
    """Seconds per step by (batch bucket, K): measured while serving, else the start profile
    scaled (module docstring). A batch belongs to the smallest bucket that holds it (the
    largest one when none does)."""

    def __init__(
        self, buckets: Sequence[int], max_k: int, profile: dict[tuple[int, int], float]
    ) -> None:
        self.buckets = sorted(buckets)
        self.ks = list(range(max_k + 1))
        missing = [(b, k) for b in self.buckets for k in self.ks if (b, k) not in profile]
        if missing:
            raise ValueError(f"the cost profile lacks {missing}")
        self.profile = profile
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

    def cost(self, bucket: int, k: int) -> float:
        """Seconds of a step with K = k in `bucket`: measured, or its profile plus what a
        reference entry measured beyond its own profile (the host work around a step's
        forwards), the reference being the entry nearest in K of the nearest bucket with a
        measured entry (this one first); never below half the profile, and the raw profile
        when nothing is measured yet."""
        if (bucket, k) in self.seconds:
            return self.seconds[bucket, k]
        if not self.seconds:
            return self.profile[bucket, k]
        near = min({b for b, _ in self.seconds}, key=lambda b: abs(b - bucket))
        ref = min((key for key in self.seconds if key[0] == near), key=lambda key: abs(key[1] - k))
        extra = self.seconds[ref] - self.profile[ref]
        return max(self.profile[bucket, k] + extra, self.profile[bucket, k] / 2)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{bucket: {K: seconds}} as the policy sees them now, for /server_info and /metrics."""
        return {str(b): {str(k): self.cost(b, k) for k in self.ks} for b in self.buckets}


def profile_costs(
    buckets: Sequence[int],
    max_k: int,
    run_step_forwards: Callable[[int, int], None],
    synchronize: Callable[[], None],
) -> dict[tuple[int, int], float]:
    """Seconds of a step's forwards per (bucket, K): `run_step_forwards(bucket, k)` once to
    warm up, then the minimum of PROFILE_RUNS timed runs, with a progress bar."""
    keys = [(b, k) for b in buckets for k in range(max_k + 1)]
    out = {}
    for b, k in tqdm(keys, desc="profiling MTP step costs", unit="shape", mininterval=2.0):
        run_step_forwards(b, k)
        runs = []
        for _ in range(PROFILE_RUNS):
            synchronize()
            started = time.perf_counter()
            run_step_forwards(b, k)
            synchronize()
            runs.append(time.perf_counter() - started)
        out[b, k] = min(runs)
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

    def calibrate(  # noqa: B027 - optional hook
        self, run_step_forwards: Callable[[int, int], None], synchronize: Callable[[], None]
    ) -> None:
        """Once before serving: `run_step_forwards(bucket, k)` runs the forwards of a step
        with K = k over a padding batch of `bucket` requests (a policy that costs steps
        times them here)."""

    def prefers_plain(self, batch: int) -> bool:
        """Whether steps over `batch` requests are expected to run K = 0 (a prefill then
        defers its MTP pass)."""
        return False

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
        self.buckets = buckets
        self.costs: CostTable | None = None  # from `calibrate`, before the first step

    def calibrate(self, run_step_forwards, synchronize) -> None:
        profile = profile_costs(self.buckets, self.max_k, run_step_forwards, synchronize)
        self.costs = CostTable(self.buckets, self.max_k, profile)

    def _rates(
        self, bucket: int, estimates: Sequence[list[float]], optimistic: bool = False
    ) -> dict[int, float]:
        """Expected tokens per second of each K for these requests in `bucket`; `optimistic`
        costs an entry serving has not measured at most its profile (a reference entry that
        ran slow for its own reasons must not keep the others from being tried)."""
        rates = {}
        for k in self.costs.ks:
            cost = self.costs.cost(bucket, k)
            if optimistic and (bucket, k) not in self.costs.seconds:
                cost = min(cost, self.costs.profile[bucket, k])
            rates[k] = sum(expected_tokens(e, k) for e in estimates) / cost
        return rates

    def choose(self, estimates):
        bucket = self.costs.bucket(len(estimates))
        self.costs.steps[bucket] += 1
        step = self.costs.steps[bucket]
        rates = self._rates(bucket, estimates)
        best = max(rates, key=rates.__getitem__)
        if rates[best] < SPEC_MARGIN * rates[0]:
            best = 0
        hopes = self._rates(bucket, estimates, optimistic=True)
        plausible = [k for k in self.costs.ks if hopes[k] >= PLAUSIBLE * rates[best]]
        if step % WARM_EVERY == 0:
            cold = [k for k in plausible if self.costs.samples[bucket, k] < WARM_SAMPLES]
            if cold:
                return max(cold, key=hopes.__getitem__)
        if step % EXPLORE_EVERY == 0:
            return min(plausible, key=lambda k: self.costs.measured_at.get((bucket, k), -1))
        return best

    def prefers_plain(self, batch: int) -> bool:
        rates = self._rates(self.costs.bucket(batch), [self.initial_estimate()] * batch)
        return max(rates.values()) < SPEC_MARGIN * rates[0]

    def record(self, estimates, k, accepted, seconds):
        super().record(estimates, k, accepted, seconds)
        self.costs.observe(len(estimates), k, seconds)

    def stats(self) -> dict:
        return {**super().stats(), "spec_step_cost_seconds": self.costs.snapshot()}
