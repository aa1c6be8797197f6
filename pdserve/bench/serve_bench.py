"""`pdserve bench`: one serving benchmark run against an OpenAI-compatible server.

Builds the workload (ShareGPT, random, long-prompt or code-edit, token lengths from the tokenizer), asks
the server for its model name if none is given, replays the workload with `client.run_requests`, prints
the summary table and writes a JSON report holding the configuration, the summary and every per-request
record.
`run_once` is the measured part that `sweep` and `compare` repeat: it also re-counts the streamed output
with the tokenizer when the served model is pdserve's default (a check on the server's usage) and reads
the server's `/metrics` before and after: the prefix-cache hit counter says whether cached prompts from an
earlier run helped this one, and the speculative-decoding counters (pdserve's or vLLM's) give the run's
acceptance rate, mean acceptance length and per-position acceptance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from pdserve.bench.client import (
    fetch_metrics_text,
    fetch_model_name,
    prefix_cache_hits,
    run_requests,
    spec_decode_counters,
)
from pdserve.bench.datasets import (
    DecodingTokenizer,
    SampleRequest,
    Tokenizer,
    load_sharegpt_records,
    sample_long_prompt,
    sample_random,
    sample_sharegpt,
)
from pdserve.bench.metrics import (
    SLO,
    BenchMetrics,
    Distribution,
    RequestRecord,
    SpecDecodeMetrics,
    assign_slo_classes,
    compute_metrics,
    spec_decode_metrics,
)
from pdserve.config import CodeEditMix, LoadConfig, LongPromptMix, Workload
from pdserve.config import field_default as _default
from pdserve.errors import PdserveError
from pdserve.registry import Registry

logger = logging.getLogger(__name__)

# Dataset name -> sampler(tokenizer, workload); `config.BENCH_DATASETS` spells the same names.
DATASETS: Registry[Callable[[DecodingTokenizer, Workload], list[SampleRequest]]] = Registry(
    "dataset",
    {
        "sharegpt": "pdserve.bench.serve_bench:sharegpt_workload",
        "random": "pdserve.bench.serve_bench:random_workload",
        "long-prompt": "pdserve.bench.serve_bench:long_prompt_workload",
        "code-edit": "pdserve.bench.serve_bench:code_edit_workload",
    },
)


@dataclasses.dataclass(frozen=True, slots=True)
class BenchResult:
    metrics: BenchMetrics
    records: list[RequestRecord]
    model: str
    # Prompt tokens the server found in its prefix cache during the run (None: the server does not say).
    prefix_cache_hit_tokens: int | None = None
    # Draft acceptance during the run, from the server's spec-decode counters (None: it exports none or
    # ran no drafts).
    spec_decode: SpecDecodeMetrics | None = None


def workload_samples(workload: Workload, tokenizer: DecodingTokenizer) -> list[SampleRequest]:
    """The requests `workload` describes, prompts counted with `tokenizer`; ValueError if there are none."""
    samples = DATASETS.load(workload.dataset)(tokenizer, workload)
    if not samples:
        raise ValueError("the workload is empty")
    return samples


def load_samples(
    tokenizer: DecodingTokenizer,
    dataset: str,
    num_prompts: int,
    seed: int,
    random_input_len: int = _default(Workload, "random_input_len"),
    random_output_len: int = _default(Workload, "random_output_len"),
    *,
    long_prompt: LongPromptMix = LongPromptMix(),
    code_edit: CodeEditMix = CodeEditMix(),
) -> list[SampleRequest]:
    """The samples of one dataset, by its parts (the registry's samplers take a whole `Workload`)."""
    workload = Workload(
        dataset=dataset, num_prompts=num_prompts, seed=seed, random_input_len=random_input_len,
        random_output_len=random_output_len, long_prompt=long_prompt, code_edit=code_edit,
    )
    return DATASETS.load(dataset)(tokenizer, workload)


# The samplers of `DATASETS`: one workload's samples, prompts counted with `tokenizer`.


def sharegpt_workload(tokenizer: DecodingTokenizer, w: Workload) -> list[SampleRequest]:
    return sample_sharegpt(tokenizer, w.num_prompts, w.seed)


def random_workload(tokenizer: DecodingTokenizer, w: Workload) -> list[SampleRequest]:
    return sample_random(tokenizer, w.num_prompts, w.random_input_len, w.random_output_len, w.seed)


def long_prompt_workload(tokenizer: DecodingTokenizer, w: Workload) -> list[SampleRequest]:
    """Long random prompts among ShareGPT chats, or among random ones where ShareGPT is not installed."""
    try:
        records: list[dict] | None = load_sharegpt_records()
    except FileNotFoundError:
        logger.info("ShareGPT is not installed: the short chats are random prompts")
        records = None
    return sample_long_prompt(tokenizer, w.num_prompts, w.seed, w.long_prompt, short_records=records)


def code_edit_workload(tokenizer: DecodingTokenizer, w: Workload) -> list[SampleRequest]:
    from pdserve.bench.code_edit import sample_code_edit

    samples = sample_code_edit(tokenizer, w.num_prompts, w.seed, w.code_edit)
    if len(samples) < w.num_prompts:
        logger.warning("only %d of %d code-edit prompts fit the length limits", len(samples), w.num_prompts)
    return samples


def default_tokenizer() -> DecodingTokenizer:
    """The bundled SmolLM2 tokenizer: prompt lengths are counted with it unless the caller passes another."""
    from pdserve.model.loader import default_model_path
    from pdserve.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def default_model_name() -> str:
    """The name `pdserve serve` gives the bundled model when no --served-model-name is set."""
    from pdserve.model.loader import default_model_path

    return os.path.basename(default_model_path()).removesuffix(".gguf")


def output_tokenizer(
    model: str, tokenizer: DecodingTokenizer, count_outputs: bool | None
) -> Tokenizer | None:
    """The tokenizer to re-count outputs with: `tokenizer` if `count_outputs`, or when it is None (auto)
    and the served model is pdserve's default (whose tokenizer the workload was built with)."""
    if count_outputs is None:
        try:
            count_outputs = model == default_model_name()
        except PdserveError:  # no bundled model: nothing to compare against
            count_outputs = False
    return tokenizer if count_outputs else None


def run_once(
    load: LoadConfig,
    samples: Sequence[SampleRequest],
    slo: SLO | None = None,
    count_tokenizer: Tokenizer | None = None,
    show_progress: bool = True,
    slos: Sequence[SLO] | None = None,
) -> BenchResult:
    """Replay `samples` once as `load` says and summarize the run. `slos`: per sample, targets sent as
    the request's own and judged per request (`slo` judges the others)."""

    async def measure() -> tuple[list[RequestRecord], float, str | None, str | None]:
        before = await fetch_metrics_text(load.base_url)
        records, duration = await run_requests(load, samples, show_progress, slos)
        after = await fetch_metrics_text(load.base_url)
        return records, duration, before, after

    records, duration, before, after = asyncio.run(measure())
    if count_tokenizer is not None:
        for rec in records:
            if rec.success:
                rec.tokenizer_output_len = len(count_tokenizer.encode(rec.output_text))
    hits_before, hits_after = prefix_cache_hits(before), prefix_cache_hits(after)
    hits = None if hits_before is None or hits_after is None else hits_after - hits_before
    spec_before, spec_after = spec_decode_counters(before), spec_decode_counters(after)
    spec = None
    if spec_before is not None and spec_after is not None:
        spec = spec_decode_metrics(spec_after.minus(spec_before))
    return BenchResult(compute_metrics(records, duration, slo), records, load.model, hits, spec)


def run_bench(
    base_url: str,
    model: str | None,
    dataset: str,
    num_prompts: int,
    request_rate: float = _default(LoadConfig, "request_rate"),
    burstiness: float = _default(LoadConfig, "burstiness"),
    max_concurrency: int | None = None,
    seed: int = _default(Workload, "seed"),
    slo: SLO | None = None,
    out: str | None = None,
    *,
    endpoint: str = _default(LoadConfig, "endpoint"),
    random_input_len: int = _default(Workload, "random_input_len"),
    random_output_len: int = _default(Workload, "random_output_len"),
    long_prompt: LongPromptMix = LongPromptMix(),
    code_edit: CodeEditMix = CodeEditMix(),
    tokenizer: DecodingTokenizer | None = None,
    count_outputs: bool | None = None,
    plot_dir: str | None = None,
    trace: str | None = None,
    show_progress: bool = True,
    stdout: TextIO | None = None,
    slo_classes: list[tuple[SLO, float]] | None = None,
) -> BenchResult:
    """Run one benchmark; print the table to `stdout` (default: sys.stdout), write JSON to `out`, plots to
    `plot_dir` and a Perfetto trace to `trace`. `count_outputs`: re-count outputs with `tokenizer` (None:
    only when the served model is pdserve's default). `slo_classes`: (targets, weight) of request classes;
    each request draws one (seeded), sends it as its own targets and is judged by it."""
    if slo is not None and slo_classes:
        raise ValueError("give either an SLO for every request or SLO classes, not both")
    tokenizer = tokenizer or default_tokenizer()
    workload = Workload(
        dataset=dataset, num_prompts=num_prompts, seed=seed, random_input_len=random_input_len,
        random_output_len=random_output_len, long_prompt=long_prompt, code_edit=code_edit,
    )
    samples = workload_samples(workload, tokenizer)
    if model is None:
        model = asyncio.run(fetch_model_name(base_url))
    load = LoadConfig(
        base_url=base_url, model=model, endpoint=endpoint, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, seed=seed,
    )
    slos = assign_slo_classes(slo_classes, len(samples), seed) if slo_classes else None
    counter = output_tokenizer(model, tokenizer, count_outputs)
    result = run_once(load, samples, slo, counter, show_progress, slos)
    print(format_table(result.metrics, load, result.spec_decode), file=stdout)
    if out is not None:
        write_report(out, result.metrics, result.records, load, dataset, workload=workload, result=result)
    write_artifacts({"bench": result.records}, plot_dir, trace)
    return result


def format_table(m: BenchMetrics, load: LoadConfig, spec: SpecDecodeMetrics | None = None) -> str:
    width = 50

    def row(name: str, value: object) -> str:
        text = f"{value:<10.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40}{text}"

    def section(title: str) -> str:
        return title.center(width, "-")

    lines = [
        " Serving Benchmark Result ".center(width, "="),
        row("Model:", load.model),
        row("Request rate (req/s):", rate_text(load.request_rate)),
        row("Burstiness:", f"{load.burstiness:g}"),
        row("Max concurrency:", load.max_concurrency or "none"),
        row("Successful requests:", m.completed),
        row("Failed requests:", m.failed),
        row("Benchmark duration (s):", m.duration_s),
        row("Total input tokens:", m.total_input_tokens),
        row("Total generated tokens:", m.total_output_tokens),
        row("Request throughput (req/s):", m.request_throughput),
        row("Output token throughput (tok/s):", m.output_throughput),
        row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    if m.output_len_mismatches is not None:
        lines.append(row("Output tokens != tokenizer count:", m.output_len_mismatches))
    if m.num_good is not None:
        lines += [
            row("SLO:", slo_text(m.slo) if m.slo is not None else "each request's own (--slo-classes)"),
            row("Requests meeting the SLO:", m.num_good),
            row("Request goodput (req/s):", m.goodput),
            row("SLO attainment (%):", m.slo_attainment),
        ]

    def dist(title: str, short: str, d: Distribution) -> list[str]:
        return [
            section(f"{title}"),
            row(f"Mean {short} (ms):", d.mean),
            row(f"Median {short} (ms):", d.median),
            row(f"P90 {short} (ms):", d.p90),
            row(f"P99 {short} (ms):", d.p99),
            row(f"P99.9 {short} (ms):", d.p999),
            row(f"Max {short} (ms):", d.max),
        ]

    lines += dist("Time to First Token", "TTFT", m.ttft)
    lines += dist("Time per Output Token (excl. 1st token)", "TPOT", m.tpot)
    lines += dist("Inter-token Latency", "ITL", m.itl)
    lines += dist("End-to-end Latency", "E2EL", m.e2el)
    if spec is not None:
        per_position = " ".join(f"{100 * a:.1f}" for a in spec.per_position_acceptance)
        lines += [
            section("Speculative Decoding"),
            row("Drafts:", spec.num_drafts),
            row("Draft tokens:", spec.num_draft_tokens),
            row("Accepted tokens:", spec.num_accepted_tokens),
            row("Acceptance rate (%):", 100 * spec.acceptance_rate),
            row("Mean acceptance length:", spec.mean_acceptance_length),
            row("Per-position acceptance (%):", per_position),
        ]
    lines.append("=" * width)
    return "\n".join(lines)


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_json(rate: float) -> float | str:
    """JSON has no infinity; keep the file readable by strict parsers."""
    return "inf" if math.isinf(rate) else rate


def slo_text(slo: SLO) -> str:
    return ", ".join(
        f"{k}<={v:g} ms"
        for k, v in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("itl", slo.itl_ms))
        if v is not None
    )


def format_grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join([f"{first:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(rest, widths[1:]))])

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def num_text(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def load_json(load: LoadConfig) -> dict:
    config = dataclasses.asdict(load)
    config["request_rate"] = rate_json(load.request_rate)
    return config


def result_json(result: BenchResult) -> dict:
    return {
        "model": result.model,
        "prefix_cache_hit_tokens": result.prefix_cache_hit_tokens,
        "spec_decode": _spec_json(result.spec_decode),
        "metrics": dataclasses.asdict(result.metrics),
        "records": [dataclasses.asdict(r) for r in result.records],
    }


def write_report(
    path: str,
    metrics: BenchMetrics,
    records: list[RequestRecord],
    load: LoadConfig,
    dataset: str,
    *,
    workload: Workload | None = None,
    result: BenchResult | None = None,
) -> None:
    config = load_json(load)
    config["dataset"] = dataset
    if workload is not None:
        config["workload"] = dataclasses.asdict(workload)
    report: dict = {"config": config}
    if result is not None:
        # One run against a server someone else started: whether it was fresh is unknown; the hit count
        # says whether prompts cached before this run helped it.
        report["server"] = {"state": "as given", "prefix_cache_hit_tokens": result.prefix_cache_hit_tokens}
        report["spec_decode"] = _spec_json(result.spec_decode)
    report["metrics"] = dataclasses.asdict(metrics)
    report["records"] = [dataclasses.asdict(r) for r in records]
    write_json(path, report)


def _spec_json(spec: SpecDecodeMetrics | None) -> dict | None:
    return None if spec is None else dataclasses.asdict(spec)


def write_json(path: str, report: dict) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)


def write_artifacts(
    runs: Mapping[str, Sequence[RequestRecord]], plot_dir: str | None, trace: str | None
) -> list[str]:
    """Per-run plots (TTFT/ITL CDFs with one line per run, one timeline per run) into `plot_dir` and one
    Perfetto trace with a process per run into `trace`; returns the paths written."""
    written: list[str] = []
    if plot_dir is not None:
        from pdserve.bench import plots

        os.makedirs(plot_dir, exist_ok=True)
        written.append(plots.plot_cdfs(runs, os.path.join(plot_dir, "cdf.png")))
        for label, records in runs.items():
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
            written.append(
                plots.plot_timeline(records, os.path.join(plot_dir, f"timeline-{name}.png"), title=label)
            )
    if trace is not None:
        from pdserve.bench.trace import write_trace

        written.append(write_trace(runs, trace))
    return written
