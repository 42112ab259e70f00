"""The step costs the adaptive draft-length policy (speculative/draft_length) weighs: a
profile of every K's step per batch bucket taken before serving (`profile_costs`), the
verify's row-proportional part for ragged plans (`profile_rows`), and the table that scales
them by what served steps measure (`CostTable`). The rule they serve is draft_length's."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

# Steps of a (bucket, K) whose scale S(b, K) rests on: the lower median of their (wall time /
# profile), or the latest when that is lower. A spike (interference only lengthens a step)
# moves the median little; a drop is believed at once. An entry priced too high may never run
# again (the policy prefers another), so its window would keep the slow spell for good: in bf16
# on 2 CPU cores the plain step at 62 requests was timed at 2x its profile in the first steps
# after the prefill, and drafts then won (a run served 0.50x of MTP off). Priced too low, an
# entry runs and is measured again at once.
COST_WINDOW = 8
# Timed runs per profiled entry, after one warm-up; the minimum is kept. The entries are timed
# in interleaved rounds (a burst of interference then spoils one run of several entries, not
# every run of one), an entry until it has PROFILE_MIN_RUNS runs and PROFILE_ENTRY_SECONDS of
# them, at most PROFILE_MAX_RUNS: a short entry, whose ratio to the others a few milliseconds
# of noise swings most, gets the most runs. On 2 CPU cores single profiles of one server put
# K = 3 at 2.6x to 4.0x the cost of K = 0 at 4 requests (the policy's tie is at 3.3x).
PROFILE_MIN_RUNS = 2
PROFILE_MAX_RUNS = 8
PROFILE_ENTRY_SECONDS = 0.2


class CostTable:
    """Seconds per step by (batch bucket, K): the start profile scaled by what serving
    measured (speculative/draft_length's docstring). A batch belongs to the smallest bucket
    that holds it (the largest one when none does)."""

    def __init__(
        self,
        buckets: Sequence[int],
        max_k: int,
        profile: dict[tuple[int, int], float],
        rows: dict[int, float] | None = None,
        fallback: CostTable | None = None,
    ) -> None:
        """`rows`: the row-proportional part of a step by rows (`profile_rows`), for steps
        that verify fewer than B(1+K) rows (a ragged verify); None: no such steps.
        `fallback`: the table whose scales this one borrows before it measured any (`sibling`)."""
        self.rows, self.fallback = rows, fallback
        # W at every row count up to the profiled most (a list: the planner reads it per row),
        # never less for more rows (as `profile_rows` gives it: the planner relies on it)
        self.row_seconds = (
            None
            if rows is None
            else list(
                itertools.accumulate((interpolate(rows, n) for n in range(max(rows) + 1)), max)
            )
        )
        self.row_array = None if rows is None else np.asarray(self.row_seconds)
        self.buckets = sorted(buckets)
        self.ks = list(range(max_k + 1))
        missing = [(b, k) for b in self.buckets for k in self.ks if (b, k) not in profile]
        if missing:
            raise ValueError(f"the cost profile lacks {missing}")
        self.profile = profile
        self.recent: dict[tuple[int, int], deque[float]] = {}  # wall time / profile per step
        self.scale: dict[tuple[int, int], float] = {}  # from `recent` (COST_WINDOW)

    def sibling(self) -> CostTable:
        """A table over the same profile for steps of another kind (batches with a sampled
        request), which measures its own scales and borrows this one's until it has any."""
        return CostTable(self.buckets, self.ks[-1], self.profile, self.rows, fallback=self)

    def bucket(self, batch: int) -> int:
        return next((b for b in self.buckets if b >= batch), self.buckets[-1])

    def observe(self, batch: int, k: int, seconds: float, rows: int | None = None) -> None:
        """A served step of K = k over `batch` requests took `seconds`; `rows`: the rows
        its verify ran (None: batch x (1 + k))."""
        key = self.bucket(batch), k
        recent = self.recent.setdefault(key, deque(maxlen=COST_WINDOW))
        recent.append(seconds / self.profiled(key[0], k, rows, batch))
        self.scale[key] = min(statistics.median_low(recent), recent[-1])

    def profiled(
        self, bucket: int, k: int, rows: int | None = None, batch: int | None = None
    ) -> float:
        """The profile's seconds of a step of K = k in `bucket` over `batch` requests (None:
        `bucket`) verifying `rows` rows: its fixed part (`_fixed`) plus the row-proportional
        part of `rows`."""
        if rows is None or self.rows is None or not k:
            return self.profile[bucket, k]
        return self._fixed(bucket, k, bucket if batch is None else batch) + self._w(rows)

    def _fixed(self, bucket: int, k: int, batch: int) -> float:
        """A ragged step's seconds but its rows': the full step's less the row-proportional
        part of its bucket x (1 + k) rows, never below the plain step's less that of its
        `batch` rows. A step with drafts runs the plain step's forward and more, but the
        two profiles are timed apart: on 2 CPU cores in bf16 (no AMX) 192 rows profiled at
        51 ms against 42.5 ms for the whole K = 2 step at 64 requests, which priced drafts
        for 2 of 62 requests at 12.4 ms against the plain step's 14.5 ms, and they ran."""
        full, plain = self.profile[bucket, k], self.profile[bucket, 0]
        return max(full - self._w(bucket * (k + 1)), plain - self._w(batch))

    def _w(self, rows: int) -> float:
        table = self.row_seconds
        return table[min(rows, len(table) - 1)]

    def ragged_costs(self, bucket: int, k: int, batch: int, most: int | None = None) -> list[float]:
        """`cost` of a step of K = k over `batch` requests verifying batch + m rows, for m in
        0 .. `most` (batch x k when None): its profile (`profiled`) x S(b, K); never less
        for more rows."""
        return self.ragged_prices(bucket, k, batch, most).tolist()

    def ragged_prices(self, bucket: int, k: int, batch: int, most: int | None = None) -> np.ndarray:
        """`ragged_costs` as an array (float64, the same values): the planner's scan."""
        most = batch * k if most is None else most
        table = self.row_array[batch : batch + most + 1]  # W at batch + m rows
        if len(table) < most + 1:  # flat past the end
            table = np.concatenate([table, np.full(most + 1 - len(table), self.row_array[-1])])
        return self._factor(bucket, k) * (self._fixed(bucket, k, batch) + table)

    def priced(self, batch: int, k: int, rows: int | None = None) -> float:
        """What the policy expects a step of K = k over `batch` requests verifying `rows`
        rows (None: batch x (1 + k)) to take: `profiled` x S(b, K), as `ragged_costs`."""
        bucket = self.bucket(batch)
        return self.profiled(bucket, k, rows, batch) * self._factor(bucket, k)

    def measured(self, bucket: int, k: int) -> bool:
        return (bucket, k) in self.scale

    def cost(self, bucket: int, k: int) -> float:
        """P(b, K) x S(b, K): S measured for this entry, else borrowed, before any step ran
        the `fallback`'s, else 1; never below half the profile. An entry with drafts borrows
        the median of the bucket's measured K, else the nearest measured bucket's, for this K
        if it has it. The plain step (K = 0) borrows only plain steps' scales (the nearest
        bucket's): a drafting step's scale also carries what its own model misses (the
        serving host work of its several forwards, a ragged verify's rows priced from the row
        profile), and a plain step that borrowed it looked dearer than it was, and so was not
        run, and not measured: in bf16 on 2 CPU cores without AMX, 62 requests borrowed the
        scale of ragged K = 1 steps that served at 2.5x their price, priced K = 0 at 94 ms
        (it served at 15 ms) and drafted at 0.61x of MTP off."""
        return self.profile[bucket, k] * self._factor(bucket, k)

    def observations(self, bucket: int, k: int) -> int:
        """The served steps of K = k in `bucket` that its scale rests on (at most COST_WINDOW)."""
        return len(self.recent.get((bucket, k), ()))

    def _factor(self, bucket: int, k: int) -> float:
        """S(b, K) as the costs apply it: never below half the profile."""
        return max(self._scale(bucket, k), 0.5)

    def _scale(self, bucket: int, k: int) -> float:
        if (bucket, k) in self.scale:
            return self.scale[bucket, k]
        if not k:  # plain steps' scales only (`cost`)
            plain = [b for b, j in self.scale if not j]
            if not plain:
                return 1.0 if self.fallback is None else self.fallback._scale(bucket, 0)
            return self.scale[min(plain, key=lambda b: (abs(b - bucket), b)), 0]
        if mine := self._measured_scales(bucket):
            return statistics.median_low(mine)
        near = min({b for b, _ in self.scale}, key=lambda b: abs(b - bucket), default=None)
        if near is None:
            return 1.0 if self.fallback is None else self.fallback._scale(bucket, k)
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
