"""Benchmark metric math on hand-made traces whose TTFT, TPOT, ITL, percentiles and goodput are known."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.client import arrival_offsets
from pdserve.bench.metrics import SLO, RequestRecord, compute_metrics, parse_slo


def rec(req_id: int, send: float, token_times: list[float], end: float, prompt_len: int = 10,
        output_len: int | None = None, success: bool = True) -> RequestRecord:
    n = len(token_times) if output_len is None else output_len
    return RequestRecord(
        req_id=req_id, prompt_len=prompt_len, requested_output_len=n, arrival_time=send, send_time=send,
        token_times=list(token_times), end_time=end, output_len=n, usage_reported=True, success=success,
        error="" if success else "boom",
    )


# A: TTFT 0.1 s, gaps 0.1/0.1/0.1, latency 0.4 -> TPOT (0.4-0.1)/3 = 0.1
# B: TTFT 0.3 s, gaps 0.05/0.45, latency 0.8 -> TPOT (0.8-0.3)/2 = 0.25
# C: TTFT 0.2 s, one token, latency 0.2 -> no TPOT, no ITL
# D: failed
def trace() -> list[RequestRecord]:
    return [
        rec(0, 0.0, [0.1, 0.2, 0.3, 0.4], 0.4, prompt_len=10),
        rec(1, 1.0, [1.3, 1.35, 1.8], 1.8, prompt_len=20),
        rec(2, 2.0, [2.2], 2.2, prompt_len=30),
        rec(3, 3.0, [], 3.1, prompt_len=40, success=False),
    ]


def test_per_request_values():
    a, b, c, _ = trace()
    assert a.ttft == pytest.approx(0.1) and a.tpot == pytest.approx(0.1)
    assert a.itls == pytest.approx([0.1, 0.1, 0.1])
    assert b.ttft == pytest.approx(0.3) and b.tpot == pytest.approx(0.25) and b.latency == pytest.approx(0.8)
    assert b.itls == pytest.approx([0.05, 0.45])
    assert c.tpot is None and c.itls == []


def test_tpot_uses_server_token_count_not_chunks():
    # Five tokens in three chunks (the server merged some): TPOT divides by output_len - 1 = 4.
    r = rec(0, 0.0, [0.2, 0.4, 1.0], 1.0, output_len=5)
    assert r.tpot == pytest.approx((1.0 - 0.2) / 4)
    assert r.itls == pytest.approx([0.2, 0.6])


def test_summary_counts_and_throughput():
    m = compute_metrics(trace(), duration_s=4.0)
    assert (m.num_requests, m.completed, m.failed) == (4, 3, 1)
    assert m.total_input_tokens == 60  # the failed request's 40 is not counted
    assert m.total_output_tokens == 8
    assert m.request_throughput == pytest.approx(0.75)
    assert m.output_throughput == pytest.approx(2.0)
    assert m.total_token_throughput == pytest.approx(17.0)
    assert m.slo is None and m.goodput is None and m.slo_attainment is None and m.num_good is None


def test_distributions_in_ms():
    m = compute_metrics(trace(), duration_s=4.0)
    # TTFT over completed requests: 100, 300, 200 ms.
    assert m.ttft.count == 3
    assert m.ttft.mean == pytest.approx(200.0) and m.ttft.median == pytest.approx(200.0)
    # Linear interpolation: p90 of [100, 200, 300] sits at rank 1.8 -> 200 + 0.8 * 100.
    assert m.ttft.p90 == pytest.approx(280.0) and m.ttft.p99 == pytest.approx(298.0)
    # TPOT only for A and B: 100, 250 ms.
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(175.0) and m.tpot.median == pytest.approx(175.0)
    # ITL pooled over requests: 100, 100, 100, 50, 450 ms -> sorted 50, 100, 100, 100, 450.
    assert m.itl.count == 5
    assert m.itl.mean == pytest.approx(160.0) and m.itl.median == pytest.approx(100.0)
    # p90 at rank 3.6 -> 100 + 0.6 * 350; p99 at rank 3.96 -> 100 + 0.96 * 350.
    assert m.itl.p90 == pytest.approx(310.0) and m.itl.p99 == pytest.approx(436.0)
    # p99.9 at rank 3.996 -> 100 + 0.996 * 350; the worst gap is the 450 ms stall.
    assert m.itl.p999 == pytest.approx(448.6) and m.itl.max == pytest.approx(450.0)
    # E2E: 400, 800, 200 ms.
    assert m.e2el.mean == pytest.approx(1400.0 / 3) and m.e2el.median == pytest.approx(400.0)


def test_goodput_each_target():
    records = trace()
    # TTFT <= 250 ms: A (100) and C (200) pass, B (300) misses, D failed.
    m = compute_metrics(records, 4.0, SLO(ttft_ms=250))
    assert m.num_good == 2 and m.goodput == pytest.approx(0.5) and m.slo_attainment == pytest.approx(50.0)
    # TPOT <= 200 ms: A (100) passes, B (250) misses, C has no TPOT and passes.
    m = compute_metrics(records, 4.0, SLO(tpot_ms=200))
    assert m.num_good == 2
    # ITL <= 200 ms: every gap of A is 100; B has a 450 ms gap although its mean TPOT is 250; C has none.
    m = compute_metrics(records, 4.0, SLO(itl_ms=200))
    assert m.num_good == 2
    # ITL <= 460 ms lets B through too: all three completed requests.
    m = compute_metrics(records, 4.0, SLO(itl_ms=460))
    assert m.num_good == 3 and m.goodput == pytest.approx(0.75) and m.slo_attainment == pytest.approx(75.0)
    # Every target must hold: TTFT <= 250 keeps A and C, TPOT <= 50 drops A -> only C.
    m = compute_metrics(records, 4.0, SLO(ttft_ms=250, tpot_ms=50))
    assert m.num_good == 1 and m.goodput == pytest.approx(0.25) and m.slo_attainment == pytest.approx(25.0)


def test_boundary_counts_as_met():
    r = rec(0, 0.0, [0.25, 0.5], 0.5)  # TTFT exactly 250 ms, one 250 ms gap
    assert SLO(ttft_ms=250, tpot_ms=250, itl_ms=250).is_met_by(r)
    assert not SLO(ttft_ms=249.9).is_met_by(r)
    assert not SLO(itl_ms=249.9).is_met_by(r)


def test_no_completed_requests():
    m = compute_metrics([rec(0, 0.0, [], 1.0, success=False)], 1.0, SLO(ttft_ms=100))
    assert m.completed == 0 and m.ttft.count == 0 and m.ttft.p99 == 0.0
    assert m.num_good == 0 and m.slo_attainment == 0.0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_parse_slo():
    assert parse_slo("ttft=200,tpot=50,itl=100") == SLO(200.0, 50.0, 100.0)
    assert parse_slo(" TPOT = 40 ") == SLO(None, 40.0, None)
    assert parse_slo("itl=7.5,ttft=1000") == SLO(1000.0, None, 7.5)
    for bad in ("", "ttft", "ttft=abc", "e2e=5", "ttft=0", "ttft=-3", "ttft=1,ttft=2", ","):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_arrival_offsets():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(0, 2.0, 1.0, 0) == []
    offsets = arrival_offsets(4000, 10.0, 1.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == arrival_offsets(4000, 10.0, 1.0, seed=1)  # seeded
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    # Burstiness shapes the spread at the same mean: the gamma's coefficient of variation is 1/sqrt(shape).
    for shape in (0.25, 1.0, 4.0):
        o = arrival_offsets(4000, 10.0, shape, seed=2)
        g = [b - a for a, b in zip(o, o[1:])]
        mu = sum(g) / len(g)
        cv = (sum((x - mu) ** 2 for x in g) / len(g)) ** 0.5 / mu
        assert mu == pytest.approx(0.1, rel=0.1)
        assert cv == pytest.approx(1 / shape**0.5, rel=0.15), shape


def test_output_len_mismatches_counted_over_checked_completed_requests():
    records = trace()
    assert compute_metrics(records, 4.0).output_len_mismatches is None  # nothing re-counted
    records[0].tokenizer_output_len = 4  # agrees
    records[1].tokenizer_output_len = 2  # the server said 3
    records[3].tokenizer_output_len = 9  # failed: not counted
    assert compute_metrics(records, 4.0).output_len_mismatches == 1


def test_streamed_text_of_completions_and_chat_chunks():
    from pdserve.bench.client import _choice_text

    assert _choice_text({"index": 0, "text": "Hello", "finish_reason": None}) == "Hello"
    assert _choice_text({"index": 0, "delta": {"content": " world"}}) == " world"
    assert _choice_text({"index": 0, "delta": {"role": "assistant"}}) == ""
    assert _choice_text({"index": 0, "delta": {"content": None}, "finish_reason": "length"}) == ""


def test_slo_classes_parse_assign_and_judge_each_request_by_its_own():
    from pdserve.bench.client import request_body
    from pdserve.bench.datasets import SampleRequest
    from pdserve.bench.metrics import assign_slo_classes, parse_slo_classes
    from pdserve.config import LoadConfig

    classes = parse_slo_classes("ttft=150,itl=150@1; ttft=5000,tpot=300@3")
    assert classes == [(SLO(150.0, None, 150.0), 1.0), (SLO(5000.0, 300.0, None), 3.0)]
    assert parse_slo_classes("ttft=100") == [(SLO(100.0, None, None), 1.0)]
    for bad in ("", ";", "ttft=100@0", "ttft=100@x", "e2e=5@1"):
        with pytest.raises(ValueError):
            parse_slo_classes(bad)
    drawn = assign_slo_classes(classes, 400, seed=0)
    assert drawn == assign_slo_classes(classes, 400, seed=0)  # seeded
    assert 60 < sum(s == classes[0][0] for s in drawn) < 140  # about a quarter

    body = request_body(LoadConfig(base_url="http://x", model="m"), SampleRequest("hi", 1, 4), classes[0][0])
    assert (body["slo_ttft_ms"], body["slo_itl_ms"]) == (150.0, 150.0) and "slo_tpot_ms" not in body
    plain = request_body(LoadConfig(base_url="http://x", model="m"), SampleRequest("hi", 1, 4))
    assert "slo_ttft_ms" not in plain

    # A (TTFT 100 ms, gaps 100 ms) judged by the tight class meets it; B (TTFT 300 ms) misses it; C
    # (TTFT 200 ms, one token) by the loose class meets it; D failed. Without --slo, goodput counts
    # from the records' own.
    records = trace()
    for r, s in zip(records, [classes[0][0], classes[0][0], classes[1][0], classes[1][0]]):
        r.slo = s
    m = compute_metrics(records, 4.0)
    assert m.slo is None and m.num_good == 2 and m.slo_attainment == pytest.approx(50.0)
    assert compute_metrics(trace(), 4.0).num_good is None  # no targets anywhere: no goodput
