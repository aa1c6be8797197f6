"""The router's Prometheus metrics, in a registry of its own: request outcomes, retries, each instance's
health and load as the router sees it, and the latencies of an attempt's phases."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.router.policies import Instance

OUTCOMES = ("ok", "rejected", "failed", "unavailable", "cancelled")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    """Prometheus metrics of one router, in a registry of its own."""

    def __init__(self, instances: Sequence[Instance]) -> None:
        self.registry = r = CollectorRegistry()
        requests = Counter(
            "pdserve:router_requests",
            "Generation requests by outcome: ok (passed through), rejected (4xx), failed (upstream error "
            "returned), unavailable (no instance up), cancelled (the client left).",
            ["outcome"],
            registry=r,
        )
        self.requests = {outcome: requests.labels(outcome) for outcome in OUTCOMES}
        dropped = Counter(
            "pdserve:router_dropped_messages",
            "Instance answers dropped because they did not decode: load (GET /load bodies), kv_reservation "
            "(reservation headers; the attempt fails).",
            ["kind"],
            registry=r,
        )
        self.dropped = {kind: dropped.labels(kind) for kind in ("load", "kv_reservation")}
        self.retries = Counter(
            "pdserve:router_retries", "Attempts retried on another prefill/decode pair.", registry=r
        )
        up = Gauge("pdserve:router_instance_up", "1 while the instance is up.", ["url", "role"], registry=r)
        in_flight = Gauge(
            "pdserve:router_requests_in_flight",
            "Requests the router has in flight on the instance.",
            ["url", "role"],
            registry=r,
        )
        self.up = {(i.role, i.url): up.labels(i.url, i.role) for i in instances}
        self.in_flight = {(i.role, i.url): in_flight.labels(i.url, i.role) for i in instances}
        # The instances' own KV-transfer totals, as their last /load reported them.
        labels = ["url", "role", "direction"]
        self.kv_transfer_bytes = Gauge(
            "pdserve:router_instance_kv_transfer_bytes",
            "KV bytes the instance moved in finished transfers (its own total, from /load).",
            labels,
            registry=r,
        )
        self.kv_transfer_seconds = Gauge(
            "pdserve:router_instance_kv_transfer_seconds",
            "Summed durations of the instance's finished KV transfers (its own total, from /load).",
            labels,
            registry=r,
        )
        self.kv_transfers = Gauge(
            "pdserve:router_instance_kv_transfers",
            "Finished KV transfers of the instance, by outcome (its own total, from /load).",
            [*labels, "outcome"],
            registry=r,
        )
        self.time_to_reservation = Histogram(
            "pdserve:router_time_to_kv_reservation_seconds",
            "Request sent to the decode instance to its answer with a KV reservation.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "pdserve:router_prefill_request_seconds",
            "Prefill request sent to answered: the prompt's prefill plus the KV transfer.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "pdserve:router_time_to_first_byte_seconds",
            "Request arrival at the router to the first body bytes from the decode instance.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
