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

The costs come from a profile taken before serving (`profile_costs`): the step's forwards
timed per bucket and K over a padding batch, P(b, K). Serving scales it by what it measures:
C(b, K) = P(b, K) x S(b, K), where S(b, K) is the lower median of the last COST_WINDOW
(wall time / P(b, K)) of the steps that ran K in bucket b; an entry not run yet borrows the
scale of the bucket's other K (or the nearest bucket's). The profile gets the shape (how a
step grows with its tokens), serving the level: served steps run slower than the profile's
tight loop by about the same factor for every K, since the serving threads beside the step
take the GIL and the cores between its operations, and a step with drafts has several times a
plain step's operations. (One host-work term added to every K, the earlier model, put 15 ms
on a K = 0 step at one request because K = 3 steps had run 15 ms over their profile: K = 3
then looked twice as fast per token as K = 0 and ran at 0.94x of MTP off, at four requests
0.72x.) Every EXPLORE_EVERY-th step of a bucket runs the runner-up K when it has fewer drafts
and is a contender, so a K = 0 that never runs where drafts do still gets measured; the
SETTLE_STEPS decode steps after a prefill are not timed (the serving threads answer first
tokens beside them). The profile is noisy on a shared CPU, so each entry is the fastest of
several interleaved runs and no entry may cost more than a step over more tokens (`monotone`).
Per request (`lengths`), with a ragged verify (each request verifies its own 1 + k_r rows):
a plan of k_r per request costs the step of K = max k_r with its verify (and a ragged MTP
pass) over sum(1 + k_r) rows instead of B(1 + K): P(b, K) less the row profile W at B(1 + K)
rows plus W at the plan's rows (`CostTable.profiled`; W timed at start by `profile_rows`),
scaled by S(b, K), which served steps measure against their own rows. Each request's draft j
adds prod_{i<=j} a_r[i] expected tokens for one row; the drafts ranked by that (every prefix
is a plan) give, per K, the plan with the most tokens per second, taken when it promises
SPEC_MARGIN times the plain step's. Without a ragged verify, the requests expecting the
fewest tokens from drafts may run apart as a plain step beside one step of j drafts over the
rest, when that pair of steps (each costed at its own bucket) promises SPEC_MARGIN times the
chosen K's tokens per second. Either way every EXPLORE_EVERY-th plan drafts for the requests
left at 0, so that their acceptance keeps being measured. A
request's own `speculative_num_steps` wins over both choices (MTPDecoder._plan).
Estimates a_r (`Estimate`) start from the recent acceptance per position of requests of r's
kind (greedy or sampled; the server-wide acceptance before any) and move with each of r's
verify steps, fast while they rest on few outcomes (PRIOR_WEIGHT, ESTIMATE_DECAY). Under
overlap scheduling (MTPDecoder.launch) a round's K is chosen at its launch,
before the round in flight is read: from estimates one round stale; its timing is the time
from the previous round's read to its own (a streak's period: what a served round costs). A
launch looks at the choice (`peek`) and counts the step (`advance`) only once the round runs:
a refused launch, after which the scheduler runs `step` (which chooses), counts none, so one
round counts one step towards EXPLORE_EVERY.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Sequence

from tqdm import tqdm

from srt_ascend.registry import Registry

COST_WINDOW = 8  # steps of a (bucket, K) whose scale S(b, K) is the lower median of
# A request's acceptance estimate at a draft position (`Estimate`) is a decayed average of its
# own verify outcomes there, its prior counting PRIOR_WEIGHT outcomes at the start: a new
# request moves faster (its first outcome weighs 1/(PRIOR_WEIGHT x ESTIMATE_DECAY + 1) = 0.22),
# an established one at about 1 - ESTIMATE_DECAY per outcome. 0.1 per outcome throughout let
# requests that accept well but started from a low prior, code among random-token requests,
# go unrecognised: at K = 0 only an exploration step every EXPLORE_EVERY plans observes them,
# twice in a 64-token request's life. A prior of 2 outcomes (first weight 0.36) swung a lone
# request to K = 0 after a few rejections, where it stayed until the next exploration: 0.84x
# of the best fixed K at one request in benchmark/policy_sim.py, 0.99x with 4 (0.3 per
# outcome throughout did the same to a lone request served on CPU).
PRIOR_WEIGHT = 4.0
ESTIMATE_DECAY = 0.9
# The prior of a new request: the acceptance per position of the recent requests of its kind
# (greedy or sampled: a temperature changes acceptance most), each outcome discounting the
# earlier ones by KIND_DECAY (about the last 500 outcomes per position)
KIND_DECAY = 0.998
# Drafts must promise this much more than K = 0 (expected tokens per second): what speculation
# costs beyond its steps is not in the costs (the passes that catch up deferred positions, the
# MTP pass over prompts, which delays first tokens, requests that no longer finish together and
# so prefill their successors one by one instead of in one batch). On 2 CPU cores at four
# requests K = 3 and K = 0 tied in-process (4.65 vs 4.6 ms per token) while K = 2 and 3 served
# at 0.77-0.91x of MTP off; 5% let a noisy profile flip that tie towards drafting. A margin
# from the start profile's own noise (1 + 3x its runs' median spread: 1.05-1.09 there) drafted
# at four requests and served 0.85x of MTP off: that noise does not measure what serving adds.
SPEC_MARGIN = 1.15
# A position's acceptance before any draft was verified there: optimistic (DeepSeek-V3 reports
# 85-90% for its MTP drafts), so that where drafting can pay it gets tried and the estimates
# learn; the policy runs no drafts only to learn (0.5 kept a lone request on K = 0 for good)
PRIOR_ACCEPT = 0.9
# Every EXPLORE_EVERY-th step of a bucket runs the runner-up K instead of the best when it is
# smaller (fewer drafts: no catch-up pass to pay, and a cheaper step) and promises at least
# EXPLORE_WITHIN of the best's tokens per second (EXPLORE_UNMEASURED when its cost was never
# measured in this bucket, only borrowed): a K = 0 that serving inflated, or drafts that the
# profile understated, are corrected by the next measurement (at most 1/32 of the steps,
# each at most 20% slower once measured). A larger K is never run only to measure it: from
# K = 0 that would first catch up every deferred position (up to 64 per request).
EXPLORE_EVERY = 32
EXPLORE_WITHIN = 0.8
EXPLORE_UNMEASURED = 0.5
# Timed runs per profiled entry, after one warm-up; the minimum is kept. The entries are timed
# in interleaved rounds (a burst of interference then spoils one run of several entries, not
# every run of one), an entry until it has PROFILE_MIN_RUNS runs and PROFILE_ENTRY_SECONDS of
# them, at most PROFILE_MAX_RUNS: a short entry, whose ratio to the others a few milliseconds
# of noise swings most, gets the most runs. On 2 CPU cores single profiles of one server put
# K = 3 at 2.6x to 4.0x the cost of K = 0 at 4 requests (the policy's tie is at 3.3x).
PROFILE_MIN_RUNS = 2
PROFILE_MAX_RUNS = 8
PROFILE_ENTRY_SECONDS = 0.2
# Decode steps after a prefill that are not timed: the serving threads then answer the first
# tokens (and the previous requests' last ones) beside the step. When they were timed, a lone
# request's K = 1 steps, run at its start only, read 22.6 ms against 19 ms for a step of a
# fixed K = 1 server, and K = 0 won the bucket at 0.92x of K = 1's throughput.
SETTLE_STEPS = 2


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """1 + sum_{i<=k} prod_{j<=i} acceptance[j-1]: tokens a step with k drafts emits on
    average, given the conditional acceptance of each draft position."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


class AcceptanceStats:
    """Drafts verified and accepted per draft position (0-based): server-wide counts, or
    with `decay` < 1 counts that discount each earlier outcome at a position by it."""

    def __init__(self, max_k: int, decay: float = 1.0) -> None:
        self.drafted = [0] * max_k  # drafts examined at position j (all before it accepted)
        self.accepted = [0] * max_k
        self.decay = decay

    def record(self, k: int, accepted: int) -> None:
        for j in range(min(accepted + 1, k)):
            if self.decay < 1.0:
                self.drafted[j] *= self.decay
                self.accepted[j] *= self.decay
            self.drafted[j] += 1
            self.accepted[j] += j < accepted

    def rates(self) -> list[float]:
        """Conditional acceptance per position (PRIOR_ACCEPT where none was examined)."""
        return [a / d if d else PRIOR_ACCEPT for a, d in zip(self.accepted, self.drafted)]


class Estimate(list):
    """A request's conditional acceptance per draft position (the floats the policy reads):
    at position j, hits[j] / seen[j], the decayed counts of its drafts accepted and examined
    there, started at PRIOR_WEIGHT outcomes of its `prior` (module comment). `kind`: the
    requests whose recent acceptance gave the prior, and which its outcomes inform."""

    def __init__(self, prior: Sequence[float], kind: str = "") -> None:
        super().__init__(prior)
        self.kind = kind
        self.hits = [PRIOR_WEIGHT * a for a in prior]
        self.seen = [PRIOR_WEIGHT] * len(prior)


def update_estimate(estimate: list[float], k: int, accepted: int) -> None:
    """Moves a request's conditional acceptance per position (an `Estimate`) towards one
    verify outcome: positions 1..accepted were accepted, position accepted+1 (if <= k)
    rejected, later ones were not examined and keep their value. A plain list has no counts
    and stays as it is (a fixed estimate)."""
    if not isinstance(estimate, Estimate):
        return
    for j in range(min(accepted + 1, k)):
        estimate.hits[j] = ESTIMATE_DECAY * estimate.hits[j] + (j < accepted)
        estimate.seen[j] = ESTIMATE_DECAY * estimate.seen[j] + 1.0
        estimate[j] = estimate.hits[j] / estimate.seen[j]


class CostTable:
    """Seconds per step by (batch bucket, K): the start profile scaled by what serving
    measured (module docstring). A batch belongs to the smallest bucket that holds it (the
    largest one when none does)."""

    def __init__(
        self,
        buckets: Sequence[int],
        max_k: int,
        profile: dict[tuple[int, int], float],
        rows: dict[int, float] | None = None,
    ) -> None:
        """`rows`: the row-proportional part of a step by rows (`profile_rows`), for steps
        that verify fewer than B(1+K) rows (a ragged verify); None: no such steps."""
        self.rows = rows
        # W at every row count up to the profiled most (a list: the planner reads it per row)
        self.row_seconds = (
            None if rows is None else [interpolate(rows, n) for n in range(max(rows) + 1)]
        )
        self.buckets = sorted(buckets)
        self.ks = list(range(max_k + 1))
        missing = [(b, k) for b in self.buckets for k in self.ks if (b, k) not in profile]
        if missing:
            raise ValueError(f"the cost profile lacks {missing}")
        self.profile = profile
        self.recent: dict[tuple[int, int], deque[float]] = {}  # wall time / profile per step
        self.scale: dict[tuple[int, int], float] = {}  # the lower median of `recent`

    def bucket(self, batch: int) -> int:
        return next((b for b in self.buckets if b >= batch), self.buckets[-1])

    def observe(self, batch: int, k: int, seconds: float, rows: int | None = None) -> None:
        """A served step of K = k over `batch` requests took `seconds`; `rows`: the rows
        its verify ran (None: batch x (1 + k))."""
        key = self.bucket(batch), k
        recent = self.recent.setdefault(key, deque(maxlen=COST_WINDOW))
        recent.append(seconds / self.profiled(key[0], k, rows))
        self.scale[key] = statistics.median_low(recent)

    def profiled(self, bucket: int, k: int, rows: int | None = None) -> float:
        """The profile's seconds of a step of K = k in `bucket` verifying `rows` rows: the
        full step's, less the row-proportional part of its bucket x (1 + k) rows, plus that
        of `rows` (never below a tenth of the full step)."""
        full = self.profile[bucket, k]
        if rows is None or self.rows is None or not k:
            return full
        return max(full - self._w(bucket * (k + 1)) + self._w(rows), full / 10)

    def _w(self, rows: int) -> float:
        table = self.row_seconds
        return table[min(rows, len(table) - 1)]

    def ragged_costs(self, bucket: int, k: int, batch: int) -> list[float]:
        """`cost` of a step of K = k over `batch` requests verifying batch + m rows, for m in
        0 .. batch x k: its profile (`profiled`) x S(b, K)."""
        full = self.profile[bucket, k]
        scale = self.cost(bucket, k) / full
        base, floor = full - self._w(bucket * (k + 1)), full / 10
        table = self.row_seconds[batch : batch * (k + 1) + 1]  # W at batch + m rows
        table += [self.row_seconds[-1]] * (batch * k + 1 - len(table))  # flat past the end
        return [scale * max(base + w, floor) for w in table]

    def measured(self, bucket: int, k: int) -> bool:
        return (bucket, k) in self.scale

    def cost(self, bucket: int, k: int) -> float:
        """P(b, K) x S(b, K): S measured for this entry, else borrowed (the median of the
        bucket's measured K, else the nearest measured bucket's, for this K if it has it),
        1 before any step ran; never below half the profile."""
        return self.profile[bucket, k] * max(self._scale(bucket, k), 0.5)

    def _scale(self, bucket: int, k: int) -> float:
        if (bucket, k) in self.scale:
            return self.scale[bucket, k]
        if mine := self._measured_scales(bucket):
            return statistics.median_low(mine)
        near = min({b for b, _ in self.scale}, key=lambda b: abs(b - bucket), default=None)
        if near is None:
            return 1.0
        if (near, k) in self.scale:
            return self.scale[near, k]
        return statistics.median_low(self._measured_scales(near))

    def _measured_scales(self, bucket: int) -> list[float]:
        return [self.scale[bucket, j] for j in self.ks if (bucket, j) in self.scale]

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{bucket: {K: seconds}} as the policy sees them now, for /server_info and /metrics."""
        return {str(b): {str(k): self.cost(b, k) for k in self.ks} for b in self.buckets}


def profile_costs(
    buckets: Sequence[int],
    max_k: int,
    run_step_forwards: Callable[[int, int], None],
    synchronize: Callable[[], None],
) -> dict[tuple[int, int], float]:
    """Seconds of a step's forwards per (bucket, K), with a progress bar. The smallest and
    largest buckets and the powers of two between are timed: `run_step_forwards(bucket, k)`
    once each to warm up, then in rounds (PROFILE_MIN_RUNS above), keeping each entry's
    fastest run. The buckets between are interpolated linearly in the batch size (at the
    default 64 requests this times 7 of 10 buckets). Last, no entry may cost more than a
    larger one (`monotone`)."""
    ordered = sorted(buckets)
    timed = [b for b in ordered if b in (ordered[0], ordered[-1]) or b & (b - 1) == 0]
    keys = [(b, k) for b in timed for k in range(max_k + 1)]
    out = time_entries(keys, lambda key: run_step_forwards(*key), synchronize, "MTP step costs")
    for b in ordered:
        if b in timed:
            continue
        lo = max(t for t in timed if t < b)
        hi = min(t for t in timed if t > b)
        w = (b - lo) / (hi - lo)
        for k in range(max_k + 1):
            out[b, k] = (1 - w) * out[lo, k] + w * out[hi, k]
    return monotone(out)


def time_entries(keys: list, run: Callable, synchronize: Callable[[], None], what: str) -> dict:
    """Seconds of `run(key)` per key, with a progress bar: each once to warm up, then in
    interleaved rounds (PROFILE_MIN_RUNS above), keeping each key's fastest run."""
    runs: dict = {key: [] for key in keys}

    def wanted(key) -> bool:
        n, spent = len(runs[key]), sum(runs[key])
        return n < PROFILE_MIN_RUNS or (n < PROFILE_MAX_RUNS and spent < PROFILE_ENTRY_SECONDS)

    with tqdm(desc=f"profiling {what}", unit="run", mininterval=2.0) as bar:
        for key in keys:
            run(key)
            bar.update()
        while todo := [key for key in keys if wanted(key)]:
            for key in todo:
                synchronize()
                started = time.perf_counter()
                run(key)
                synchronize()
                runs[key].append(time.perf_counter() - started)
                bar.update()
    return {key: min(r) for key, r in runs.items()}


def profile_rows(
    most: int, run_rows: Callable[[int], None], synchronize: Callable[[], None]
) -> dict[int, float]:
    """Seconds of the row-proportional part of a step (`run_rows(n)`: the verify forward over
    n single-token rows, and the MTP pass over them where it is ragged) at 1, the powers of
    two below `most`, and `most`; never less for more rows (`monotone` in one dimension)."""
    points = sorted({1, most, *(1 << i for i in range(most.bit_length()) if 1 << i < most)})
    timed = time_entries(points, run_rows, synchronize, "verify rows")
    out, cap = {}, float("inf")
    for n in reversed(points):
        cap = out[n] = min(timed[n], cap)
    return out


def interpolate(points: dict[int, float], n: float) -> float:
    """Piecewise-linear in n through `points` (flat past the ends)."""
    keys = sorted(points)
    if n <= keys[0]:
        return points[keys[0]]
    for lo, hi in zip(keys, keys[1:]):
        if n <= hi:
            w = (n - lo) / (hi - lo)
            return (1 - w) * points[lo] + w * points[hi]
    return points[keys[-1]]


def monotone(costs: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Each (bucket, K) entry capped by every entry with as many requests and drafts or more:
    a step over more tokens does not run faster, so an entry above a larger one is noise
    (interference lengthens runs; nothing shortens them)."""
    buckets = sorted({b for b, _ in costs})
    following = dict(zip(buckets, buckets[1:]))
    out = dict(costs)
    for b, k in sorted(costs, reverse=True):  # the larger neighbours are already capped
        for key in ((b, k + 1), (following.get(b), k)):
            if key in out:
                out[b, k] = min(out[b, k], out[key])
    return out


DRAFT_LENGTHS: Registry[DraftLength] = Registry("draft length policy")


class DraftLength(ABC):
    """Chooses K for each step and learns from what the step did."""

    ragged = False  # the decoder's verify builds each request's 1 + k_r rows (MTPDecoder)

    def __init__(self, max_k: int, buckets: Sequence[int]) -> None:
        self.max_k = max_k
        self.acceptance = AcceptanceStats(max_k)
        self.kinds: dict[str, AcceptanceStats] = {}  # recent acceptance by request kind
        self.chosen: Counter[int] = Counter()  # steps per K

    def choose(self, estimates: Sequence[list[float]]) -> int:
        """K for a step over requests with these acceptance estimates (one per request): the
        step runs it (`peek`, then `advance`)."""
        k = self.peek(estimates)
        self.advance(len(estimates))
        return k

    @abstractmethod
    def peek(self, estimates: Sequence[list[float]]) -> int:
        """The K `choose` would give now, without counting a step: for a round that may yet
        not run (`MTPDecoder.launch`, which calls `advance` once it runs)."""

    def advance(self, batch: int) -> None:  # noqa: B027 - optional hook
        """A step over `batch` requests runs the K `peek` gave (a policy that counts its
        steps counts it)."""

    def plan(self, estimates: Sequence[list[float]], count: bool, per_request: bool) -> list[int]:
        """Each request's k_r for a step over requests with these estimates: one K
        (`choose`, or `peek` when not `count`ed), per request (`lengths`) when the decoder
        runs per-request plans."""
        k = self.choose(estimates) if count else self.peek(estimates)
        return self.lengths(estimates, k, count) if per_request else [k] * len(estimates)

    def lengths(self, estimates: Sequence[list[float]], k: int, count: bool) -> list[int]:
        """Each request's k_r in a step for which `choose`/`peek` gave K = k: k for every one
        by default; 0 runs a request apart, as the plain step beside the drafting one.
        `count`: the step runs (a policy may count it)."""
        return [k] * len(estimates)

    def record(
        self,
        estimates: Sequence[list[float]],
        k: int,
        accepted: Sequence[int],
        seconds: float | None,
        limits: Sequence[int] | None = None,
    ) -> None:
        """After a step with K = k that took `seconds` (None: not to be timed) over requests
        with these estimates (updated in place) that accepted `accepted` drafts each, out of
        `limits` (each request's own k_r; None: k)."""
        self.chosen[k] += 1
        for i, (estimate, n) in enumerate(zip(estimates, accepted)):
            k_r = k if limits is None else limits[i]
            self.acceptance.record(k_r, n)
            if isinstance(estimate, Estimate):
                self._kind(estimate.kind).record(k_r, n)
            update_estimate(estimate, k_r, n)

    def initial_estimate(self, kind: str = "") -> Estimate:
        """A new request's estimate: the recent acceptance of requests of its `kind` where
        some were verified, else the server-wide acceptance."""
        recent = self.kinds.get(kind)
        if recent is None or not any(recent.drafted):
            return Estimate(self.acceptance.rates(), kind)
        server = self.acceptance.rates()  # positions its kind never reached: the server's
        rates = zip(recent.accepted, recent.drafted, server)
        return Estimate([a / d if d else s for a, d, s in rates], kind)

    def _kind(self, kind: str) -> AcceptanceStats:
        if kind not in self.kinds:
            self.kinds[kind] = AcceptanceStats(self.max_k, KIND_DECAY)
        return self.kinds[kind]

    def calibrate(  # noqa: B027 - optional hook
        self,
        run_step_forwards: Callable[[int, int], None],
        synchronize: Callable[[], None],
        run_rows: Callable[[int], None] | None = None,
    ) -> None:
        """Once before serving: `run_step_forwards(bucket, k)` runs the forwards of a step
        with K = k over a padding batch of `bucket` requests, `run_rows(n)` the
        row-proportional part of a ragged step over n verify rows (a policy that costs
        steps times them here)."""

    def prefers_plain(self, batch: int) -> bool:
        """Whether steps over `batch` requests are expected to run K = 0 (a prefill then
        defers its MTP pass)."""
        return False

    def stats(self) -> dict:
        return {"spec_draft_length_steps": {str(k): n for k, n in sorted(self.chosen.items())}}


@DRAFT_LENGTHS.register("fixed")
class FixedDraftLength(DraftLength):
    def peek(self, estimates):
        return self.max_k


@DRAFT_LENGTHS.register("adaptive")
class AdaptiveDraftLength(DraftLength):
    def __init__(self, max_k: int, buckets: Sequence[int]) -> None:
        super().__init__(max_k, buckets)
        self.buckets = buckets
        self.costs: CostTable | None = None  # from `calibrate`, before the first step
        self.steps: Counter[int] = Counter()  # steps chosen per bucket
        self.plans = 0  # steps planned per request (`lengths`)
        self.margin = SPEC_MARGIN

    def calibrate(self, run_step_forwards, synchronize, run_rows=None) -> None:
        profile = profile_costs(self.buckets, self.max_k, run_step_forwards, synchronize)
        rows = None
        if self.ragged and run_rows is not None and self.max_k:
            rows = profile_rows(max(self.buckets) * (self.max_k + 1), run_rows, synchronize)
        self.costs = CostTable(self.buckets, self.max_k, profile, rows)

    def _rates(self, bucket: int, estimates: Sequence[list[float]]) -> dict[int, float]:
        """Expected tokens per second of each K for these requests in `bucket`."""
        return {
            k: sum(expected_tokens(e, k) for e in estimates) / self.costs.cost(bucket, k)
            for k in self.costs.ks
        }

    def _best(self, rates: dict[int, float]) -> int:
        best = max(rates, key=rates.__getitem__)
        return best if rates[best] >= self.margin * rates[0] else 0

    def peek(self, estimates):
        bucket = self.costs.bucket(len(estimates))
        rates = self._rates(bucket, estimates)
        best = self._best(rates)
        if (self.steps[bucket] + 1) % EXPLORE_EVERY == 0:  # the runner-up, if a contender
            second = max(range(best), key=rates.__getitem__, default=None)
            if second is not None:
                measured = self.costs.measured(bucket, second)
                within = EXPLORE_WITHIN if measured else EXPLORE_UNMEASURED
                if rates[second] >= within * rates[best]:
                    return second
        return best

    def advance(self, batch: int) -> None:
        self.steps[self.costs.bucket(batch)] += 1

    def plan(self, estimates, count, per_request):
        """With a ragged verify, the per-request plan decides the step (no batch K first)."""
        if not (per_request and self.ragged and self.costs.rows is not None):
            return super().plan(estimates, count, per_request)
        if count:
            self.advance(len(estimates))
            self.plans += 1
        return self._ragged_lengths(estimates)

    def lengths(self, estimates, k, count):
        if count:
            self.plans += 1
        return self._split_lengths(estimates, k)

    def _ragged_lengths(self, estimates: Sequence[list[float]]) -> list[int]:
        """Per-request lengths for a ragged verify (each request's 1 + k_r rows): for each
        K, the drafts d_{j} of request r ranked by their expected tokens (prod_{i<=j}
        a_r[i], which falls with j, so every prefix of the ranking is a plan), and the plan
        with the most expected tokens per second (`CostTable.ragged_cost` of its rows) is
        taken when it promises SPEC_MARGIN times the plain step's (else every k_r = 0).
        Every EXPLORE_EVERY-th plan gives each request at 0 one draft (one more row), so
        its acceptance keeps being measured."""
        n, costs = len(estimates), self.costs
        bucket = costs.bucket(n)
        best, plan = self.margin * n / costs.cost(bucket, 0), [0] * n
        for k in costs.ks[1:]:
            gains = []
            for r, e in enumerate(estimates):
                run = 1.0
                for j in range(k):
                    run *= e[j]
                    gains.append((-run, j, r))
            gains.sort()
            priced = costs.ragged_costs(bucket, k, n)
            tokens, take = float(n), 0
            for m, (gain, _, _) in enumerate(gains, 1):
                tokens -= gain
                if tokens / priced[m] > best:
                    best, take = tokens / priced[m], m
            if take:
                plan = [0] * n
                for _, _, r in gains[:take]:
                    plan[r] += 1
        if any(plan) and self.plans % EXPLORE_EVERY == 0:
            plan = [max(1, c) for c in plan]
        return plan

    def _split_lengths(self, estimates: Sequence[list[float]], k: int) -> list[int]:
        """Per-request lengths: the m requests expecting the fewest tokens from drafts run
        apart as the plain step (k_r = 0) and the rest as one step of j drafts when that pair
        of steps promises SPEC_MARGIN times the tokens per second of the chosen K step over
        all; the best (m >= 1, j >= 1). Every EXPLORE_EVERY-th such plan drafts j for every
        request instead, so the acceptance of requests set apart keeps being measured."""
        n, costs = len(estimates), self.costs
        if n < 2:
            return [k] * n
        order = sorted(range(n), key=lambda r: expected_tokens(estimates[r], self.max_k))
        whole = sum(expected_tokens(e, k) for e in estimates) / costs.cost(costs.bucket(n), k)
        best, plan = self.margin * whole, (0, k)
        for j in costs.ks[1:]:
            tails = [0.0] * (n + 1)  # tails[m]: expected tokens of the requests past the m first
            for i in range(n - 1, -1, -1):
                tails[i] = tails[i + 1] + expected_tokens(estimates[order[i]], j)
            for m in range(1, n):
                split = costs.cost(costs.bucket(m), 0) + costs.cost(costs.bucket(n - m), j)
                if (m + tails[m]) / split > best:
                    best, plan = (m + tails[m]) / split, (m, j)
        m, j = plan
        if not m:
            return [k] * n
        if self.plans % EXPLORE_EVERY == 0:  # the split's drafts for all: all measured
            return [j] * n
        apart = set(order[:m])
        return [0 if r in apart else j for r in range(n)]

    def prefers_plain(self, batch: int) -> bool:
        estimates = [self.initial_estimate()] * batch
        return self._best(self._rates(self.costs.bucket(batch), estimates)) == 0

    def record(self, estimates, k, accepted, seconds, limits=None):
        super().record(estimates, k, accepted, seconds, limits)
        if seconds is not None:
            rows = None if limits is None else sum(n + 1 for n in limits)
            self.costs.observe(len(estimates), k, seconds, rows)

    def stats(self) -> dict:
        return {**super().stats(), "spec_step_cost_seconds": self.costs.snapshot()}
