"""Serving goodput with and without speculative decoding, side by side in one run (issue 16, item 6).

    .venv/bin/python benchmarks/spec_serving.py [--workloads sharegpt,code-edit] [--concurrency 1,4,16,64]
        [--model NAME] [--speculative-config JSON] [--slo tpot=MS | --slo-tpot-factor 3] [--out r.json]
    .venv/bin/python benchmarks/spec_serving.py --quick          # a tiny smoke run
    .venv/bin/python benchmarks/spec_serving.py --abba ...       # off, on, on, off per point
    .venv/bin/python benchmarks/spec_serving.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --workloads code-edit --concurrency 1,4,16

For each workload and concurrency this is one `pdserve bench compare` (`pdserve/bench/compare.py`) of two
modes: a fresh `pdserve serve` without speculation, then a fresh one with `--speculative-config` (the
`spec-ngram` preset, n-gram k = 4, unless --speculative-config or --draft-model is given), each sent the
same seeded requests at `--max-concurrency` = the concurrency, all due at once. `--abba` runs each point
off, on, on, off and reports each mode's mean over its two runs (speed that drifts during a point then
weighs on both modes alike; acceptance is the first "on" run's). Workloads: ShareGPT on
/v1/completions and the bench's code-edit dataset on /v1/chat/completions. Requests per point scale with
the concurrency: min(cap, max(min, per_stream x concurrency)); output lengths are capped
(`--max-output-len`) so that a run fits its time.

Goodput: requests meeting the SLO per second. Default SLO, per workload: TPOT <= factor x (the
non-speculative TPOT p50 at the lowest concurrency of the run), i.e. "within factor x of the unloaded
speed"; `--slo` sets absolute targets instead. The SLO is applied after the runs to every point's records
(`metrics.compute_metrics`), so every point of a workload is judged by the same targets.

Prints one table (per workload and concurrency: req/s off / on / ratio, output tok/s, TPOT p50, ITL p50 /
p99, goodput, draft acceptance rate and mean acceptance length) and writes JSON (`--out`) with the host
(`pdserve.bench.machine.measure_machine`: CPU, flags, DRAM read bandwidth, matmul roofs). ITL is per
streamed chunk: a verification step that yields several tokens streams them together, so ITL is the
time between a request's steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from pdserve.bench.metrics import SLO, BenchMetrics, compute_metrics, parse_slo
from pdserve.bench.presets import BUILTIN_PRESETS, Preset
from pdserve.bench.serve_bench import BenchResult, num_text

# Workload name -> (bench dataset, endpoint).
WORKLOADS = {"sharegpt": ("sharegpt", "completions"), "code-edit": ("code-edit", "chat")}
OFF = Preset("off", (), "no speculation")


@dataclass(frozen=True, slots=True)
class Point:
    """One workload at one concurrency: the same requests without and with speculation (`--abba`: a
    second run of each, in the order off, on, on, off)."""

    workload: str
    concurrency: int
    off: BenchResult
    on: BenchResult
    off2: BenchResult | None = None
    on2: BenchResult | None = None

    def runs(self, mode: str) -> list[BenchResult]:
        first, second = (self.off, self.off2) if mode == "off" else (self.on, self.on2)
        return [first] if second is None else [first, second]


def num_requests_for(concurrency: int, minimum: int = 8, per_stream: int = 4, cap: int = 128) -> int:
    """Requests sent at one concurrency: enough for several rounds of every stream, within a cap."""
    return min(cap, max(minimum, per_stream * concurrency))


def default_slos(points: Sequence[Point], factor: float) -> dict[str, SLO]:
    """Per workload: TPOT <= factor x the non-speculative TPOT p50 at its lowest concurrency."""
    slos: dict[str, SLO] = {}
    for workload in dict.fromkeys(p.workload for p in points):
        base = min((p for p in points if p.workload == workload), key=lambda p: p.concurrency)
        tpot = base.off.metrics.tpot.median
        if tpot is not None and tpot > 0:
            slos[workload] = SLO(tpot_ms=factor * tpot)
    return slos


def _judged(result: BenchResult, slo: SLO | None) -> BenchMetrics:
    m = result.metrics
    return compute_metrics(result.records, m.duration_s, slo) if slo is not None else m


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _ratio(on: float | None, off: float | None) -> float | None:
    if on is None or off is None or not off > 0:
        return None
    return on / off


def summarize(points: Sequence[Point], slos: dict[str, SLO]) -> list[dict]:
    """One row per point: off / on figures, the on / off ratios and the speculating run's acceptance."""
    rows = []
    for p in points:
        slo = slos.get(p.workload)
        offs = [_judged(r, slo) for r in p.runs("off")]
        ons = [_judged(r, slo) for r in p.runs("on")]
        off = offs[0]
        spec = p.on.spec_decode
        row = {
            "workload": p.workload,
            "concurrency": p.concurrency,
            "num_requests": off.num_requests,
            "slo": None if slo is None else asdict(slo),
            "acceptance_rate": None if spec is None else spec.acceptance_rate,
            "mean_acceptance_length": None if spec is None else spec.mean_acceptance_length,
            "num_drafts": 0 if spec is None else spec.num_drafts,
        }
        figures = {
            "req_s": lambda m: m.request_throughput,
            "out_tok_s": lambda m: m.output_throughput,
            "tpot_p50_ms": lambda m: m.tpot.median,
            "itl_p50_ms": lambda m: m.itl.median,
            "itl_p99_ms": lambda m: m.itl.p99,
            "goodput_req_s": lambda m: m.goodput,
            "failed": lambda m: m.failed,
        }
        for name, get in figures.items():  # with --abba, each the mean over the mode's two runs (failed: sum)
            agg = (lambda v: sum(x or 0 for x in v)) if name == "failed" else _mean
            row[f"{name}_off"], row[f"{name}_on"] = agg([get(m) for m in offs]), agg([get(m) for m in ons])
        if len(offs) > 1 or len(ons) > 1:
            row["req_s_runs_off"] = [m.request_throughput for m in offs]
            row["req_s_runs_on"] = [m.request_throughput for m in ons]
        row["req_s_ratio"] = _ratio(row["req_s_on"], row["req_s_off"])
        row["out_tok_s_ratio"] = _ratio(row["out_tok_s_on"], row["out_tok_s_off"])
        row["goodput_ratio"] = _ratio(row["goodput_req_s_on"], row["goodput_req_s_off"])
        rows.append(row)
    return rows


def _pair(row: dict, name: str, digits: int = 1) -> str:
    return f"{num_text(row[f'{name}_off'], digits)} / {num_text(row[f'{name}_on'], digits)}"


def format_table(rows: Sequence[dict]) -> str:
    """The side-by-side table: each cell is `off / on`; ratios are on / off."""
    header = [
        "workload", "conc", "reqs", "req/s off / on", "ratio", "out tok/s off / on", "TPOT p50 ms",
        "ITL p50 ms", "ITL p99 ms", "goodput req/s", "good ratio", "accept", "mean len",
    ]
    body = []
    for r in rows:
        body.append([
            r["workload"], str(r["concurrency"]), str(r["num_requests"]), _pair(r, "req_s", 3),
            num_text(r["req_s_ratio"], 2) + "x" if r["req_s_ratio"] is not None else "-",
            _pair(r, "out_tok_s", 0), _pair(r, "tpot_p50_ms"), _pair(r, "itl_p50_ms"), _pair(r, "itl_p99_ms"),
            _pair(r, "goodput_req_s", 3),
            num_text(r["goodput_ratio"], 2) + "x" if r["goodput_ratio"] is not None else "-",
            num_text(r["acceptance_rate"], 2), num_text(r["mean_acceptance_length"], 2),
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    failed = sum(r["failed_off"] + r["failed_on"] for r in rows)
    if failed:
        lines.append(f"WARNING: {failed} failed requests")
    return "\n".join(lines)


def slo_note(slos: dict[str, SLO], factor: float | None) -> str:
    parts = [f"{w}: TPOT <= {num_text(s.tpot_ms, 1)} ms" if s.tpot_ms is not None else f"{w}: {s}"
             for w, s in slos.items()]
    how = f" ({factor:g}x the off TPOT p50 at the lowest concurrency)" if factor is not None else ""
    return "goodput SLO" + how + ": " + ("; ".join(parts) if parts else "none")


# (workload, concurrency, modes) -> one result per mode, in order; the real one starts servers.
Measure = Callable[[str, int, Sequence[Preset]], list[BenchResult]]


def run_points(workloads: Sequence[str], concurrencies: Sequence[int], on: Preset, measure: Measure,
               log: Callable[[str], None] = print, abba: bool = False) -> list[Point]:
    """Each point's modes, a fresh server each: off then on, or with `abba` off, on, on, off (a host whose
    speed drifts during a point then weighs on both modes alike)."""
    points = []
    for workload in workloads:
        for c in concurrencies:
            t0 = time.monotonic()
            if abba:
                off1, on1, on2, off2 = measure(workload, c, [OFF, on, replace(on, name="on-2"),
                                                             replace(OFF, name="off-2")])
                points.append(Point(workload, c, off1, on1, off2, on2))
            else:
                off1, on1 = measure(workload, c, [OFF, on])
                points.append(Point(workload, c, off1, on1))
            req_s = " / ".join(f"{r.metrics.request_throughput:.3f}" for r in measure_order(points[-1]))
            log(f"[{workload} c={c}] req/s {req_s} ({'off, on, on, off' if abba else 'off, on'}; "
                f"{time.monotonic() - t0:.0f} s)")
    return points


def measure_order(p: Point) -> list[BenchResult]:
    return [p.off, p.on] if p.off2 is None else [p.off, p.on, p.on2, p.off2]  # type: ignore[list-item]


def compare_measure(args: argparse.Namespace, tokenizer) -> Measure:  # type: ignore[no-untyped-def]
    """The real runner: `compare.run_compare` with the two modes, a fresh server each."""
    import io

    from pdserve.bench.compare import run_compare
    from pdserve.bench.serve_bench import workload_samples
    from pdserve.config import Workload

    server_args = ["--model", args.model, *(["--num-threads", str(args.num_threads)] if args.num_threads else []),
                   "--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]

    def measure(workload: str, concurrency: int, modes: Sequence[Preset]) -> list[BenchResult]:
        dataset, endpoint = WORKLOADS[workload]
        n = num_requests_for(concurrency, args.min_requests, args.per_stream, args.max_requests)
        w = Workload(dataset=dataset, num_prompts=n, seed=args.seed)
        samples = [replace(s, output_len=min(s.output_len, args.max_output_len))
                   for s in workload_samples(w, tokenizer)]
        results = run_compare(
            modes, w, server_args=server_args, endpoint=endpoint, max_concurrency=concurrency,
            tokenizer=tokenizer, samples=samples, show_progress=False, stdout=io.StringIO(),
            server_timeout_s=args.server_timeout_s,
        )
        return [mr.result for mr in results]

    return measure


def host_line() -> dict:
    from pdserve.bench.machine import cpu_flags, measure_machine

    limits = measure_machine()
    return {
        "cpu": limits.cpu, "threads": limits.num_threads, "os_cpus": os.cpu_count(),
        "flags": [f for f, on in cpu_flags().items() if on],
        "dram_read_gb_s": limits.memory_bandwidth / 1e9,
        "matmul_gflop_s": {k: v / 1e9 for k, v in limits.matmul_flops.items()},
    }


def format_host(h: dict) -> str:
    roofs = ", ".join(f"{k} {v:.0f}" for k, v in h["matmul_gflop_s"].items())
    return (f"host: {h['cpu']}, {h['threads']} threads of {h['os_cpus']} CPUs, {' '.join(h['flags'])}; "
            f"DRAM read {h['dram_read_gb_s']:.1f} GB/s; matmul GFLOP/s {roofs}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="sharegpt,code-edit", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma list of --max-concurrency values")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="the 'on' mode's config (default: the spec-ngram preset, n-gram k = 4)")
    ap.add_argument("--draft-model", default=None, help='shorthand for {"method": "draft", "model": NAME, k}')
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="k for --draft-model")
    ap.add_argument("--slo", default=None, help="absolute targets, e.g. tpot=50 (default: --slo-tpot-factor)")
    ap.add_argument("--slo-tpot-factor", type=float, default=3.0)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--per-stream", type=int, default=4, help="requests per concurrent stream")
    ap.add_argument("--max-requests", type=int, default=128)
    ap.add_argument("--max-output-len", type=int, default=256, help="cap on each request's max_tokens")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-timeout-s", type=float, default=900.0,
                    help="a server's first start on a host builds the C++ kernels and autotunes (minutes)")
    ap.add_argument("--quick", action="store_true", help="smoke run: code-edit at 1 and 4, 4 requests of 32 tokens")
    ap.add_argument("--abba", action="store_true",
                    help="run each point off, on, on, off and report each mode's mean (for drifting hosts)")
    ap.add_argument("--out", default=None, metavar="PATH", help="write the rows, the host and the config as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.workloads, args.concurrency = "code-edit", "1,4"
        args.min_requests = args.max_requests = 4
        args.max_output_len = 32
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}: expected {', '.join(WORKLOADS)}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.draft_model is not None:
        spec = json.dumps({"method": "draft", "model": args.draft_model,
                           "num_speculative_tokens": args.num_speculative_tokens})
        on = Preset("on", ("--speculative-config", spec), f"draft {args.draft_model}")
    elif args.speculative_config is not None:
        on = Preset("on", ("--speculative-config", args.speculative_config), "given config")
    else:
        on = replace(BUILTIN_PRESETS["spec-ngram"], name="on")

    from pdserve.model.loader import resolve_model_path
    from pdserve.model.tokenizer import load_tokenizer

    host = host_line()
    print(format_host(host), flush=True)
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    t0 = time.monotonic()
    points = run_points(workloads, concurrencies, on, compare_measure(args, tokenizer),
                        log=lambda s: print(s, file=sys.stderr, flush=True), abba=args.abba)
    if args.slo is not None:
        slos, factor = {w: parse_slo(args.slo) for w in workloads}, None
    else:
        slos, factor = default_slos(points, args.slo_tpot_factor), args.slo_tpot_factor
    rows = summarize(points, slos)
    runs = "off, on, on, off, each cell the mean of a mode's two runs" if args.abba else "off then on"
    print(f"model {args.model}; on = {' '.join(on.args)}; a fresh server per mode and point ({runs}); "
          f"cells off / on, ratios on / off; {time.monotonic() - t0:.0f} s")
    print(format_table(rows))
    print(slo_note(slos, factor))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host": host, "config": vars(args), "on_args": list(on.args), "rows": rows,
                       "durations_s": {f"{p.workload}/{p.concurrency}": {
                           mode: [r.metrics.duration_s for r in p.runs(mode)] for mode in ("off", "on")}
                           for p in points}},
                      f, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
