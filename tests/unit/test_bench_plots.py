"""Benchmark figures from hand-made records: each call writes a non-empty PNG, also for runs with failures
or no completed request at all."""

from __future__ import annotations

import math

from pdserve.bench.metrics import SLO, RequestRecord, compute_metrics
from pdserve.bench.plots import plot_cdfs, plot_latency_vs_rate, plot_timeline
from pdserve.bench.serve_bench import write_artifacts

PNG = b"\x89PNG\r\n\x1a\n"


def records(n: int = 12, stall_every: int = 4) -> list[RequestRecord]:
    recs = []
    for i in range(n):
        send = 0.1 * i + (0.05 if i % 3 == 0 else 0.0)
        first = send + 0.15
        times = [first + 0.02 * k + (0.3 if k == 3 and i % stall_every == 0 else 0.0) for k in range(6)]
        recs.append(RequestRecord(i, 10 + 100 * (i % 5 == 0), 6, 0.1 * i, send, times, times[-1], 6, True,
                                  success=True))
    recs.append(RequestRecord(n, 30, 5, 2.0, 2.0, [], 2.1, 0, False, success=False, error="boom"))
    return recs


def assert_png(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG and len(data) > 5000


def test_cdfs(tmp_path):
    assert_png(plot_cdfs({"prefill-first": records(), "chunked": records(8, 2)}, str(tmp_path / "cdf.png")))
    failed_only = records()[-1:]
    assert_png(plot_cdfs({"empty": failed_only}, str(tmp_path / "empty.png")))


def test_latency_vs_rate(tmp_path):
    slo = SLO(ttft_ms=200, itl_ms=100)
    points = [(rate, compute_metrics(records(), 3.0, slo)) for rate in (2.0, 0.5, math.inf)]
    assert_png(plot_latency_vs_rate(points, str(tmp_path / "lvr.png")))
    no_slo = [(1.0, compute_metrics(records(), 3.0))]
    assert_png(plot_latency_vs_rate(no_slo, str(tmp_path / "lvr-no-slo.png")))


def test_timeline(tmp_path):
    assert_png(plot_timeline(records(), str(tmp_path / "t.png")))
    assert_png(plot_timeline(records(40), str(tmp_path / "window.png"), start=10, count=15, title="window"))
    assert_png(plot_timeline([], str(tmp_path / "none.png")))


def test_write_artifacts(tmp_path):
    written = write_artifacts(
        {"rate 1": records(), "rate inf": records(6)}, str(tmp_path / "plots"), str(tmp_path / "t.json")
    )
    names = sorted(p.rsplit("/", 1)[-1] for p in written)
    assert names == ["cdf.png", "t.json", "timeline-rate_1.png", "timeline-rate_inf.png"]
    for p in written:
        if p.endswith(".png"):
            assert_png(p)
