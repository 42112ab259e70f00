"""Prometheus metrics for the HTTP server, named like SGLang's (`sglang:*`), so SGLang's
Grafana dashboards and scrapers work unchanged.

One `ServerMetrics` per app owns its own `CollectorRegistry` (two apps in one process do not
collide). Request metrics are recorded when a request finishes; the scheduler's gauges
(running/queued requests, KV usage, cache hit rate) are read at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges (seconds), SGLang's defaults trimmed to the CPU-to-NPU range.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
)
TPOT_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

# tokens per step (accept length) and drafts per step of one request: 1..K+1 and 0..K
SPEC_LENGTH_BUCKETS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 16.0)


@dataclass
class RequestStats:
    """What one finished request contributes (latencies in seconds)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    ttft: float | None  # None when no token was produced
    aborted: bool = False
    spec_verify_ct: int = 0  # verify forwards, MTP only
    spec_draft_tokens: int = 0  # drafts verified (its k_r summed over its steps), MTP only

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (SGLang's TPOT)."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e_latency - self.ttft) / (self.completion_tokens - 1)


class _Make:
    """Metric constructors on one registry: the single-series ones already labelled with the
    model name; `labelled` leaves the extra labels (after `model_name`) to the caller."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name

    def counter(self, name: str, doc: str):
        return Counter(name, doc, ("model_name",), registry=self.registry).labels(self.model_name)

    def gauge(self, name: str, doc: str):
        return Gauge(name, doc, ("model_name",), registry=self.registry).labels(self.model_name)

    def histogram(self, name: str, doc: str, buckets):
        metric = Histogram(name, doc, ("model_name",), buckets=buckets, registry=self.registry)
        return metric.labels(self.model_name)

    def labelled(self, kind, name: str, doc: str, labels: tuple[str, ...]):
        return kind(name, doc, ("model_name", *labels), registry=self.registry)


class ServerMetrics:
    def __init__(self, model_name: str, spec_enabled: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.spec_enabled = spec_enabled
        self.spec_tokens = 0  # completion tokens of requests that ran MTP verify steps
        self.spec_verify_ct = 0
        self._seen: dict[str, float] = {}  # scheduler totals already counted (`_advance`)
        self._model_name = model_name
        make = _Make(self.registry, model_name)
        self._add_request_metrics(make)
        self._add_scheduler_gauges(make)
        if spec_enabled:
            self._add_spec_metrics(make)

    def _add_request_metrics(self, make: _Make) -> None:
        counter, histogram = make.counter, make.histogram
        self.num_requests = counter("sglang:num_requests", "Finished requests")
        self.num_aborted = counter("sglang:num_aborted_requests", "Aborted requests")
        self.num_bad = counter("sglang:num_bad_requests", "Requests rejected with HTTP 400")
        self.num_rejected = counter(
            "sglang:num_rejected_requests",
            "Requests refused with HTTP 503 (queue full past --max-queued-requests, or shutdown)",
        )
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("sglang:generation_tokens", "Tokens generated")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from cache")
        # prefill-decode disaggregation (scheduler-side totals, advanced at each scrape; they
        # stay 0 on a server that is not disaggregated)
        self.kv_transfer = {
            key: counter(f"sglang:{key}", doc)
            for key, doc in (
                ("kv_transfer_bytes", "KV bytes this server sent to decode servers"),
                ("kv_transfer_seconds", "Seconds spent in KV transfers to decode servers"),
                (
                    "kv_transfer_failures",
                    "Disaggregated requests failed on this server (a transfer, a timeout, a "
                    "peer that went away or refused the request)",
                ),
            )
        }
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "sglang:time_per_output_token_seconds",
            "Mean time per output token after the first",
            TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS
        )

    def _add_scheduler_gauges(self, make: _Make) -> None:
        gauge = make.gauge
        self.num_running = gauge("sglang:num_running_reqs", "Requests in the running batch")
        self.num_queue = gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled")
        self.token_usage = gauge("sglang:token_usage", "Fraction of KV slots in use or cached")
        self.cache_hit_rate = gauge(
            "sglang:cache_hit_rate",
            "Prompt tokens served from the radix cache / prompt tokens, since start",
        )

    def _add_spec_metrics(self, make: _Make) -> None:
        counter, histogram = make.counter, make.histogram
        self.spec_verify = counter(
            "sglang:spec_verify_steps", "MTP verify forwards (one per request per step)"
        )
        self.spec_tokens_total = counter(
            "sglang:spec_output_tokens",
            "Output tokens of requests decoded with MTP (accept length numerator)",
        )
        self.spec_accept_length = make.gauge(
            "sglang:spec_accept_length", "Mean tokens committed per verify step"
        )
        self.spec_request_accept_length = histogram(
            "sglang:spec_request_accept_length",
            "A finished request's tokens per step (its own accept length)",
            SPEC_LENGTH_BUCKETS,
        )
        self.spec_request_draft_length = histogram(
            "sglang:spec_request_draft_length",
            "A finished request's drafts per step (its k_r: asked or adaptive)",
            SPEC_LENGTH_BUCKETS,
        )
        # Scheduler-side counters, advanced from internal_state at each scrape.
        self.spec_sched = {
            key: counter(name, doc)
            for key, name, doc in (
                ("spec_num_verify", "sglang:spec_num_drafts", "Draft chains verified"),
                ("spec_draft_tokens", "sglang:spec_draft_tokens", "Draft tokens verified"),
                ("spec_accepted_tokens", "sglang:spec_accepted_tokens", "Drafts accepted"),
                (
                    "spec_ragged_steps",
                    "sglang:spec_ragged_verify_steps",
                    "Verify forwards over only each request's 1 + k_r rows",
                ),
                ("spec_verify_rows", "sglang:spec_verify_rows", "Rows the verify forwards ran"),
            )
        }
        self.spec_per_position = make.labelled(
            Counter, "sglang:spec_accepted_per_position",
            "Drafts accepted at each draft position", ("position",),
        )  # fmt: skip
        self.spec_draft_length = make.labelled(
            Counter, "sglang:spec_draft_length_steps",
            "Decode steps by the number of drafts K verified (--speculative-adaptive chooses)",
            ("k",),
        )  # fmt: skip
        self.spec_acceptance = make.labelled(
            Gauge, "sglang:spec_acceptance_rate",
            "Drafts accepted / drafts verified at each draft position", ("position",),
        )  # fmt: skip
        self.spec_step_cost = make.labelled(
            Gauge, "sglang:spec_step_cost_seconds",
            "The adaptive policy's cost estimate of a step, per batch bucket and K",
            ("bucket", "k"),
        )  # fmt: skip

    def observe_request(self, s: RequestStats) -> None:
        self.num_requests.inc()
        if s.aborted:
            self.num_aborted.inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.completion_tokens)
        self.cached_tokens.inc(s.cached_tokens)
        self.e2e.observe(s.e2e_latency)
        if s.ttft is not None:
            self.ttft.observe(s.ttft)
        if s.tpot is not None:
            self.tpot.observe(s.tpot)
        if self.spec_enabled and s.spec_verify_ct > 0:
            self.spec_verify_ct += s.spec_verify_ct
            self.spec_tokens += s.completion_tokens
            self.spec_verify.inc(s.spec_verify_ct)
            self.spec_tokens_total.inc(s.completion_tokens)
            self.spec_accept_length.set(self.avg_spec_accept_length)
            ct = s.spec_verify_ct
            self.spec_request_accept_length.observe(s.completion_tokens / ct)
            self.spec_request_draft_length.observe(s.spec_draft_tokens / ct)

    def observe_bad_request(self) -> None:
        self.num_bad.inc()

    def observe_rejected(self) -> None:
        self.num_rejected.inc()

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Tokens committed per verify step over all finished MTP requests; None when MTP is
        off, 0.0 before the first one."""
        if not self.spec_enabled:
            return None
        return self.spec_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def render(self, internal_state: dict) -> bytes:
        """The Prometheus text exposition, after refreshing the scheduler gauges from
        `internal_state` (TokenizerManager.internal_state())."""
        st = internal_state
        self.num_running.set(st["num_running_reqs"])
        self.num_queue.set(st["num_queue_reqs"])
        self.cache_hit_rate.set(st["cache_hit_rate"])
        total = st["max_total_num_tokens"]
        self.token_usage.set((total - st["available_kv_tokens"]) / total if total else 0.0)
        for key, c in self.kv_transfer.items():
            self._advance(key, c, st.get(key, 0))
        if self.spec_enabled:
            for key, c in self.spec_sched.items():
                self._advance(key, c, st.get(key, 0))
            self._render_spec(st)
        return generate_latest(self.registry)

    def _render_spec(self, st: dict) -> None:
        name = self._model_name
        for j, n in enumerate(st.get("spec_accepted_per_position", [])):
            self._advance(f"pos{j}", self.spec_per_position.labels(name, str(j)), n)
        for j, rate in enumerate(st.get("spec_acceptance_per_position", [])):
            self.spec_acceptance.labels(name, str(j)).set(rate)
        for k, n in st.get("spec_draft_length_steps", {}).items():
            self._advance(f"k{k}", self.spec_draft_length.labels(name, k), n)
        for bucket, costs in st.get("spec_step_cost_seconds", {}).items():
            for k, seconds in costs.items():
                self.spec_step_cost.labels(name, bucket, k).set(seconds)

    def _advance(self, key: str, counter, value: float) -> None:
        """Moves a Prometheus counter up to the scheduler's running total `value`."""
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[key] = value
