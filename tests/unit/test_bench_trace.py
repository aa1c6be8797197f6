"""The Perfetto/Chrome trace of hand-made request records: one process per run, one track per request,
complete ("X") slices for queueing, waiting+prefill, decode and every gap between tokens."""

from __future__ import annotations

import json

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.trace import trace_events, write_trace


def records() -> list[RequestRecord]:
    return [
        # sent at once; first token at 0.2 s; tokens 0.2, 0.25, 0.5 (a 250 ms stall), 0.55
        RequestRecord(0, 100, 4, 0.0, 0.0, [0.2, 0.25, 0.5, 0.55], 0.56, 4, True, success=True),
        # held back by the concurrency cap for 0.3 s; one token
        RequestRecord(1, 20, 1, 0.1, 0.4, [0.6], 0.6, 1, True, success=True),
        # failed
        RequestRecord(2, 30, 5, 0.2, 0.2, [], 0.3, 0, False, success=False, error="HTTP 503: busy"),
    ]


def slices(trace: dict, pid: int, tid: int) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid]


def test_structure():
    trace = trace_events({"prefill-first": records(), "chunked": records()[:1]})
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "M"}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "prefill-first", 2: "chunked"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert set(threads) == {(1, 0), (1, 1), (1, 2), (2, 0)}
    assert threads[(1, 0)] == "req 0 (100 in, 4 out)"
    for e in events:
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
    json.dumps(trace)  # serializable as is


def test_request_slices():
    trace = trace_events({"run": records()})
    first = slices(trace, 1, 0)
    assert [e["name"] for e in first] == ["waiting+prefill", "decode", "token", "token", "token"]
    prefill, decode, *tokens = first
    assert (prefill["ts"], prefill["dur"]) == (0, 200_000)
    assert (decode["ts"], decode["dur"]) == (200_000, 350_000)
    assert [t["dur"] for t in tokens] == [50_000, 250_000, 50_000]  # the stall is one long slice
    assert tokens[1]["args"] == {"index": 2, "itl_ms": 250.0}
    # token slices nest exactly inside decode
    assert tokens[0]["ts"] == decode["ts"]
    assert tokens[-1]["ts"] + tokens[-1]["dur"] == decode["ts"] + decode["dur"]

    queued, prefill1 = slices(trace, 1, 1)
    assert queued["name"] == "queued" and (queued["ts"], queued["dur"]) == (100_000, 300_000)
    assert prefill1["name"] == "waiting+prefill" and (prefill1["ts"], prefill1["dur"]) == (400_000, 200_000)

    (failed,) = slices(trace, 1, 2)
    assert failed["name"] == "failed" and failed["args"]["error"] == "HTTP 503: busy"
    assert (failed["ts"], failed["dur"]) == (200_000, 100_000)


def test_write_trace(tmp_path):
    path = write_trace({"run": records()}, str(tmp_path / "sub" / "trace.json"))
    loaded = json.loads(open(path).read())
    assert loaded == trace_events({"run": records()}) and loaded["displayTimeUnit"] == "ms"
