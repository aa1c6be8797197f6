"""The `pdserve bench` command line: one run (`pdserve bench --base-url URL ...`), a rate sweep
(`pdserve bench sweep`), a side-by-side comparison of serving modes (`pdserve bench compare`) and the
host's report (`pdserve bench machine`: flags, bandwidth, matmul roofs, the kernel A/B table).

Only argparse at import time: the benchmark modules (httpx, numpy, matplotlib) load when a command runs.
"""

from __future__ import annotations

import argparse
import shlex


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """What to send and how: the options every bench command shares. Defaults and choices come from
    pdserve/config.py (`Workload`, `LongPromptMix`, `LoadConfig`)."""
    from pdserve.config import BENCH_DATASETS, BENCH_ENDPOINTS, LoadConfig, LongPromptMix, Workload
    from pdserve.config import CodeEditMix
    from pdserve.config import add_config_argument as arg

    p.add_argument("--model", default=None, help="the `model` to send (default: the first of /v1/models)")
    arg(p, "--endpoint", LoadConfig, "endpoint", choices=BENCH_ENDPOINTS)
    arg(p, "--dataset", Workload, "dataset", choices=BENCH_DATASETS)
    arg(p, "--num-prompts", Workload, "num_prompts")
    arg(p, "--random-input-len", Workload, "random_input_len")
    arg(p, "--random-output-len", Workload, "random_output_len")
    g = p.add_argument_group("long-prompt dataset (short chats from ShareGPT, or random without it)")
    arg(g, "--long-prompt-fraction", LongPromptMix, "fraction", help="share of long requests")
    arg(g, "--long-prompt-min-len", LongPromptMix, "min_len", help="long prompt length, tokens")
    arg(g, "--long-prompt-max-len", LongPromptMix, "max_len")
    arg(g, "--long-prompt-output-len", LongPromptMix, "output_len", help="tokens each long request asks for")
    arg(g, "--max-total-len", LongPromptMix, "max_total_len", help="prompt + output limit (the context)")
    arg(g, "--short-input-len", LongPromptMix, "short_input_len", help="random short chats: prompt tokens")
    arg(g, "--short-output-len", LongPromptMix, "short_output_len", help="random short chats: output tokens")
    g = p.add_argument_group("code-edit dataset (stdlib functions to rename, fix or annotate)")
    arg(g, "--code-edit-min-len", CodeEditMix, "min_len", help="tokens of the quoted function")
    arg(g, "--code-edit-max-len", CodeEditMix, "max_len")
    arg(g, "--code-edit-output-len", CodeEditMix, "output_len", type=int,
        help="tokens each request asks for (default: the function's length + 32)")
    arg(g, "--code-edit-max-total-len", CodeEditMix, "max_total_len", help="prompt + output limit")
    arg(p, "--burstiness", LoadConfig, "burstiness", help="gamma shape of arrivals (1: Poisson)")
    arg(p, "--max-concurrency", LoadConfig, "max_concurrency", type=int)
    arg(p, "--seed", Workload, "seed")
    p.add_argument("--slo", default=None, help="targets in ms, e.g. ttft=500,tpot=50,itl=100")
    p.add_argument(
        "--count-output-tokens", action=argparse.BooleanOptionalAction, default=None,
        help="re-count outputs with pdserve's default tokenizer (default: when the served model is it)",
    )
    p.add_argument("--plot-dir", default=None, help="write TTFT/ITL CDFs and request timelines here (PNG)")
    p.add_argument("--trace", default=None, help="write request timelines as a Perfetto/Chrome trace JSON")
    p.add_argument("--no-progress", action="store_true")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.config import LoadConfig
    from pdserve.config import add_config_argument as arg

    p = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, goodput); also `bench sweep|compare`",
    )
    p.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (required without a subcommand)"
    )
    arg(p, "--request-rate", LoadConfig, "request_rate", help="requests/s, or inf (default)")
    p.add_argument("--out", default=None, help="write the report (every request's record) to this JSON file")
    p.add_argument(
        "--slo-classes", default=None, metavar="SLO[@W];SLO[@W]",
        help="send per-request latency targets: each request draws a class (weight W, default 1), e.g. "
        "'ttft=300,itl=50@1;ttft=5000,tpot=200@3', and is judged by it (pdserve's slo_*_ms body fields)",
    )
    add_workload_args(p)
    p.set_defaults(func=cmd_bench)
    modes = p.add_subparsers(dest="bench_command", metavar="{sweep,compare,machine}")

    s = modes.add_parser("sweep", help="the same workload at several request rates against one server")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--request-rates", required=True, help="comma-separated requests/s, e.g. 0.5,1,2,4,inf")
    s.add_argument("--out", default="sweep.json", help="JSON report; the latency-vs-rate PNG goes beside it")
    add_workload_args(s)
    s.set_defaults(func=cmd_sweep)

    c = modes.add_parser("compare", help="the same workload against a fresh pdserve server per mode")
    c.add_argument("--modes", required=True, help="comma-separated preset names, e.g. prefill-first,chunked")
    c.add_argument("--presets", default=None, help="TOML file of more presets: [presets.NAME] args = [...]")
    c.add_argument(
        "--server-args", default="",
        help="`pdserve serve` arguments common to every mode, one shell-quoted string "
        "(write --server-args='--flag' when it is a single option)",
    )
    c.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for each server")
    arg(c, "--request-rate", LoadConfig, "request_rate", help="requests/s, or inf (default)")
    c.add_argument("--out", default="compare.json", help="JSON report; the CDF figure (PNG) goes beside it")
    add_workload_args(c)
    c.set_defaults(func=cmd_compare)

    m = modes.add_parser(
        "machine", help="this host's CPU flags, read bandwidth, matmul roofs and the kernel A/B table for a model"
    )
    m.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: the bundled model)")
    m.add_argument("--rows", default=None, help="row counts of the A/B table (default 1,4,8,...,512,2048)")
    m.add_argument("--repeats", type=int, default=5, help="timed passes per kernel and row count (best per call)")
    m.add_argument("--seconds", type=float, default=0.5, help="per bandwidth / roof measurement")
    m.add_argument("--dram-mb", type=int, default=1024, help="buffer for the DRAM read bandwidth (MiB)")
    m.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    m.add_argument("--no-kernels", action="store_true", help="skip the model and the kernel A/B table")
    m.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "int8", "w8a8"],
                   help="the A/B table's weights: bf16, or int8 per output channel (the int8 kernels; w8a8: "
                   "with the int8 x int8 kernels too)")
    m.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    m.add_argument("--out", default=None, help="also write the JSON report to this file")
    m.set_defaults(func=cmd_machine)


def _workload(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve.config import CodeEditMix, LongPromptMix, Workload

    mix = LongPromptMix(
        fraction=args.long_prompt_fraction,
        min_len=args.long_prompt_min_len,
        max_len=args.long_prompt_max_len,
        output_len=args.long_prompt_output_len,
        short_input_len=args.short_input_len,
        short_output_len=args.short_output_len,
        max_total_len=args.max_total_len,
    )
    return Workload(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        long_prompt=mix,
        code_edit=CodeEditMix(
            min_len=args.code_edit_min_len,
            max_len=args.code_edit_max_len,
            output_len=args.code_edit_output_len,
            max_total_len=args.code_edit_max_total_len,
        ),
    )


def _slo(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve.bench.metrics import parse_slo

    return parse_slo(args.slo) if args.slo else None


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmark an OpenAI-compatible server: replay a workload, print the latency table, write JSON."""
    from pdserve.bench.metrics import parse_slo_classes
    from pdserve.bench.serve_bench import run_bench

    if args.base_url is None:
        raise ValueError("pdserve bench: --base-url is required (or use `bench sweep` / `bench compare`)")
    workload = _workload(args)
    run_bench(
        args.base_url,
        args.model,
        workload.dataset,
        workload.num_prompts,
        args.request_rate,
        args.burstiness,
        args.max_concurrency,
        workload.seed,
        _slo(args),
        args.out,
        endpoint=args.endpoint,
        random_input_len=workload.random_input_len,
        random_output_len=workload.random_output_len,
        long_prompt=workload.long_prompt,
        code_edit=workload.code_edit,
        count_outputs=args.count_output_tokens,
        plot_dir=args.plot_dir,
        trace=args.trace,
        show_progress=not args.no_progress,
        slo_classes=parse_slo_classes(args.slo_classes) if args.slo_classes else None,
    )
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from pdserve.bench.sweep import parse_rates, run_sweep

    run_sweep(
        args.base_url,
        args.model,
        _workload(args),
        parse_rates(args.request_rates),
        endpoint=args.endpoint,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        slo=_slo(args),
        out=args.out,
        plot_dir=args.plot_dir,
        trace=args.trace,
        count_outputs=args.count_output_tokens,
        show_progress=not args.no_progress,
    )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pdserve.bench.compare import run_compare
    from pdserve.bench.presets import load_presets, resolve_modes

    modes = resolve_modes(args.modes, load_presets(args.presets))
    run_compare(
        modes,
        _workload(args),
        server_args=shlex.split(args.server_args),
        model=args.model,
        request_rate=args.request_rate,
        endpoint=args.endpoint,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        slo=_slo(args),
        out=args.out,
        plot_dir=args.plot_dir,
        trace=args.trace,
        count_outputs=args.count_output_tokens,
        server_timeout_s=args.server_timeout,
        show_progress=not args.no_progress,
    )
    return 0


def cmd_machine(args: argparse.Namespace) -> int:
    """Measure and print this host's report; the kernel table uses the model's own projections."""
    import json

    import torch

    from pdserve.bench.machine import REPORT_ROWS, format_report, machine_report

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    rows = REPORT_ROWS if args.rows is None else tuple(int(r) for r in args.rows.split(",") if r.strip())
    if not rows or min(rows) < 1:
        raise ValueError("--rows: comma-separated row counts >= 1")
    weights, name = None, ""
    if not args.no_kernels:
        from pdserve.model.llama import LlamaModel
        from pdserve.model.loader import load_weights, resolve_model_path

        name = resolve_model_path(args.model)
        cfg, hf = load_weights(name, torch.float32)
        model = LlamaModel(cfg)
        model.load_hf_weights(hf)
        del hf
        if args.weight_dtype in ("int8", "w8a8"):
            from pdserve.model.linear import quantize_int8

            weights = {op: [quantize_int8(w) for w in ws] for op, ws in model.linear_weights().items()}
        else:
            weights = model.to(torch.bfloat16).linear_weights()
    report = machine_report(weights, name, rows, args.repeats, args.seconds, args.dram_mb << 20,
                            weight_dtype=args.weight_dtype if weights is not None else None)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0
