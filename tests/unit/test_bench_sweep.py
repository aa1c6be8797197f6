"""`bench sweep` logic on hand-made results: parsing rates, the highest rate meeting the attainment target
(DistServe's goodput), the table and the report."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, compute_metrics
from pdserve.bench.serve_bench import BenchResult
from pdserve.config import LoadConfig, Workload
from pdserve.bench.sweep import (
    SweepResult,
    format_sweep_table,
    max_rate_meeting_target,
    parse_rates,
    write_sweep_report,
)

INF = math.inf


def test_parse_rates():
    assert parse_rates("0.5, 1,2,4,inf") == [0.5, 1.0, 2.0, 4.0, INF]


@pytest.mark.parametrize("text", ["", "0", "-1,2", "fast", "1,1"])
def test_parse_rates_rejects(text):
    with pytest.raises(ValueError):
        parse_rates(text)


@pytest.mark.parametrize(
    "points,expected",
    [
        ([(0.5, 100.0), (1, 95.0), (2, 90.0), (4, 60.0), (INF, 10.0)], 2),  # 90% exactly passes
        ([(4, 60.0), (0.5, 100.0), (2, 91.0), (1, 99.0)], 2),  # order given does not matter
        ([(1, 95.0), (2, 89.9), (4, 92.0)], 1),  # a pass above a miss does not count
        ([(0.5, 80.0), (1, 95.0)], None),  # the lowest rate misses
        ([(1, 100.0), (INF, 100.0)], INF),
        ([(1, None), (2, None)], None),  # no SLO, no attainment
        ([], None),
    ],
)
def test_max_rate_meeting_target(points, expected):
    assert max_rate_meeting_target(points) == expected


def test_target_is_a_parameter():
    points = [(1, 99.0), (2, 95.0), (4, 80.0)]
    assert max_rate_meeting_target(points, target=99.0) == 1
    assert max_rate_meeting_target(points, target=75.0) == 4


def run(ttft: float, prefix_hits: int | None = 0) -> BenchResult:
    """Four requests, each with the given TTFT and three tokens 10 ms apart."""
    records = [
        RequestRecord(
            req_id=i, prompt_len=10, requested_output_len=3, arrival_time=float(i), send_time=float(i),
            token_times=[i + ttft, i + ttft + 0.01, i + ttft + 0.02], end_time=i + ttft + 0.02,
            output_len=3, usage_reported=True, success=True,
        )
        for i in range(4)
    ]
    return BenchResult(compute_metrics(records, 4.0, SLO(ttft_ms=100)), records, "m", prefix_hits)


def test_table_and_report(tmp_path):
    points = [(1.0, run(0.05)), (2.0, run(0.08)), (INF, run(0.5, prefix_hits=32))]
    attainments = [(rate, r.metrics.slo_attainment) for rate, r in points]
    result = SweepResult(points, max_rate_meeting_target(attainments), 90.0)
    assert result.max_rate == 2.0
    table = format_sweep_table(result)
    lines = table.splitlines()
    assert lines[0].split() == ["rate", "req/s", "TTFT", "p50", "TTFT", "p99", "TPOT", "p50", "ITL", "p50",
                                "ITL", "p99", "goodput", "attain", "%"]
    assert lines[2].split()[0] == "1" and lines[4].split()[0] == "inf"
    assert lines[4].split()[-1] == "0.0" and lines[2].split()[-1] == "100.0"
    assert "highest rate with >= 90% attainment: 2 req/s" in table
    assert "prefix-cache hits at rate(s) inf" in table

    out = tmp_path / "sweep.json"
    load = LoadConfig(base_url="http://x", model="m", request_rate=INF)
    paths = write_sweep_report(str(out), result, load, Workload(dataset="random", num_prompts=4))
    assert paths == [str(out), str(tmp_path / "sweep.png")]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    assert report["max_rate_meeting_target"] == 2.0 and report["attainment_target"] == 90.0
    assert [r["request_rate"] for r in report["runs"]] == [1.0, 2.0, "inf"]
    assert [r["prefix_cache_hit_tokens"] for r in report["runs"]] == [0, 0, 32]
    assert report["server"]["state"].startswith("shared")
    assert report["config"]["workload"]["dataset"] == "random" and "request_rate" not in report["config"]
    assert all(len(r["records"]) == 4 for r in report["runs"])


def test_table_without_slo_or_passing_rate():
    records = run(0.05).records
    no_slo = BenchResult(compute_metrics(records, 4.0), records, "m")
    table = format_sweep_table(SweepResult([(1.0, no_slo)], None, 90.0))
    assert "no SLO given" in table and table.splitlines()[2].split()[-1] == "-"
    missed = format_sweep_table(SweepResult([(1.0, run(0.5))], None, 90.0))
    assert "no rate reached 90% attainment" in missed
