"""Per-request timelines as a Chrome/Perfetto trace (open the JSON in ui.perfetto.dev or chrome://tracing).

One process per run (a rate of a sweep, a mode of a comparison), one thread (track) per request. Each
request is a row of complete ("X") events on the client's clock, in microseconds since the run started:

- `queued`: arrival -> send, only when `--max-concurrency` held the request back;
- `waiting+prefill`: send -> first token (the server's queueing and the prompt's prefill: the client
  cannot tell them apart);
- `decode`: first -> last token, holding one `token` slice per gap between streamed chunks, so a decode
  stalled behind someone else's prefill shows up as one long slice;
- `failed`: send -> end of the stream, with the error, for a request that failed.

Times are whole microseconds so that a child slice ends exactly where its parent does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from pdserve.bench.metrics import RequestRecord


def _us(t: float) -> int:
    return round(t * 1e6)


def _slice(name: str, pid: int, tid: int, start: float, end: float, args: dict | None = None) -> dict:
    ts = _us(start)
    event = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(0, _us(end) - ts)}
    if args:
        event["args"] = args
    return event


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def request_events(rec: RequestRecord, pid: int) -> list[dict]:
    """The metadata and slices of one request's track."""
    tid = rec.req_id
    events = [
        _meta("thread_name", pid, tid, {"name": f"req {tid} ({rec.prompt_len} in, {rec.output_len} out)"}),
        _meta("thread_sort_index", pid, tid, {"sort_index": rec.req_id}),
    ]
    if rec.send_time > rec.arrival_time:
        events.append(_slice("queued", pid, tid, rec.arrival_time, rec.send_time))
    if not rec.success or not rec.token_times:
        events.append(_slice("failed", pid, tid, rec.send_time, rec.end_time, {"error": rec.error}))
        return events
    times = rec.token_times
    events.append(
        _slice("waiting+prefill", pid, tid, rec.send_time, times[0], {"prompt_tokens": rec.prompt_len})
    )
    if len(times) > 1:
        events.append(
            _slice(
                "decode", pid, tid, times[0], times[-1],
                {"output_tokens": rec.output_len, "chunks": len(times)},
            )
        )
        events += [
            _slice("token", pid, tid, a, b, {"index": i, "itl_ms": round((b - a) * 1000.0, 3)})
            for i, (a, b) in enumerate(zip(times, times[1:]), start=1)
        ]
    return events


def trace_events(runs: Mapping[str, Sequence[RequestRecord]]) -> dict:
    """The trace of every run: {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    events: list[dict] = []
    for pid, (label, records) in enumerate(runs.items(), start=1):
        events.append(_meta("process_name", pid, 0, {"name": label}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        for rec in records:
            events += request_events(rec, pid)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(runs: Mapping[str, Sequence[RequestRecord]], path: str) -> str:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace_events(runs), f)
    return path
