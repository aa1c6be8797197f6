"""Benchmark figures as PNG files: TTFT and ITL CDFs (one line per run), latency percentiles against request
rate, and a per-request timeline where decode stalls are visible.

Figures are built on `matplotlib.figure.Figure` and written by its Agg canvas, never through pyplot: no
global figure state and no GUI backend. matplotlib is imported here only, and callers import this module
only when asked for a plot.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, PercentFormatter

from pdserve.bench.metrics import BenchMetrics, RequestRecord


def _save(fig: Figure, path: str) -> str:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    return path


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:  # type: ignore[no-untyped-def]
    x = np.sort(np.asarray(values_ms, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(x, y, where="post", label=f"{label} (n={len(x)})")


def plot_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: str) -> str:
    """TTFT (per request) and ITL (every gap, pooled) CDFs of completed requests, one line per run."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_ttft, ax_itl = fig.subplots(1, 2)
    for label, records in runs.items():
        done = [r for r in records if r.success and r.token_times]
        ttfts = [r.ttft * 1000.0 for r in done]
        itls = [gap * 1000.0 for r in done for gap in r.itls]
        if ttfts:
            _cdf(ax_ttft, ttfts, label)
        if itls:
            _cdf(ax_itl, itls, label)
    for ax, title in ((ax_ttft, "TTFT (per request)"), (ax_itl, "ITL (every gap between tokens)")):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction <= x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            low = min(line.get_xdata().min() for line in ax.lines)
            high = max(line.get_xdata().max() for line in ax.lines)
            if low > 0 and high > 10 * low:  # long tails: spread the decades
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(LogFormatter())
                ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_latency_vs_rate(
    points: Sequence[tuple[float, BenchMetrics]], path: str, title: str = "latency vs request rate"
) -> str:
    """TTFT, TPOT and ITL percentiles and SLO attainment against the request rate (rates in increasing
    order, evenly spaced, inf last)."""
    points = sorted(points, key=lambda p: p[0])
    x = np.arange(len(points))
    labels = ["inf" if math.isinf(rate) else f"{rate:g}" for rate, _ in points]
    ms = [m for _, m in points]
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax_ttft, ax_tok, ax_slo = fig.subplots(1, 3)
    ax_ttft.plot(x, [m.ttft.median for m in ms], "o-", label="TTFT p50")
    ax_ttft.plot(x, [m.ttft.p99 for m in ms], "o--", label="TTFT p99")
    ax_ttft.set_title("time to first token")
    ax_tok.plot(x, [m.tpot.median for m in ms], "o-", label="TPOT p50")
    ax_tok.plot(x, [m.itl.median for m in ms], "s-", label="ITL p50")
    ax_tok.plot(x, [m.itl.p99 for m in ms], "s--", label="ITL p99")
    ax_tok.set_title("time per output token / inter-token latency")
    for ax in (ax_ttft, ax_tok):
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
    attainment = [m.slo_attainment for m in ms]
    if any(a is not None for a in attainment):
        ax_slo.plot(x, [np.nan if a is None else a for a in attainment], "o-", label="SLO attainment")
        ax_slo.axhline(90.0, color="grey", linestyle=":", label="90% target")
        ax_slo.set_ylim(0, 105)
        ax_slo.yaxis.set_major_formatter(PercentFormatter())
    else:
        ax_slo.text(0.5, 0.5, "no SLO given", ha="center", va="center", transform=ax_slo.transAxes)
    ax_slo.set_title("SLO attainment")
    for ax in (ax_ttft, ax_tok, ax_slo):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def plot_timeline(
    records: Sequence[RequestRecord], path: str, *, start: int = 0, count: int = 40, title: str = ""
) -> str:
    """A Gantt chart of requests `start .. start+count` in arrival order: queued at the client (arrival ->
    send, under a concurrency cap), waiting+prefill (send -> first token: the client cannot split the
    two), decode (first -> last token) with a tick per streamed chunk. A long gap between ticks is a
    decode stalled by other work, such as a long prompt's prefill."""
    window = sorted(records, key=lambda r: (r.arrival_time, r.req_id))[start : start + count]
    fig = Figure(figsize=(12, max(3.0, 0.28 * len(window) + 1.6)), layout="constrained")
    ax = fig.subplots()
    rows = np.arange(len(window))

    def bars(starts: list[float], ends: list[float], ys: list[int], color: str, label: str) -> None:
        if ys:
            widths = np.maximum(np.asarray(ends) - np.asarray(starts), 0.0)
            ax.barh(ys, widths, left=starts, height=0.6, color=color, label=label)

    queued = [(r.arrival_time, r.send_time, y) for y, r in zip(rows, window) if r.send_time > r.arrival_time]
    ok = [(r, y) for y, r in zip(rows, window) if r.success and r.token_times]
    failed = [(r, y) for y, r in zip(rows, window) if not (r.success and r.token_times)]
    bars([q[0] for q in queued], [q[1] for q in queued], [q[2] for q in queued], "#bbbbbb", "queued (client)")
    bars([r.send_time for r, _ in ok], [r.token_times[0] for r, _ in ok], [y for _, y in ok],
         "#f4a259", "waiting+prefill")
    bars([r.token_times[0] for r, _ in ok], [r.token_times[-1] for r, _ in ok], [y for _, y in ok],
         "#8ecae6", "decode")
    bars([r.send_time for r, _ in failed], [r.end_time for r, _ in failed], [y for _, y in failed],
         "#d62828", "failed")
    ticks_x = [t for r, _ in ok for t in r.token_times]
    ticks_y = [y for r, y in ok for _ in r.token_times]
    if ticks_x:
        ax.scatter(ticks_x, ticks_y, marker="|", s=40, linewidths=0.8, color="#023047", label="token")
    ax.set_yticks(rows, [f"#{r.req_id} ({r.prompt_len} in)" for r in window], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the start of the run")
    ax.grid(axis="x", alpha=0.3)
    if window:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, "no requests", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title or f"requests {start}..{start + len(window) - 1} by arrival")
    return _save(fig, path)
