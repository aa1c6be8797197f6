"""`pdserve top`'s arithmetic: histogram quantiles over a window, rates, a router's instances, the table."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.dashboard import Window, buckets, parse_metrics, quantile, render, router_instances, window


def test_quantile_interpolates_within_buckets_like_prometheus():
    # 10 observations in (0, 1], 10 in (1, 2], none above: the median is the first bucket's top,
    # p75 halfway through the second.
    cum = {1.0: 10.0, 2.0: 20.0, float("inf"): 20.0}
    assert quantile(0.5, cum) == pytest.approx(1.0)
    assert quantile(0.75, cum) == pytest.approx(1.5)
    assert quantile(0.25, cum) == pytest.approx(0.5)
    # only what happened since the earlier read counts
    assert quantile(0.5, cum, {1.0: 10.0, 2.0: 10.0, float("inf"): 10.0}) == pytest.approx(1.5)
    assert quantile(0.5, cum, cum) is None  # nothing new
    assert quantile(0.99, {1.0: 0.0, float("inf"): 5.0}) == 1.0  # in +Inf: the highest finite bound


def test_quantiles_of_a_real_histogram_land_in_the_right_bucket():
    reg = CollectorRegistry()
    bounds = [0.001 * 1.25**i for i in range(40)]
    h = Histogram("x_seconds", "x", buckets=bounds, registry=reg)
    rng = random.Random(0)
    values = sorted(rng.lognormvariate(-4, 0.5) for _ in range(5000))
    for v in values:
        h.observe(v)
    cum = buckets(parse_metrics(generate_latest(reg).decode()), "x_seconds")
    for q in (0.5, 0.9, 0.99):
        exact = values[int(q * len(values)) - 1]
        assert quantile(q, cum) == pytest.approx(exact, rel=0.25)


def metrics(tokens: float, steps: list[float], running: float, hits: float = 0.0, queried: float = 0.0) -> str:
    reg = CollectorRegistry()
    Counter("pdserve:generation_tokens", "t", ["model_name"], registry=reg).labels("m").inc(tokens)
    Counter("pdserve:prefix_cache_hit_tokens", "t", ["model_name"], registry=reg).labels("m").inc(hits)
    Counter("pdserve:prefix_cache_queried_tokens", "t", ["model_name"], registry=reg).labels("m").inc(queried)
    Gauge("pdserve:num_requests_running", "r", ["model_name"], registry=reg).labels("m").set(running)
    h = Histogram("pdserve:decode_step_duration_seconds", "d", ["model_name"], buckets=(0.01, 0.02, 0.05, 1.0),
                  registry=reg).labels("m")
    for s in steps:
        h.observe(s)
    return generate_latest(reg).decode()


def test_a_window_is_what_changed_between_two_reads():
    before = parse_metrics(metrics(100, [0.015] * 10, 4, hits=80, queried=100))
    now = parse_metrics(metrics(400, [0.015] * 10 + [0.03] * 20, 6, hits=130, queried=200))
    w = window("http://x", "decode", now, before, dt=2.0)
    assert w.output_tokens_per_s == pytest.approx(150.0)
    assert w.decode_steps_per_s == pytest.approx(10.0)
    assert 0.02 < w.decode_step_p50 <= 0.05  # the window's steps only: the 15 ms ones are older
    assert w.running == 6 and w.prefix_hit_ratio == pytest.approx(0.5)
    assert w.prefill_steps_per_s is None and w.ttft_p50 is None  # no such metric: no figure
    first = window("http://x", "decode", now, {}, dt=2.0)  # no earlier read: since the start
    assert first.decode_steps_per_s == pytest.approx(15.0)


def test_a_routers_instances_are_read_from_its_labels():
    reg = CollectorRegistry()
    up = Gauge("pdserve:router_instance_up", "u", ["url", "role"], registry=reg)
    up.labels("http://p:1", "prefill").set(1)
    up.labels("http://d:2", "decode").set(0)
    assert router_instances(parse_metrics(generate_latest(reg).decode())) == [
        ("http://d:2", "decode"), ("http://p:1", "prefill")]


def test_the_table_has_a_row_per_instance():
    from rich.console import Console

    rows = [Window("http://a:1", "decode", output_tokens_per_s=1234.0, decode_step_p50=0.0175),
            Window("http://b:2", "prefill", up=False, error="ConnectError")]
    console = Console(width=250, record=True)
    console.print(render(rows, 2.0))
    text = console.export_text()
    assert "a:1" in text and "1,234" in text and "17.5" in text
    assert "b:2" in text and "down" in text and "ConnectError" in text


def test_the_slo_share_counts_the_windows_judged_requests():
    def read(met: float, missed: float) -> str:
        reg = CollectorRegistry()
        m = Counter("pdserve:request_slo_met", "m", ["model_name", "target"], registry=reg)
        x = Counter("pdserve:request_slo_missed", "x", ["model_name", "target"], registry=reg)
        m.labels("m", "all").inc(met)
        m.labels("m", "ttft").inc(100)  # (per-target series are not the share)
        x.labels("m", "all").inc(missed)
        return generate_latest(reg).decode()

    w = window("http://x", "both", parse_metrics(read(13, 5)), parse_metrics(read(10, 4)), dt=1.0)
    assert w.slo_met_ratio == pytest.approx(0.75)
    assert window("http://x", "both", parse_metrics(read(10, 4)), parse_metrics(read(10, 4)), 1.0).slo_met_ratio is None
