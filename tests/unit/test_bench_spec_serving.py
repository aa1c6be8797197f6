"""benchmarks/spec_serving.py's aggregation, with a fake runner in place of the servers: request counts
scale with the concurrency, the default SLO comes from the off TPOT at the lowest concurrency and judges
every point of its workload, ratios are on / off, acceptance comes from the speculating run only."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, SpecDecodeMetrics, compute_metrics
from pdserve.bench.serve_bench import BenchResult

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "spec_serving.py"
_spec = importlib.util.spec_from_file_location("spec_serving", PATH)
spec_serving = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("spec_serving", spec_serving)  # dataclasses look their module up there
_spec.loader.exec_module(spec_serving)  # type: ignore[union-attr]


def record(i: int, tpot_s: float, n_tokens: int = 11) -> RequestRecord:
    times = [0.1 + tpot_s * j for j in range(n_tokens)]
    return RequestRecord(req_id=i, prompt_len=10, requested_output_len=n_tokens, arrival_time=0.0,
                         token_times=times, end_time=times[-1], output_len=n_tokens, success=True)


def result(tpots: list[float], duration_s: float, accepted: tuple[int, int, int] | None = None) -> BenchResult:
    recs = [record(i, t) for i, t in enumerate(tpots)]
    spec = None
    if accepted is not None:
        drafts, tokens, acc = accepted
        spec = SpecDecodeMetrics(drafts, tokens, acc, acc / tokens, 1 + acc / drafts, [])
    return BenchResult(compute_metrics(recs, duration_s), recs, "m", None, spec)


def test_requests_scale_with_concurrency_within_bounds():
    assert [spec_serving.num_requests_for(c) for c in (1, 2, 4, 16, 64)] == [8, 8, 16, 64, 128]
    assert spec_serving.num_requests_for(64, minimum=8, per_stream=4, cap=512) == 256


def test_table_and_goodput_from_the_single_stream_tpot():
    calls = []

    def measure(workload, concurrency, modes):
        calls.append((workload, concurrency, [m.name for m in modes]))
        if concurrency == 1:  # off: 20 ms TPOT; on: 10 ms, 4 requests in 2 s vs 1 s
            return [result([0.020] * 4, 2.0), result([0.010] * 4, 1.0, (10, 40, 20))]
        # c = 4: off 8 requests at 70 ms (over 3 x 20 ms: all miss), on: half at 40, half at 70 ms
        return [result([0.070] * 8, 4.0), result([0.040] * 4 + [0.070] * 4, 5.0, (50, 200, 50))]

    points = spec_serving.run_points(["code-edit"], [1, 4], spec_serving.OFF, measure, log=lambda s: None)
    assert calls == [("code-edit", 1, ["off", "off"]), ("code-edit", 4, ["off", "off"])]
    slos = spec_serving.default_slos(points, factor=3.0)
    assert slos["code-edit"].tpot_ms == pytest.approx(60.0)
    rows = spec_serving.summarize(points, slos)
    one, four = rows
    assert one["req_s_off"] == pytest.approx(2.0) and one["req_s_on"] == pytest.approx(4.0)
    assert one["req_s_ratio"] == pytest.approx(2.0)
    assert one["tpot_p50_ms_off"] == pytest.approx(20.0) and one["tpot_p50_ms_on"] == pytest.approx(10.0)
    assert one["acceptance_rate"] == pytest.approx(0.5) and one["mean_acceptance_length"] == pytest.approx(3.0)
    assert one["goodput_req_s_off"] == pytest.approx(2.0) and one["goodput_req_s_on"] == pytest.approx(4.0)
    # c = 4 is judged by the c = 1 SLO (60 ms): off none good; on the four at 40 ms in 5 s.
    assert four["goodput_req_s_off"] == pytest.approx(0.0)
    assert four["goodput_req_s_on"] == pytest.approx(4 / 5.0)
    assert four["goodput_ratio"] is None  # off goodput 0: no ratio
    assert four["req_s_ratio"] == pytest.approx((8 / 5.0) / (8 / 4.0))
    assert four["acceptance_rate"] == pytest.approx(0.25)
    table = spec_serving.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split(" | ")[0].strip() == "workload" and len(lines) == 4
    cells = [c.strip() for c in lines[3].split(" | ")]
    assert cells[:5] == ["code-edit", "4", "8", "2.000 / 1.600", "0.80x"]
    assert cells[-2:] == ["0.25", "2.00"]
    assert "TPOT <= 60.0 ms" in spec_serving.slo_note(slos, 3.0)


def test_no_drafts_reads_as_dashes_and_failures_are_flagged():
    off, on = result([0.02] * 2, 1.0), result([0.02] * 2, 1.0)
    failed = RequestRecord(req_id=9, prompt_len=1, requested_output_len=1, arrival_time=0.0)
    on = BenchResult(compute_metrics([*on.records, failed], 1.0), [*on.records, failed], "m")
    rows = spec_serving.summarize([spec_serving.Point("sharegpt", 1, off, on)], {"sharegpt": SLO(tpot_ms=100)})
    assert rows[0]["acceptance_rate"] is None and rows[0]["num_drafts"] == 0
    table = spec_serving.format_table(rows)
    assert [c.strip() for c in table.splitlines()[2].split(" | ")][-2:] == ["-", "-"]
    assert "1 failed requests" in table


def test_spec_ngram_preset_is_the_default_on_mode():
    import json

    from pdserve.bench.presets import BUILTIN_PRESETS

    flag, config = BUILTIN_PRESETS["spec-ngram"].args
    assert flag == "--speculative-config"
    assert json.loads(config) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 5}


def test_compare_refuses_empty_samples_before_starting_a_server():
    from pdserve.bench.compare import run_compare
    from pdserve.config import Workload

    with pytest.raises(ValueError, match="empty"):
        run_compare([spec_serving.OFF], Workload(dataset="random", num_prompts=1), samples=[],
                    tokenizer=object())  # type: ignore[arg-type]


def test_abba_runs_off_on_on_off_and_reports_each_mode_s_mean():
    calls = []

    def measure(workload, concurrency, modes):
        calls.append([m.name for m in modes])
        # a host that slows down during the point: off 2.0 then 1.0 s, on 1.5 then 1.0 s (4 requests each)
        return [result([0.02] * 4, 2.0), result([0.01] * 4, 1.5, (10, 40, 20)), result([0.01] * 4, 1.0),
                result([0.02] * 4, 1.0)]

    points = spec_serving.run_points(["sharegpt"], [16], spec_serving.OFF, measure, log=lambda s: None, abba=True)
    assert calls == [["off", "off", "on-2", "off-2"]]  # (the OFF preset stands in for "on" here)
    (row,) = spec_serving.summarize(points, {})
    assert row["req_s_runs_off"] == pytest.approx([2.0, 4.0]) and row["req_s_runs_on"] == pytest.approx([4 / 1.5, 4.0])
    assert row["req_s_off"] == pytest.approx(3.0) and row["req_s_on"] == pytest.approx((4 / 1.5 + 4.0) / 2)
    assert row["req_s_ratio"] == pytest.approx((4 / 1.5 + 4.0) / 2 / 3.0)
    assert row["tpot_p50_ms_on"] == pytest.approx(10.0) and row["acceptance_rate"] == pytest.approx(0.5)
    assert [r.metrics.duration_s for r in spec_serving.measure_order(points[0])] == [2.0, 1.5, 1.0, 1.0]
