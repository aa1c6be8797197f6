"""`pdserve bench compare`: the same workload against one fresh pdserve server per serving mode.

A mode is a preset (`presets.py`): extra `pdserve serve` arguments on top of those common to every mode.
For each mode in turn this starts `pdserve serve` on a free port (`server.launcher.ServerProcess`),
replays the workload, and stops the server before the next one starts, so no mode inherits another's
prefix cache or warm state and no two servers share the cores. Prints one side-by-side table and writes
a JSON report (every mode's summary and records) and a figure of the TTFT and ITL CDFs, one line per mode.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TextIO

from pdserve.bench.client import fetch_model_name
from pdserve.bench.datasets import DecodingTokenizer, SampleRequest
from pdserve.bench.metrics import SLO
from pdserve.bench.presets import Preset
from pdserve.bench.serve_bench import (
    BenchResult,
    default_tokenizer,
    format_grid,
    load_json,
    num_text,
    output_tokenizer,
    rate_text,
    result_json,
    run_once,
    slo_text,
    write_artifacts,
    write_json,
    workload_samples,
)
from pdserve.config import LoadConfig, Workload
from pdserve.server.launcher import ServerProcess

SERVER_STATE = (
    "fresh: one new server per mode, stopped before the next starts (no prefix-cache carry-over)"
)


@dataclass(frozen=True, slots=True)
class ModeResult:
    preset: Preset
    server_command: list[str]  # the `pdserve serve` command line the mode ran
    result: BenchResult


def _rows(result: BenchResult) -> list[tuple[str, str]]:
    m, spec = result.metrics, result.spec_decode
    rows = [
        ("successful requests", str(m.completed)),
        ("failed requests", str(m.failed)),
        ("duration (s)", num_text(m.duration_s, 2)),
        ("request throughput (req/s)", num_text(m.request_throughput, 2)),
        ("output throughput (tok/s)", num_text(m.output_throughput)),
        ("TTFT mean (ms)", num_text(m.ttft.mean)),
        ("TTFT p50 (ms)", num_text(m.ttft.median)),
        ("TTFT p99 (ms)", num_text(m.ttft.p99)),
        ("TPOT p50 (ms)", num_text(m.tpot.median)),
        ("TPOT p99 (ms)", num_text(m.tpot.p99)),
        ("ITL p50 (ms)", num_text(m.itl.median)),
        ("ITL p99 (ms)", num_text(m.itl.p99)),
        ("ITL p99.9 (ms)", num_text(m.itl.p999)),
        ("ITL max (ms)", num_text(m.itl.max)),
        ("E2E p50 (ms)", num_text(m.e2el.median)),
        ("E2E p99 (ms)", num_text(m.e2el.p99)),
    ]
    if m.slo is not None:
        rows += [
            ("goodput (req/s)", num_text(m.goodput, 2)),
            ("SLO attainment (%)", num_text(m.slo_attainment)),
        ]
    rows += [
        ("output tokens != tokenizer", num_text(m.output_len_mismatches)),
        ("prefix-cache hit tokens", num_text(result.prefix_cache_hit_tokens)),
        # "-" where the mode ran no drafts (speculation off).
        ("draft acceptance (%)", num_text(None if spec is None else 100 * spec.acceptance_rate)),
        ("mean acceptance length", num_text(None if spec is None else spec.mean_acceptance_length, 2)),
    ]
    return rows


def format_compare_table(modes: Sequence[ModeResult], request_rate: float) -> str:
    columns = [_rows(mr.result) for mr in modes]
    header = ["mode", *(mr.preset.name for mr in modes)]
    names = [name for name, _ in columns[0]] if columns else []
    rows = [[name, *(col[i][1] for col in columns)] for i, name in enumerate(names)]
    lines = [format_grid(header, rows)]
    slo = modes[0].result.metrics.slo if modes else None
    lines.append(
        f"request rate {rate_text(request_rate)} req/s"
        + (f"; SLO {slo_text(slo)}" if slo is not None else "")
        + "; a fresh server per mode"
    )
    return "\n".join(lines)


def run_compare(
    modes: Sequence[Preset],
    workload: Workload,
    *,
    server_args: Sequence[str] = (),
    model: str | None = None,
    request_rate: float = math.inf,
    endpoint: str = "completions",
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    slo: SLO | None = None,
    out: str | None = None,
    plot_dir: str | None = None,
    trace: str | None = None,
    tokenizer: DecodingTokenizer | None = None,
    count_outputs: bool | None = None,
    server_timeout_s: float = 300.0,
    server_env: Mapping[str, str] | None = None,
    show_progress: bool = True,
    stdout: TextIO | None = None,
    samples: Sequence[SampleRequest] | None = None,
) -> list[ModeResult]:
    """Run `workload` against a fresh `pdserve serve <server_args> <preset args>` per mode; print the
    table, write `out` (JSON) and its figure (same name, .png), plots into `plot_dir` and a trace with one
    process per mode. `model`: the name to send (default: the first each server lists). `samples`: the
    requests to send instead of `workload`'s (e.g. with capped output lengths); `workload` still names
    them in the report."""
    # Built before any server starts, so that a bad value fails at once; base URL and model come per mode.
    arrivals = LoadConfig(
        base_url="", model="", endpoint=endpoint, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, seed=workload.seed,
    )
    tokenizer = tokenizer or default_tokenizer()
    if samples is None:
        samples = workload_samples(workload, tokenizer)
    elif not samples:
        raise ValueError("the workload is empty")
    results: list[ModeResult] = []
    for preset in modes:
        server = ServerProcess([*server_args, *preset.args], env=server_env)
        try:
            server.start().wait_ready(server_timeout_s)
            served = model or asyncio.run(fetch_model_name(server.url))
            load = replace(arrivals, base_url=server.url, model=served)
            count_tokenizer = output_tokenizer(served, tokenizer, count_outputs)
            result = run_once(load, samples, slo, count_tokenizer, show_progress)
        finally:
            server.close()
        results.append(ModeResult(preset, ["pdserve", *server.args[3:]], result))
    print(format_compare_table(results, request_rate), file=stdout)
    if out is not None:
        write_compare_report(out, results, arrivals, workload, server_args)
    write_artifacts({mr.preset.name: mr.result.records for mr in results}, plot_dir, trace)
    return results


def write_compare_report(
    path: str,
    modes: Sequence[ModeResult],
    arrivals: LoadConfig,
    workload: Workload,
    server_args: Sequence[str],
) -> list[str]:
    """The JSON report at `path` and the CDF figure beside it (same name, .png); returns both paths."""
    from pdserve.bench.plots import plot_cdfs

    config = load_json(arrivals)
    del config["base_url"], config["model"]  # one per mode
    config["workload"] = asdict(workload)
    config["server_args"] = list(server_args)
    report = {
        "config": config,
        "server": {"state": SERVER_STATE},
        "modes": [
            {
                "name": mr.preset.name,
                "args": list(mr.preset.args),
                "description": mr.preset.description,
                "server_command": mr.server_command,
                **result_json(mr.result),
            }
            for mr in modes
        ],
    }
    write_json(path, report)
    runs = {mr.preset.name: mr.result.records for mr in modes}
    figure = plot_cdfs(runs, os.path.splitext(path)[0] + ".png")
    return [path, figure]
