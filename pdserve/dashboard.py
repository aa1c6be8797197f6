"""`pdserve top`: a live view of running instances, prefill and decode side by side.

It polls each URL's `/metrics` (a `pdserve serve` instance, or a `pdserve router`, whose instances it
follows from the router's `pdserve:router_instance_up` labels) every `--interval` seconds and shows, per
instance, what changed since the last poll: the requests running / waiting / swapped and the KV cache's
use now; prompt and output tokens per second; engine steps that ran prompt tokens and steps that only
decoded, each with its rate and its p50 / p99 duration in the window (from the histograms' bucket
counts, interpolated within a bucket as Prometheus' `histogram_quantile` does); TTFT and ITL p50 / p99
of the window; preemptions, prefix-cache hits, KV moved between instances, speculative acceptance and
the share of finished requests that met all their latency targets.
A router's own row: requests by outcome, retries, time to first byte.

`--once` prints one window (two polls, `one_window`) and exits; `--json` prints it as JSON (for scripts and
tests).
Nothing here talks to the engine but HTTP: it works against any pdserve host it can reach.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: Samples, name: str, **match: str) -> float | None:
    """The sum of `name` over the label sets that have `match`; None if there is none."""
    values = [v for (n, labels), v in samples.items() if n == name and set(match.items()) <= set(labels)]
    return sum(values) if values else None


def buckets(samples: Samples, name: str, **match: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts {upper bound: count}, summed over matching label sets."""
    out: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n != f"{name}_bucket" or not set(match.items()) <= set(labels):
            continue
        le = float(dict(labels)["le"])
        out[le] = out.get(le, 0.0) + v
    return out


def quantile(q: float, now: Mapping[float, float], before: Mapping[float, float] | None = None) -> float | None:
    """The q-quantile of the observations between two reads of one histogram's cumulative buckets,
    linear within a bucket (Prometheus' `histogram_quantile`); the highest finite bound when it falls in
    the +Inf bucket; None without observations."""
    before = before or {}
    bounds = sorted(now)
    counts = [now[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts):
        if cum >= rank:
            if math.isinf(bound):
                return lower
            width = cum - below
            return lower + (bound - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = bound, cum
    return lower


@dataclass
class Window:
    """What one instance did between two polls (rates per second, durations in seconds; None: no data)."""

    url: str
    role: str = "?"
    up: bool = True
    error: str | None = None
    running: float | None = None
    waiting: float | None = None
    swapped: float | None = None
    kv_usage: float | None = None
    prompt_tokens_per_s: float | None = None
    output_tokens_per_s: float | None = None
    finished_per_s: float | None = None
    preemptions_per_s: float | None = None
    prefix_hit_ratio: float | None = None
    prefill_steps_per_s: float | None = None
    prefill_step_p50: float | None = None
    prefill_step_p99: float | None = None
    decode_steps_per_s: float | None = None
    decode_step_p50: float | None = None
    decode_step_p99: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    kv_sent_mb_per_s: float | None = None
    kv_received_mb_per_s: float | None = None
    spec_acceptance: float | None = None
    slo_met_ratio: float | None = None  # of the requests with targets that finished in the window: all met
    router: dict[str, float | None] = field(default_factory=dict)  # a router's own figures


def _rate(now: Samples, before: Samples, dt: float, name: str, **match: str) -> float | None:
    a, b = total(now, name, **match), total(before, name, **match)
    if a is None or dt <= 0:
        return None
    return max(0.0, a - (b or 0.0)) / dt


def _hist(now: Samples, before: Samples, dt: float, name: str) -> tuple[float | None, float | None, float | None]:
    """(observations per second, p50, p99) of a histogram in the window."""
    b_now, b_before = buckets(now, name), buckets(before, name)
    return (_rate(now, before, dt, f"{name}_count"), quantile(0.5, b_now, b_before), quantile(0.99, b_now, b_before))


def window(url: str, role: str, now: Samples, before: Samples, dt: float) -> Window:
    """One instance's window from two reads of its /metrics `dt` seconds apart."""
    w = Window(url, role)
    w.running = total(now, "pdserve:num_requests_running")
    w.waiting = total(now, "pdserve:num_requests_waiting")
    w.swapped = total(now, "pdserve:num_requests_swapped")
    w.kv_usage = total(now, "pdserve:kv_cache_usage_ratio")
    w.prompt_tokens_per_s = _rate(now, before, dt, "pdserve:prompt_tokens_total")
    w.output_tokens_per_s = _rate(now, before, dt, "pdserve:generation_tokens_total")
    w.finished_per_s = _rate(now, before, dt, "pdserve:request_finished_total")
    w.preemptions_per_s = _rate(now, before, dt, "pdserve:preemptions_total")
    hit = _rate(now, before, dt, "pdserve:prefix_cache_hit_tokens_total")
    queried = _rate(now, before, dt, "pdserve:prefix_cache_queried_tokens_total")
    w.prefix_hit_ratio = hit / queried if hit is not None and queried else None
    w.prefill_steps_per_s, w.prefill_step_p50, w.prefill_step_p99 = _hist(
        now, before, dt, "pdserve:prefill_step_duration_seconds")
    w.decode_steps_per_s, w.decode_step_p50, w.decode_step_p99 = _hist(
        now, before, dt, "pdserve:decode_step_duration_seconds")
    _, w.ttft_p50, w.ttft_p99 = _hist(now, before, dt, "pdserve:time_to_first_token_seconds")
    _, w.itl_p50, w.itl_p99 = _hist(now, before, dt, "pdserve:inter_token_latency_seconds")
    sent = _rate(now, before, dt, "pdserve:kv_transfer_bytes_total", direction="send")
    received = _rate(now, before, dt, "pdserve:kv_transfer_bytes_total", direction="receive")
    w.kv_sent_mb_per_s = None if sent is None else sent / 1e6
    w.kv_received_mb_per_s = None if received is None else received / 1e6
    drafted = _rate(now, before, dt, "pdserve:spec_decode_num_draft_tokens_total")
    accepted = _rate(now, before, dt, "pdserve:spec_decode_num_accepted_tokens_total")
    w.spec_acceptance = accepted / drafted if accepted is not None and drafted else None
    met = _rate(now, before, dt, "pdserve:request_slo_met_total", target="all")
    missed = _rate(now, before, dt, "pdserve:request_slo_missed_total", target="all")
    judged = (met or 0.0) + (missed or 0.0)
    w.slo_met_ratio = (met or 0.0) / judged if judged else None
    return w


def router_window(url: str, now: Samples, before: Samples, dt: float) -> Window:
    w = Window(url, "router")
    w.router = {
        f"{outcome}_per_s": _rate(now, before, dt, "pdserve:router_requests_total", outcome=outcome)
        for outcome in ("ok", "rejected", "failed", "unavailable", "cancelled")
    }
    w.router["retries_per_s"] = _rate(now, before, dt, "pdserve:router_retries_total")
    w.router["in_flight"] = total(now, "pdserve:router_requests_in_flight")
    _, w.router["first_byte_p50"], w.router["first_byte_p99"] = _hist(
        now, before, dt, "pdserve:router_time_to_first_byte_seconds")
    w.ttft_p50, w.ttft_p99 = w.router["first_byte_p50"], w.router["first_byte_p99"]
    return w


def router_instances(samples: Samples) -> list[tuple[str, str]]:
    """(url, role) of the instances a router's /metrics names."""
    found = []
    for (name, labels), _ in samples.items():
        if name == "pdserve:router_instance_up":
            d = dict(labels)
            found.append((d["url"], d["role"]))
    return sorted(set(found))


MAX_INSTANCES = 64  # rows followed from routers' labels (what a router names is only polled over HTTP(S))


class Poller:
    """Reads /metrics of the given URLs (and of the instances behind a router, at most `MAX_INSTANCES`)
    and keeps the last read of each, so every `poll` returns the windows since the previous one."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None, timeout: float = 5.0) -> None:
        import httpx

        self.urls = [u.rstrip("/") for u in urls]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.last: dict[str, tuple[float, Samples]] = {}
        self.roles: dict[str, str] = {}  # an instance's role as its /load says (prefill, decode, both)

    def _read(self, url: str) -> Samples:
        r = self.client.get(url + "/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    def poll(self) -> list[Window]:
        out: list[Window] = []
        seen: set[str] = set()
        targets: list[tuple[str, str | None]] = [(u, None) for u in self.urls]
        while targets:
            url, role = targets.pop(0)
            if url in seen:
                continue
            seen.add(url)
            t = time.monotonic()
            try:
                now = self._read(url)
            except Exception as e:  # noqa: BLE001 - an instance down is a row, not a crash
                out.append(Window(url, role or "?", up=False, error=f"{type(e).__name__}: {e}"[:120]))
                continue
            t_before, before = self.last.get(url, (t, {}))
            self.last[url] = (t, now)
            dt = t - t_before
            instances = router_instances(now)
            if instances:
                out.append(router_window(url, now, before, dt))
                followed = [(u, r) for u, r in instances if u.startswith(("http://", "https://"))]
                targets.extend(followed[: max(0, MAX_INSTANCES - len(seen) - len(targets))])
            else:
                out.append(window(url, role or self._role(url), now, before, dt))
        return out

    def _role(self, url: str) -> str:
        """The role in the instance's GET /load, asked once ("instance" if it will not say: a cluster
        secret guards /load)."""
        if url not in self.roles:
            try:
                r = self.client.get(url + "/load")
                role = r.json().get("role") if r.status_code == 200 else None
            except Exception:  # noqa: BLE001 - only a label
                role = None
            self.roles[url] = role if isinstance(role, str) and role.isidentifier() else "instance"
        return self.roles[url]

    def close(self) -> None:
        self.client.close()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:,.0f}" if v >= 0.1 else f"{1e3 * v:.1f}"


def _num(v: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(windows: Sequence[Window], interval: float) -> Any:
    """A rich table: one row per instance, prefill and decode columns side by side."""
    from rich.table import Table

    table = Table(title=f"pdserve top: the last {interval:g} s (durations in ms, p50/p99)", title_justify="left")
    for name, justify in (("instance", "left"), ("role", "left"), ("run/wait/swap", "right"), ("KV", "right"),
                          ("prompt tok/s", "right"), ("prefill steps/s", "right"), ("prefill step", "right"),
                          ("out tok/s", "right"), ("decode steps/s", "right"), ("decode step", "right"),
                          ("TTFT", "right"), ("ITL", "right"), ("other", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "other")  # type: ignore[arg-type]
    for w in windows:
        if not w.up:
            table.add_row(_host(w.url), w.role, "[red]down[/red]", *[""] * 9, w.error or "")
            continue
        if w.role == "router":
            r = w.router
            other = (f"ok {_num(r.get('ok_per_s'))}/s  failed {_num(r.get('failed_per_s'))}/s  "
                     f"retries {_num(r.get('retries_per_s'))}/s  in flight {_num(r.get('in_flight'), '{:.0f}')}"
                     "  (TTFT: to the first byte)")
            table.add_row(_host(w.url), "router", *[""] * 8, f"{_ms(w.ttft_p50)}/{_ms(w.ttft_p99)}", "", other)
            continue
        other = []
        if w.preemptions_per_s:
            other.append(f"preempt {w.preemptions_per_s:.1f}/s")
        if w.prefix_hit_ratio is not None:
            other.append(f"prefix hit {100 * w.prefix_hit_ratio:.0f}%")
        if w.kv_sent_mb_per_s:
            other.append(f"KV out {w.kv_sent_mb_per_s:.1f} MB/s")
        if w.kv_received_mb_per_s:
            other.append(f"KV in {w.kv_received_mb_per_s:.1f} MB/s")
        if w.spec_acceptance is not None:
            other.append(f"spec accept {100 * w.spec_acceptance:.0f}%")
        if w.slo_met_ratio is not None:
            other.append(f"SLO met {100 * w.slo_met_ratio:.0f}%")
        table.add_row(
            _host(w.url), w.role,
            f"{_num(w.running, '{:.0f}')}/{_num(w.waiting, '{:.0f}')}/{_num(w.swapped, '{:.0f}')}",
            _num(None if w.kv_usage is None else 100 * w.kv_usage, "{:.0f}%"),
            _num(w.prompt_tokens_per_s, "{:,.0f}"), _num(w.prefill_steps_per_s),
            f"{_ms(w.prefill_step_p50)}/{_ms(w.prefill_step_p99)}",
            _num(w.output_tokens_per_s, "{:,.0f}"), _num(w.decode_steps_per_s),
            f"{_ms(w.decode_step_p50)}/{_ms(w.decode_step_p99)}",
            f"{_ms(w.ttft_p50)}/{_ms(w.ttft_p99)}", f"{_ms(w.itl_p50)}/{_ms(w.itl_p99)}", "  ".join(other),
        )
    return table


def _host(url: str) -> str:
    return url.split("://", 1)[-1]


def one_window(urls: Sequence[str], interval: float, api_key: str | None = None) -> list[Window]:
    """Two polls `interval` seconds apart: what every instance did in between."""
    poller = Poller(urls, api_key)
    try:
        poller.poll()
        time.sleep(interval)
        return poller.poll()
    finally:
        poller.close()


def live(urls: Sequence[str], interval: float = 2.0, api_key: str | None = None) -> None:
    """The table, redrawn every `interval` seconds until Ctrl-C."""
    from rich.live import Live

    poller = Poller(urls, api_key)
    try:
        poller.poll()  # the first read: the windows start here
        with Live(render([], interval), auto_refresh=False) as view:
            while True:
                time.sleep(interval)
                view.update(render(poller.poll(), interval), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        poller.close()


def as_json(windows: Sequence[Window]) -> str:
    return json.dumps([asdict(w) for w in windows], indent=1)
