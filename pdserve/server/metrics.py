"""Prometheus metrics of one server, in a registry of its own (two apps in a process never share one).

Latencies are measured where the client sees them: at the front, from a request's arrival to the
delivery of its tokens. Queue time and step times come from the engine core's timestamps. Engine-side
counters (preemptions, prefix-cache tokens) arrive as cumulative values and are added as differences.
A `StatsLogger` prints one line every few seconds from the same numbers.
"""

from __future__ import annotations

import logging
import time

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.engine.process.messages import EngineStats, StepStats, TransferStats

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
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
    20.0,
    40.0,
    80.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
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
_REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
SLO_TARGETS = ("ttft", "itl", "tpot", "all")  # the `target` label of the request_slo series
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r).labels(model_name)

        self.ttft = hist(
            "pdserve:time_to_first_token_seconds", "Arrival to first output token.", _LATENCY_BUCKETS
        )
        self.tpot = hist(
            "pdserve:time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.itl = hist(
            "pdserve:inter_token_latency_seconds",
            "Time between consecutive outputs of a request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = hist("pdserve:e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.queue_time = hist(
            "pdserve:request_queue_time_seconds",
            "Arrival to first scheduled in the engine.",
            _REQUEST_BUCKETS,
        )
        self.prefill_step = hist(
            "pdserve:prefill_step_duration_seconds",
            "Duration of engine steps that ran prompt tokens.",
            _STEP_BUCKETS,
        )
        self.decode_step = hist(
            "pdserve:decode_step_duration_seconds",
            "Duration of engine steps that ran only decodes.",
            _STEP_BUCKETS,
        )
        self.num_running = gauge("pdserve:num_requests_running", "Requests in the engine's running set.")
        self.num_waiting = gauge("pdserve:num_requests_waiting", "Requests in the engine's waiting queue.")
        self.kv_usage = gauge("pdserve:kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_num_blocks = gauge(
            "pdserve:kv_cache_num_blocks", "KV-cache blocks the engine holds (more for a quantized --kv-cache-dtype)."
        )
        self.prompt_tokens = counter("pdserve:prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("pdserve:generation_tokens", "Output tokens delivered.")
        self.preemptions = counter("pdserve:preemptions", "Requests preempted by the scheduler.")
        self.num_swapped = gauge(
            "pdserve:num_requests_swapped", "Preempted requests whose KV waits in the host tier."
        )
        swap_blocks = Counter(
            "pdserve:kv_swap_blocks", "KV blocks copied to (out) or back from (in) the host tier.",
            ["model_name", "direction"], registry=r,
        )
        self.swap_out_blocks = swap_blocks.labels(model_name, "out")
        self.swap_in_blocks = swap_blocks.labels(model_name, "in")
        self.prefix_hit_tokens = counter(
            "pdserve:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."
        )
        self.prefix_queried_tokens = counter(
            "pdserve:prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."
        )
        self.engine_restarts = counter(
            "pdserve:engine_restarts", "Engine core processes restarted after the previous one died."
        )
        self.aborted = counter("pdserve:request_aborted", "Requests aborted (client gone or cancelled).")
        self.rejected = counter(
            "pdserve:request_rejected", "Requests refused with 503 (overload, engine down)."
        )
        finished = Counter(
            "pdserve:request_finished",
            "Requests finished, by reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.finished = {
            reason: finished.labels(model_name, reason) for reason in ("stop", "length", "error")
        }
        # Per-request goodput: finished requests against their own latency targets (`LatencyTargets`:
        # a request's own, else the engine's), by target ("ttft", "itl", "tpot", "all" of its targets).
        slo_labels = ["model_name", "target"]
        slo_met = Counter(
            "pdserve:request_slo_met",
            "Finished requests that met their own latency target.",
            slo_labels,
            registry=r,
        )
        slo_missed = Counter(
            "pdserve:request_slo_missed",
            "Finished requests that missed their own latency target (failed ones miss all).",
            slo_labels,
            registry=r,
        )
        self.slo_met = {t: slo_met.labels(model_name, t) for t in SLO_TARGETS}
        self.slo_missed = {t: slo_missed.labels(model_name, t) for t in SLO_TARGETS}
        self._model_name = model_name
        # The scheduling policy's own series (`Policy.stats()`), whatever the policy: key -> value.
        self.policy_series: dict[str, float] = {}
        r.register(_PolicySeries(self.policy_series, model_name))
        self.step_time_predicted = gauge(
            "pdserve:step_time_predicted_seconds", "The step-time model's prediction for the last step."
        )
        self.step_time_measured = gauge(
            "pdserve:step_time_measured_seconds", "Measured duration of the last step the model predicted."
        )
        self.step_time_error = hist(
            "pdserve:step_time_prediction_error_ratio",
            "|predicted - measured| / measured step time, per step (policies with a step-time model).",
            _RATIO_BUCKETS,
        )
        # Disaggregation: KV transfers that ended on this instance, by direction and outcome.
        transfer_labels = ["model_name", "direction"]
        self._transfer_bytes = Counter(
            "pdserve:kv_transfer_bytes", "KV bytes moved by finished transfers.", transfer_labels, registry=r
        )
        self._transfer_tokens = Counter(
            "pdserve:kv_transfer_tokens", "Prompt tokens whose KV finished transferring.", transfer_labels, registry=r
        )
        self._transfer_seconds = Histogram(
            "pdserve:kv_transfer_duration_seconds",
            "Per request: transfer opened to acknowledged (send) or to all KV received (receive).",
            transfer_labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self._transfers = Counter(
            "pdserve:kv_transfers", "Finished KV transfers, by outcome.", [*transfer_labels, "outcome"], registry=r
        )
        # Messages that crossed a process or host boundary and were dropped because they did not decode.
        dropped = Counter(
            "pdserve:dropped_messages",
            "Malformed messages dropped (never acted on), by channel: kv (the KV transport's sockets), "
            "front_to_core and core_to_front (the server's two processes).",
            ["model_name", "channel"],
            registry=r,
        )
        self.dropped = {c: dropped.labels(model_name, c) for c in ("kv", "front_to_core", "core_to_front")}
        self.spec_drafts = counter("pdserve:spec_decode_num_drafts", "Verification steps that ran drafts.")
        self.spec_draft_tokens = counter("pdserve:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        # Mean chosen speculation length = chosen tokens / length choices (docs/speculative.md).
        self.spec_length_choices = counter(
            "pdserve:spec_decode_num_length_choices", "Speculation lengths chosen (one per request and step)."
        )
        self.spec_chosen_tokens = counter(
            "pdserve:spec_decode_num_chosen_tokens", "Draft tokens the length rule asked for."
        )
        self._spec_accepted_per_pos = Counter(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            [*label, "position"],
            registry=r,
        )
        # Plain totals for the stats log (counters cannot be read back cheaply).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.engine = EngineStats(0, 0, 0.0, 0, 0, 0)
        # KV transfers by direction ("send", "receive"): counts by outcome, and bytes and seconds of the
        # ok ones; in /load, so that the router can show every instance's figures.
        self.transfer_totals: dict[str, dict[str, float]] = {}

    def observe_kv_cache(self, num_blocks: int) -> None:
        """Once per engine start: the KV cache's size in blocks (fixed while the engine runs)."""
        self.kv_num_blocks.set(num_blocks)

    def observe_engine(self, stats: EngineStats, step: StepStats | None) -> None:
        last = self.engine
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.num_swapped.set(stats.num_swapped)
        self.swap_out_blocks.inc(max(0, stats.num_swapped_out_blocks - last.num_swapped_out_blocks))
        self.swap_in_blocks.inc(max(0, stats.num_swapped_in_blocks - last.num_swapped_in_blocks))
        self.prefix_hit_tokens.inc(max(0, stats.num_prefix_hit_tokens - last.num_prefix_hit_tokens))
        self.prefix_queried_tokens.inc(
            max(0, stats.num_prefix_queried_tokens - last.num_prefix_queried_tokens)
        )
        for key, value in stats.policy_stats.items():  # counters add differences, like the ones above
            if key.endswith("_total"):
                before = last.policy_stats.get(key, 0.0)
                self.policy_series[key] = self.policy_series.get(key, 0.0) + max(0.0, value - before)
            else:
                self.policy_series[key] = value
        self.dropped["kv"].inc(max(0, stats.num_dropped_kv_messages - last.num_dropped_kv_messages))
        self.dropped["front_to_core"].inc(
            max(0, stats.num_dropped_front_messages - last.num_dropped_front_messages)
        )
        self.spec_drafts.inc(max(0, stats.num_spec_drafts - last.num_spec_drafts))
        self.spec_draft_tokens.inc(max(0, stats.num_spec_draft_tokens - last.num_spec_draft_tokens))
        self.spec_accepted_tokens.inc(max(0, stats.num_spec_accepted_tokens - last.num_spec_accepted_tokens))
        self.spec_length_choices.inc(max(0, stats.num_spec_length_choices - last.num_spec_length_choices))
        self.spec_chosen_tokens.inc(max(0, stats.num_spec_chosen_tokens - last.num_spec_chosen_tokens))
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            before = last.spec_accepted_per_pos[pos] if pos < len(last.spec_accepted_per_pos) else 0
            if n > before:
                self._spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(n - before)
        self.engine = stats
        if step is not None:
            (self.prefill_step if step.num_prefill_tokens else self.decode_step).observe(step.duration)
            if step.predicted_duration is not None:
                self.step_time_predicted.set(step.predicted_duration)
                self.step_time_measured.set(step.duration)
                if step.duration > 0:
                    self.step_time_error.observe(abs(step.predicted_duration - step.duration) / step.duration)

    def observe_transfer(self, t: TransferStats) -> None:
        totals = self.transfer_totals.setdefault(t.direction, {"ok": 0, "failed": 0, "bytes": 0, "seconds": 0.0})
        totals["ok" if t.ok else "failed"] += 1
        if t.ok:
            totals["bytes"] += t.num_bytes
            totals["seconds"] += t.duration
        name = self._model_name
        self._transfers.labels(name, t.direction, "ok" if t.ok else "failed").inc()
        if t.ok:
            self._transfer_bytes.labels(name, t.direction).inc(t.num_bytes)
            self._transfer_tokens.labels(name, t.direction).inc(t.num_tokens)
            self._transfer_seconds.labels(name, t.direction).observe(t.duration)

    def observe_first_token(self, ttft: float, queue_time: float | None, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue_time.observe(max(0.0, queue_time))
        self.prompt_tokens.inc(num_prompt_tokens)
        self.total_prompt_tokens += num_prompt_tokens

    def observe_tokens(self, num_tokens: int, itl: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        self.total_generation_tokens += num_tokens
        if itl is not None:
            self.itl.observe(itl)

    def observe_finished(self, reason: str, e2e: float, decode_time: float, num_output_tokens: int) -> None:
        counter = self.finished.get(reason)
        if counter is not None:
            counter.inc()
        self.e2e.observe(e2e)
        if num_output_tokens > 1:
            self.tpot.observe(decode_time / (num_output_tokens - 1))

    def observe_slo(self, results: dict[str, bool]) -> None:
        for target, met in results.items():
            (self.slo_met if met else self.slo_missed)[target].inc()

    def observe_aborted(self, num_requests: int) -> None:
        self.aborted.inc(num_requests)

    def observe_failed(self, num_requests: int) -> None:
        self.finished["error"].inc(num_requests)

    def observe_dropped(self, channel: str) -> None:
        self.dropped[channel].inc()

    def observe_engine_restart(self) -> None:
        self.engine = EngineStats(0, 0, 0.0, 0, 0, 0)  # the new core counts from zero
        self.engine_restarts.inc()


class _PolicySeries:
    """Exposes `ServerMetrics.policy_series` at every scrape: `name{label="value",...}` keys grouped into
    one family per name, `_total` names as counters, the rest as gauges, all labelled with the model."""

    def __init__(self, series: dict[str, float], model_name: str) -> None:
        self._series = series  # ServerMetrics.policy_series, updated in place
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for key, value in sorted(self._series.items()):
            name, labels = _parse_series_key(key)
            family = families.get(name)
            if family is None:
                doc = "Reported by the scheduling policy (docs/scheduling.md)."
                label_names = ["model_name", *labels]
                if name.endswith("_total"):
                    family = CounterMetricFamily(f"pdserve:{name[: -len('_total')]}", doc, labels=label_names)
                else:
                    family = GaugeMetricFamily(f"pdserve:{name}", doc, labels=label_names)
                families[name] = family
            family.add_metric([self._model_name, *labels.values()], value)  # type: ignore[attr-defined]
        yield from families.values()


def _parse_series_key(key: str) -> tuple[str, dict[str, str]]:
    """`'name{a="x",b="y"}'` -> ("name", {"a": "x", "b": "y"}); a key without braces has no labels."""
    name, _, rest = key.partition("{")
    labels: dict[str, str] = {}
    for pair in filter(None, rest.rstrip("}").split(",")):
        label, _, value = pair.partition("=")
        labels[label.strip()] = value.strip().strip('"')
    return name, labels


class StatsLogger:
    """One log line per interval while anything happens: throughput, queues, KV usage."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0
        self._was_idle = True

    def log(self) -> None:
        m, now = self.metrics, time.monotonic()
        e = m.engine
        prompt = m.total_prompt_tokens - self._last_prompt
        generation = m.total_generation_tokens - self._last_generation
        idle = not (prompt or generation or e.num_running or e.num_waiting)
        dt = max(now - self._last_time, 1e-9)
        self._last_time, self._last_prompt, self._last_generation = (
            now,
            m.total_prompt_tokens,
            m.total_generation_tokens,
        )
        if idle and self._was_idle:
            return
        self._was_idle = idle
        hit = (
            100.0 * e.num_prefix_hit_tokens / e.num_prefix_queried_tokens
            if e.num_prefix_queried_tokens
            else 0.0
        )
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
            "prefix cache hits %.1f%%, preemptions %d",
            prompt / dt,
            generation / dt,
            e.num_running,
            e.num_waiting,
            100.0 * e.kv_cache_usage,
            hit,
            e.num_preemptions,
        )
