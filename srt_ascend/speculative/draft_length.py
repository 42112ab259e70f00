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
(wall time / P(b, K)) of the steps that ran K in bucket b, or the latest when lower; an
entry with drafts not run yet borrows the scale of the bucket's other K (or the nearest
bucket's), the plain step (K = 0) only the nearest bucket's plain step's (CostTable.cost).
Batches with a sampled request keep scales of their own (`table`: their verify samples),
borrowing the greedy ones' until they have any. The profile gets the shape (how a step
grows with its tokens), serving the level: served steps run slower than the profile's tight
loop by about the same factor for every K, since the serving threads beside the step take
the GIL and the cores between its operations, and a step with drafts has several times a
plain step's operations. (One host-work term added to every K, the earlier model, put 15 ms
on a K = 0 step at one request because K = 3 steps had run 15 ms over their profile: K = 3
then looked twice as fast per token as K = 0 and ran at 0.94x of MTP off, at four requests
0.72x.) Every EXPLORE_EVERY-th step of a bucket runs the runner-up K when it has fewer drafts
and is a contender (K = 0 whatever its price until PLAIN_SAMPLES of its steps are timed in
the bucket, and at every PLAIN_EVERY-th step), so a K = 0 that never runs where drafts do
still gets measured, and where
K = 0 is the best, every EXPLORE_EVERY x b-th step of bucket b the longest contender with drafts,
so that acceptance keeps being measured; the
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
request's own `speculative_num_steps` wins over both choices, as the server's K does for a
seeded sampled request (MTPDecoder.own_length: its seed then repeats its tokens). A
request's estimate expects nothing from drafts past its last token (`capped`,
MTPDecoder._drafts_left: in serial steps, and in overlapped rounds with ragged rows, where
the round in flight counts as one token), so no plan pays rows for them.
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

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from srt_ascend.registry import Registry
from srt_ascend.speculative.step_costs import CostTable, profile_costs, profile_rows

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
# earlier ones by KIND_DECAY (about the last 500 outcomes per position), beside PRIOR_WEIGHT
# outcomes at PRIOR_ACCEPT (as the server-wide rate, the prior where a kind has none). Without
# them, a served lone request (bf16, 2 CPU cores, held-out code) whose first two steps
# of K = 3 accepted 1 and 2 drafts left its kind at [1.0, 0.5, 0.0]; every later request
# started there, planned K = 0 (2.5 tokens for K = 3's price) and, drafting nothing, never moved
# it: 751 of 753 steps at K = 0, also later at 16 requests, where fixed K = 2 served 1.35x of
# MTP off (benchmark/README "Per-request speculation, session 26").
KIND_DECAY = 0.998
# Drafts must promise this much more than K = 0 (expected tokens per second): what speculation
# costs beyond its steps is not in the costs (the passes that catch up deferred positions, the
# MTP pass over prompts, which delays first tokens, requests that no longer finish together and
# so prefill their successors one by one instead of in one batch, and a batch that finishes
# together waiting for its slowest request). Counted (`spec_catch_up_*`), the catch-ups cost
# 3-19 ms per switch on 2 CPU cores, against 300-700 ms per benchmark round: a hold margin
# (1.15 to start drafting, 1.05 to go on) gained 7-10% on code in bf16 and lost up to 8% on
# random tokens and in float32. On 2 CPU cores at four
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
# each at most 20% slower once measured). Where K = 0 is the best, every EXPLORE_EVERY x b-th
# step of bucket b (about as many request-steps apart whatever the batch: b requests are
# measured at once) runs the largest K promising EXPLORE_WITHIN of K = 0's tokens per second
# (`_explore_up`; none where no K does: random tokens, compute-bound buckets): at K = 0 no
# estimate moves, and requests stop drafting on bad outcomes, not on good ones, so the last
# outcomes a kind records before all go quiet leave it low for good. Served lone code requests
# (bf16, 2 CPU cores) settled at [0.86, 0.25, 0.0] per position after 7 steps with drafts,
# where fixed K = 3 accepts [0.86, 0.80, 0.71]. The first step with drafts after K = 0 catches
# up the deferred positions (3-19 ms per switch on 2 CPU cores, `spec_catch_up_*`); at 64
# requests in bf16 a K = 3 step and its catch-up cost about 5 plain steps, and exploring every
# 32nd step there served code@64 (32 tokens each) at 0.68x of MTP off. The ragged
# per-request planner explores the same way (`_ragged_lengths`). Measured on 2 CPU cores: a
# plain step served at 1.2x its profile and K = 3 at 1.4x, so a plain step priced with the
# drafting steps' scale looked 17% dearer than it was, and four requests drafted (0.87x of MTP
# off) where a tie was all the profile showed.
EXPLORE_EVERY = 32
EXPLORE_WITHIN = 0.8
EXPLORE_UNMEASURED = 0.5
# Until PLAIN_SAMPLES served plain steps of a bucket are timed, an exploring step runs the
# plain step there whatever its price (`peek`'s runner-up, the ragged planner's half-way
# plan): it is the cheapest step there is, and a price it was never measured at can keep it
# from running for good (CostTable.cost); three, so that one slow step is not its scale.
# After that, every PLAIN_EVERY-th such step still does, so that a plain step priced in a
# slow spell is measured again (its latest time then sets its price if lower, COST_WINDOW):
# at most 1/PLAIN_EVERY of the steps, each losing what drafting gains over it.
PLAIN_SAMPLES = 3
PLAIN_EVERY = 4 * EXPLORE_EVERY
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

    def rates(self, unseen: Sequence[float] | None = None, weight: float = 0.0) -> list[float]:
        """Conditional acceptance per position, counting `weight` outcomes at PRIOR_ACCEPT
        beside those recorded; where none was examined, `unseen`'s rate at that position
        (PRIOR_ACCEPT when None)."""
        unseen = unseen or [PRIOR_ACCEPT] * len(self.drafted)
        return [
            (a + weight * PRIOR_ACCEPT) / (d + weight) if d else u
            for a, d, u in zip(self.accepted, self.drafted, unseen)
        ]


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


def capped(estimate: list[float], most: int) -> list[float]:
    """The estimate a plan reads for a request that can use at most `most` drafts (its tokens
    left, less the one every step emits): drafts past `most` expect no token (a step commits
    none past max_new_tokens), so no plan pays rows for them. `estimate` itself when it is
    not capped; else a copy (the request's own estimate learns from its steps as before)."""
    most = max(most, 0)
    if most >= len(estimate):
        return estimate
    rest = [0.0] * (len(estimate) - most)
    return Estimate([*estimate[:most], *rest], getattr(estimate, "kind", ""))


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
        if not k:  # no request drafted (every k_r <= k): nothing examined, nothing moves
            return
        for i, (estimate, n) in enumerate(zip(estimates, accepted)):
            k_r = k if limits is None else limits[i]
            self.acceptance.record(k_r, n)
            if isinstance(estimate, Estimate):
                self._kind(estimate.kind).record(k_r, n)
            update_estimate(estimate, k_r, n)

    def initial_estimate(self, kind: str = "") -> Estimate:
        """A new request's estimate: the recent acceptance of requests of its `kind` where
        some were verified (the server's where its kind never reached), else the server-wide
        acceptance; each with PRIOR_WEIGHT outcomes at PRIOR_ACCEPT beside its own (see
        KIND_DECAY)."""
        server = self.acceptance.rates(weight=PRIOR_WEIGHT)
        recent = self.kinds.get(kind)
        if recent is None or not any(recent.drafted):
            return Estimate(server, kind)
        return Estimate(recent.rates(server, PRIOR_WEIGHT), kind)

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
        self._sampled_costs: CostTable | None = None  # `table`'s, for sampled batches
        self.steps: Counter[int] = Counter()  # steps chosen per bucket
        self.plans = 0  # steps run (`advance`): the per-request planners explore by it
        self.margin = SPEC_MARGIN
        # per K: how its steps held to what the policy expected (`record`, `stats`)
        self.fit: dict[int, PlanFit] = {}

    def calibrate(self, run_step_forwards, synchronize, run_rows=None) -> None:
        profile = profile_costs(self.buckets, self.max_k, run_step_forwards, synchronize)
        rows = None
        if self.ragged and run_rows is not None and self.max_k:
            rows = profile_rows(max(self.buckets) * (self.max_k + 1), run_rows, synchronize)
        self.costs = CostTable(self.buckets, self.max_k, profile, rows)

    def table(self, estimates: Sequence[list[float]]) -> CostTable:
        """The cost table of a step over these requests: `costs` for greedy batches, its
        `sibling` for a batch with a sampled request (whose verify computes the draft and
        target probabilities and samples: on 2 CPU cores in bf16, random-token requests at
        temperature 1 ran their K = 1-2 steps 8% over the scale the greedy code requests
        before them had measured, and a margin of 1.08 then drafted at 0.80x of MTP off).
        The requests' kinds are those of their estimates (`Estimate.kind`)."""
        if not any(getattr(e, "kind", "") == "sampled" for e in estimates):
            return self.costs
        return self._sampled_table()

    def _sampled_table(self) -> CostTable:
        """The sampled batches' table, a `sibling` of the current `costs` (made anew when
        `costs` is replaced)."""
        if self._sampled_costs is None or self._sampled_costs.fallback is not self.costs:
            self._sampled_costs = self.costs.sibling()
        return self._sampled_costs

    def _rates(self, bucket: int, estimates: Sequence[list[float]]) -> dict[int, float]:
        """Expected tokens per second of each K for these requests in `bucket`."""
        costs = self.table(estimates)
        return {
            k: sum(expected_tokens(e, k) for e in estimates) / costs.cost(bucket, k)
            for k in costs.ks
        }

    def _best(self, rates: dict[int, float]) -> int:
        best = max(rates, key=rates.__getitem__)
        return best if rates[best] >= self.margin * rates[0] else 0

    def peek(self, estimates):
        bucket = self.costs.bucket(len(estimates))
        rates = self._rates(bucket, estimates)
        best = self._best(rates)
        step = self.steps[bucket] + 1
        if step % EXPLORE_EVERY == 0:  # the runner-up, if a contender
            if best and self._plain_due(self.table(estimates), bucket, step):
                return 0
            second = max(range(best), key=rates.__getitem__, default=None)
            if second is None:
                return self._explore_up(rates) if step % (EXPLORE_EVERY * bucket) == 0 else 0
            measured = self.table(estimates).measured(bucket, second)
            within = EXPLORE_WITHIN if measured else EXPLORE_UNMEASURED
            if rates[second] >= within * rates[best]:
                return second
        return best

    @staticmethod
    def _plain_due(costs: CostTable, bucket: int, count: int) -> bool:
        """Whether an exploring step (the `count`-th of its cadence) runs the plain step
        whatever its price: while fewer than PLAIN_SAMPLES of its steps in `bucket` are timed,
        and at every PLAIN_EVERY-th count."""
        return costs.observations(bucket, 0) < PLAIN_SAMPLES or count % PLAIN_EVERY == 0

    @staticmethod
    def _explore_up(rates: dict[int, float]) -> int:
        """Where K = 0 is the best: the largest K promising EXPLORE_WITHIN of its tokens per
        second (it examines the most draft positions), else 0."""
        return max((k for k in rates if k and rates[k] >= EXPLORE_WITHIN * rates[0]), default=0)

    def advance(self, batch: int) -> None:
        """Counts a step that runs: in its bucket (`peek`'s exploration) and among the plans
        (the per-request planners'), also for an overlapped round, which plans uncounted and
        advances once it launches."""
        self.steps[self.costs.bucket(batch)] += 1
        self.plans += 1

    def plan(self, estimates, count, per_request):
        """With a ragged verify, the per-request plan decides the step (no batch K first)."""
        if not (per_request and self.ragged and self.costs.rows is not None):
            return super().plan(estimates, count, per_request)
        if count:
            self.advance(len(estimates))
        return self._ragged_lengths(estimates)

    def lengths(self, estimates, k, count):
        return self._split_lengths(estimates, k)

    def _ragged_lengths(self, estimates: Sequence[list[float]]) -> list[int]:
        """Per-request lengths for a ragged verify (each request's 1 + k_r rows): for each
        K, the drafts d_{j} of request r ranked by their expected tokens (prod_{i<=j}
        a_r[i], which falls with j, so every prefix of the ranking is a plan), and the plan
        with the most expected tokens per second (`CostTable.ragged_cost` of its rows) is
        taken when it promises SPEC_MARGIN times the plain step's (else every k_r = 0).
        Every EXPLORE_EVERY-th plan gives each request at 0 one draft (one more row), so
        its acceptance keeps being measured (where no request drafts, every EXPLORE_EVERY x
        b-th plan in bucket b gives every request the longest contender K, `_explore_up`);
        half-way between those, a plan with drafts runs the plain step instead where that is
        close (EXPLORE_WITHIN of its tokens per second), or rests on fewer than PLAIN_SAMPLES
        served steps in the bucket, or at every PLAIN_EVERY-th plan, so the plain step's
        served cost is measured, not taken from another bucket's plain steps or kept from a
        slow spell."""
        n, costs = len(estimates), self.table(estimates)
        bucket = costs.bucket(n)
        best, plan = self.margin * n / costs.cost(bucket, 0), [0] * n
        # runs[r, j]: prod_{i<=j} a_r[i], request r's draft j's expected tokens (in arrays:
        # at 62 requests the scan in Python lists took 0.065-0.15 ms on 2 CPU cores, 1.6-1.9x
        # this)
        runs = np.cumprod(np.array([e[: self.max_k] for e in estimates], float), axis=1)
        for k in costs.ks[1:]:
            # every draft of this K at the price of one (the least a plan with drafts pays:
            # prices grow with rows) cannot beat `best`: then no plan of this K can
            most = n + float(runs[:, :k].sum())
            if most / costs.ragged_costs(bucket, k, n, 1)[1] <= best:
                continue
            # the drafts ranked by their expected tokens, ties by position, then request
            # (index j x n + r, a stable sort); each prefix's tokens summed in that order
            gains = runs[:, :k].T.ravel()
            order = np.argsort(-gains, kind="stable")
            tokens = np.cumsum(np.concatenate(([float(n)], gains[order])))[1:]
            per_second = tokens / costs.ragged_prices(bucket, k, n)[1:]
            m = int(np.argmax(per_second))  # the first of the most
            if per_second[m] > best:
                best = float(per_second[m])
                plan = np.bincount(order[: m + 1] % n, minlength=n).tolist()
        if any(plan) and self.plans % EXPLORE_EVERY == 0:
            plan = [max(1, c) for c in plan]
        elif not any(plan) and self.plans % (EXPLORE_EVERY * bucket) == 0:  # the longest contender
            plan = [self._explore_up(self._rates(bucket, estimates))] * n
        elif any(plan) and self.plans % EXPLORE_EVERY == EXPLORE_EVERY // 2:
            again = self._plain_due(costs, bucket, self.plans - EXPLORE_EVERY // 2)
            if again or n / costs.cost(bucket, 0) >= EXPLORE_WITHIN * best:
                plan = [0] * n
        return plan

    def _split_lengths(self, estimates: Sequence[list[float]], k: int) -> list[int]:
        """Per-request lengths: the m requests expecting the fewest tokens from drafts run
        apart as the plain step (k_r = 0) and the rest as one step of j drafts when that pair
        of steps promises SPEC_MARGIN times the tokens per second of the chosen K step over
        all; the best (m >= 1, j >= 1). Every EXPLORE_EVERY-th such plan drafts j for every
        request instead, so the acceptance of requests set apart keeps being measured."""
        n, costs = len(estimates), self.table(estimates)
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
        rows = None if limits is None else sum(n + 1 for n in limits)
        costs = self.table(estimates)
        # against the estimates and costs the step was planned with (before they move)
        fit = self.fit.setdefault(k, PlanFit())
        fit.steps += 1
        own = [k] * len(estimates) if limits is None else limits
        fit.expected += sum(expected_tokens(e, k_r) for e, k_r in zip(estimates, own))
        fit.tokens += len(estimates) + sum(accepted)
        if seconds is not None:
            fit.timed += 1
            fit.priced += costs.priced(len(estimates), k, rows)
            fit.seconds += seconds
        super().record(estimates, k, accepted, seconds, limits)
        if seconds is not None:
            costs.observe(len(estimates), k, seconds, rows)

    def stats(self) -> dict:
        return {
            **super().stats(),
            "spec_step_cost_seconds": self.costs.snapshot(),
            "spec_step_cost_seconds_sampled": self._sampled_table().snapshot(),
            "spec_plan_fit": {str(k): self.fit[k].summary() for k in sorted(self.fit)},
        }


@dataclass
class PlanFit:
    """How a K's steps held to the policy's expectations since start: tokens emitted against
    the tokens its estimates expected (every step), seconds served against the seconds its
    cost table priced (the timed steps), as means per step. On a device this says whether a
    choice that missed came from the acceptance estimates or from the costs."""

    steps: int = 0
    expected: float = 0.0
    tokens: float = 0.0
    timed: int = 0
    priced: float = 0.0
    seconds: float = 0.0

    def summary(self) -> dict[str, float]:
        per_step, per_timed = max(self.steps, 1), max(self.timed, 1)
        return {
            "steps": self.steps,
            "expected_tokens": self.expected / per_step,
            "tokens": self.tokens / per_step,
            "timed_steps": self.timed,
            "priced_seconds": self.priced / per_timed,
            "seconds": self.seconds / per_timed,
        }
