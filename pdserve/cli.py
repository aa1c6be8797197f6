"""Command line: `pdserve generate "prompt"`, `pdserve chat`. Later: serve, router, bench, sim, plan."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.errors import PdserveError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags. Defaults and choices come from pdserve/config.py (`add_config_argument`)."""
    from pdserve.config import (
        ATTENTION_BACKENDS,
        DTYPES,
        KV_CACHE_DTYPES,
        KV_KEY_SCALING,
        LINEAR_KERNELS,
        PREEMPTION_MODES,
        SCHEDULER_POLICIES,
        WEIGHT_DTYPES,
        CacheConfig,
        EngineConfig,
        SchedulerConfig,
    )
    from pdserve.config import add_config_argument as arg

    g = p.add_argument_group("engine")
    arg(g, "--model", EngineConfig, "model", help="a .gguf file, a Hugging Face directory or a model name: smollm2-135m-instruct (the default), qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct")
    arg(g, "--dtype", EngineConfig, "dtype", choices=DTYPES)
    arg(g, "--device", EngineConfig, "device", help="auto | cpu | cuda")
    arg(g, "--scheduler", SchedulerConfig, "policy", choices=SCHEDULER_POLICIES,
        help="scheduling policy: chunked (default: stall-free) | prefill-first | decode-priority | slo")
    arg(g, "--max-num-batched-tokens", SchedulerConfig, "max_num_batched_tokens")
    arg(g, "--max-num-seqs", SchedulerConfig, "max_num_seqs")
    arg(g, "--max-model-len", SchedulerConfig, "max_model_len")
    arg(g, "--chunk-size", SchedulerConfig, "chunk_size", type=int)
    arg(g, "--decode-priority-max-decodes", SchedulerConfig, "decode_priority_max_decodes",
        help="decode-priority: pause prefills while this many decodes run")
    arg(g, "--decode-priority-max-wait-steps", SchedulerConfig, "decode_priority_max_wait_steps",
        help="decode-priority: pause prefills while a decode has gone more steps than this without a token")
    arg(g, "--decode-priority-max-decode-steps", SchedulerConfig, "decode_priority_max_decode_steps",
        help="decode-priority: at most this many decode-only steps in a row while prompts wait")
    arg(g, "--slo-ttft-ms", SchedulerConfig, "slo_ttft_ms", help="slo: time-to-first-token target")
    arg(g, "--slo-itl-ms", SchedulerConfig, "slo_itl_ms",
        help="slo: inter-token latency target; prompt chunks are sized to keep steps under it")
    arg(g, "--slo-min-chunk", SchedulerConfig, "slo_min_chunk",
        help="slo: prompt tokens a step always gets, even when decodes alone exceed the ITL target")
    g.add_argument(
        "--slo-reject", action="store_true",
        help="slo: refuse (HTTP 503) requests predicted to miss their TTFT or to push decodes past the ITL",
    )
    arg(g, "--preemption-mode", SchedulerConfig, "preemption_mode", choices=PREEMPTION_MODES,
        help="when KV blocks run out: recompute the preempted request later, or swap its KV to host memory")
    arg(g, "--swap-space", CacheConfig, "swap_space_gb", help="swap: host-memory tier for KV, in GiB")
    arg(g, "--block-size", CacheConfig, "block_size", type=int, help="tokens per KV block (default: 128 on a CPU, 16 on a GPU)")
    arg(g, "--kv-cache-memory-gb", CacheConfig, "kv_cache_memory_gb")
    arg(g, "--kv-cache-dtype", CacheConfig, "kv_cache_dtype", choices=KV_CACHE_DTYPES,
        help="how K/V are stored: auto (the model's dtype), int8 / fp8_e4m3 with a scale per token and kv head, or int4 (KIVI)")
    arg(g, "--kv-key-scaling", CacheConfig, "kv_key_scaling", choices=KV_KEY_SCALING,
        help="int8 / fp8 KV: per-channel powers of two for the keys, folded into the q/k projections (exact): "
             "auto where a calibration at start shows they cut the keys' error, on in every layer, off")
    g.add_argument("--no-prefix-caching", action="store_true")
    arg(g, "--num-threads", EngineConfig, "num_threads", type=int)
    arg(g, "--attention-backend", EngineConfig, "attention_backend", choices=("auto", *ATTENTION_BACKENDS))
    arg(g, "--seed", EngineConfig, "seed")
    g.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft", '
        '"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}\'',
    )
    g.add_argument("--no-fused-ops", action="store_true",
                   help="bf16 on CPU: keep the layer's elementwise steps as plain torch ops")
    arg(g, "--linear-kernel", EngineConfig, "linear_kernel", choices=LINEAR_KERNELS,
        help="bf16 on CPU: the projections' matmul (auto: the fastest per row count, measured "
        "at first start on this host and cached)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="bf16 on CPU: one row-independent matmul kernel for every row count, so greedy "
                   "output does not depend on the batch (slower prompts and large batches)")
    arg(g, "--kernel-cache-dir", EngineConfig, "kernel_cache_dir",
        help="where measured kernel choices are kept (default: ~/.cache/pdserve/autotune; '' for none)")
    arg(g, "--weight-dtype", EngineConfig, "weight_dtype", choices=WEIGHT_DTYPES,
        help="the projections' and output head's weights (auto: the model dtype); int8: per output "
        "channel, bf16 activations, CPU only: half the bytes a decode step streams; --linear-kernel then "
        "names pdserve's int8 kernel, torch = ATen's _weight_int8pack_mm, onednn = dequantize + oneDNN; "
        "w8a8: the same weights, and kernels that may also quantize activations per token (int8 x int8 "
        "on AMX-INT8/VNNI where measured faster; onednn / torch then name those)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    from pdserve.config import KV_TRANSFER_BACKENDS, ROLES, KVTransferConfig
    from pdserve.config import add_config_argument as arg

    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument(
        "--disagg", default=None, metavar="XpYd",
        help="start a local cluster instead: X prefill and Y decode instances (e.g. 1p1d) behind a router "
        "on --host/--port, KV over shared memory, the cores split between instances",
    )
    arg(g, "--role", KVTransferConfig, "role", choices=ROLES,
        help="this instance's role behind `pdserve router` (both: colocated)")
    arg(g, "--kv-transfer", KVTransferConfig, "backend",
        choices=[b for b in KV_TRANSFER_BACKENDS if b != "inproc"],  # inproc: both ends in one process
        help="KV transfer backend (required for --role prefill|decode)")
    arg(g, "--kv-transfer-host", KVTransferConfig, "host", help="tcp: interface (and address) for KV")
    arg(g, "--kv-transfer-port", KVTransferConfig, "port", help="tcp: port for KV (0: any free one)")
    arg(g, "--kv-ack-timeout", KVTransferConfig, "ack_timeout_s",
        help="prefill side: seconds the decode side may take to acknowledge the KV")
    arg(g, "--kv-lease", KVTransferConfig, "lease_s",
        help="decode side: seconds reserved blocks wait for a prompt's KV")
    g.add_argument("--kv-verify", action="store_true", help="checksum every KV chunk (tcp always does)")


def kv_transfer_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve.config import KVTransferConfig

    return KVTransferConfig(
        role=args.role,
        backend=args.kv_transfer,
        host=args.kv_transfer_host,
        port=args.kv_transfer_port,
        ack_timeout_s=args.kv_ack_timeout,
        lease_s=args.kv_lease,
        verify=args.kv_verify,
    )


def engine_config(args: argparse.Namespace, num_threads: int | None = None):  # type: ignore[no-untyped-def]
    """The engine part of the command line, for `generate`, `chat` and `serve` alike."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_threads=num_threads if num_threads is not None else args.num_threads,
        attention_backend=args.attention_backend,
        fused_cpu_ops=not args.no_fused_ops,
        linear_kernel=args.linear_kernel,
        batch_invariant=args.batch_invariant,
        kernel_cache_dir=args.kernel_cache_dir,
        weight_dtype=args.weight_dtype,
        seed=args.seed,
        speculative=(
            SpeculativeConfig.from_dict(args.speculative_config)
            if getattr(args, "speculative_config", None) else None
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            enable_prefix_caching=not args.no_prefix_caching,
            swap_space_gb=args.swap_space,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_key_scaling=args.kv_key_scaling,
        ),
        scheduler=SchedulerConfig(
            policy=args.scheduler,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            chunk_size=args.chunk_size,
            preemption_mode=args.preemption_mode,
            decode_priority_max_decodes=args.decode_priority_max_decodes,
            decode_priority_max_wait_steps=args.decode_priority_max_wait_steps,
            decode_priority_max_decode_steps=args.decode_priority_max_decode_steps,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_itl_ms=args.slo_itl_ms,
            slo_min_chunk=args.slo_min_chunk,
            slo_reject=args.slo_reject,
        ),
    )


def make_llm(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve import LLM

    return LLM.from_config(engine_config(args))


def make_params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    params = make_params(args)
    prompts = args.prompt
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for out in outs:
        comp = out.outputs[0]
        if len(outs) > 1:
            print(f"--- {out.prompt!r}")
        print(comp.text)
        print(f"[{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    params = make_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("pdserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server: the engine core in its own process, the HTTP front here."""
    import json
    import os

    from pdserve.config import ModelConfig
    from pdserve.server.api import serve
    from pdserve.config import RandomModelSpec, ServerConfig

    if args.log_level.upper() == "WARNING":  # the default: a server should say what it is doing
        logging.getLogger("pdserve").setLevel(logging.INFO)
    if args.disagg:
        from pdserve.router.cluster import serve_cluster

        return serve_cluster(args.disagg, args.argv, args.host, args.port, args.num_threads, _api_key(args))
    num_threads = args.num_threads
    if num_threads is None:  # every core for the engine: the front is light (measured in docs/architecture.md)
        num_threads = len(os.sched_getaffinity(0))
    random_model = None
    if args.random_weights:
        try:
            spec = json.loads(args.random_weights)
            seed, std = int(spec.pop("seed", 0)), float(spec.pop("std", 0.02))
            spec["eos_token_ids"] = tuple(spec.get("eos_token_ids", ()))
            random_model = RandomModelSpec(model_config=ModelConfig(**spec), seed=seed, std=std)
        except (ValueError, TypeError, AttributeError) as e:
            print(f"error: --random-weights: {e}", file=sys.stderr)
            return 2
    from dataclasses import replace

    try:
        engine = replace(engine_config(args, num_threads), kv_transfer=kv_transfer_config(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting,
        stats_interval_s=args.stats_interval,
        access_log=args.access_log,
        log_level="INFO" if args.log_level.upper() == "WARNING" else args.log_level.upper(),
        step_log=args.step_log,
        random_model=random_model,
        restart_engine=not args.no_engine_restart,
        heartbeat_timeout_s=args.heartbeat_timeout,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        allowed_hosts=_hosts(args.allowed_hosts),
        max_connections=args.max_connections,
        header_timeout_s=args.read_timeout,
        body_timeout_s=args.read_timeout,
        api_key=_api_key(args),
        cluster_secret=_cluster_secret(args),
    )
    serve(config)
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    import os

    return args.api_key or os.environ.get("PDSERVE_API_KEY") or None


def _cluster_secret(args: argparse.Namespace) -> str | None:
    import os

    return args.cluster_secret or os.environ.get("PDSERVE_CLUSTER_SECRET") or None


def _hosts(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(h.strip().lower() for h in value.split(",") if h.strip())


def add_http_limit_args(p: argparse.ArgumentParser, cls: type, connections_field: str) -> None:
    """Bounds on what one HTTP client may cost (server: `ServerConfig`, router: `RouterConfig`, whose
    client-connection limit is `connections_field`)."""
    from pdserve.config import add_config_argument as arg

    arg(p, "--max-body-bytes", cls, "max_body_bytes", help="largest request body accepted (HTTP 413 beyond)")
    p.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                   help="serve only requests whose Host header names one of these (default: any)")
    arg(p, "--max-connections", cls, connections_field,
        help="concurrent connections and requests served (HTTP 503 beyond)")
    arg(p, "--read-timeout", cls, "header_timeout_s",
        help="seconds a client may take to send a request's head, and again its body")
    p.add_argument("--api-key", default=None,
                   help="clients must send `Authorization: Bearer KEY` (default: $PDSERVE_API_KEY; none: open)")
    p.add_argument("--cluster-secret", default=None,
                   help="the secret the router and instances of a disaggregated cluster share (default: "
                   "$PDSERVE_CLUSTER_SECRET; `serve --disagg` makes one)")


def router_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The `pdserve router` command line as a `RouterConfig`."""
    from pdserve.config import RouterConfig

    def urls(values: list[str]) -> tuple[str, ...]:
        return tuple(u.strip() for v in values for u in v.split(",") if u.strip())

    return RouterConfig(
        prefill_urls=urls(args.prefill),
        decode_urls=urls(args.decode),
        host=args.host,
        port=args.port,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        max_retries=args.max_retries,
        request_timeout_s=args.request_timeout,
        load_interval_s=args.load_interval,
        access_log=args.access_log,
        api_key=_api_key(args),
        cluster_secret=_cluster_secret(args),
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.read_timeout,
        header_timeout_s=args.read_timeout,
        allowed_hosts=_hosts(args.allowed_hosts),
        max_client_connections=args.max_connections,
    )


def cmd_router(args: argparse.Namespace) -> int:
    """Run the prefill/decode router: an OpenAI-compatible front over prefill and decode instances."""
    from pdserve.router.app import serve_router

    if args.log_level.upper() == "WARNING":  # the default: a server should say what it is doing
        logging.getLogger("pdserve").setLevel(logging.INFO)
    serve_router(router_config(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser (tests read defaults and --help from it)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: prefill/decode-aware LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate from one or more prompts (offline)")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat")
    p.add_argument("--system", default=None)
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    from pdserve.config import ROUTER_POLICIES, RouterConfig, ServerConfig
    from pdserve.config import add_config_argument as arg

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine core in its own process)")
    arg(p, "--host", ServerConfig, "host")
    arg(p, "--port", ServerConfig, "port")
    arg(p, "--served-model-name", ServerConfig, "served_model_name",
        help="the `model` clients send (default: the model file's name)")
    arg(p, "--max-waiting", ServerConfig, "max_waiting",
        help="most requests that may wait for their first token; more get HTTP 503")
    arg(p, "--stats-interval", ServerConfig, "stats_interval_s", help="seconds between stats log lines (0: off)")
    arg(p, "--step-log", ServerConfig, "step_log",
        help="append a JSON row per engine step to this file (what benchmarks/simulate.py calibrates on)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--no-engine-restart", action="store_true",
                   help="do not restart the engine core process when it dies (the server stays unhealthy)")
    arg(p, "--heartbeat-timeout", ServerConfig, "heartbeat_timeout_s",
        help="seconds without a word from the engine loop before /health reports it stale")
    arg(p, "--request-timeout", ServerConfig, "request_timeout_s", type=float,
        help="abort a generation request that has not finished after this many seconds (HTTP 504)")
    add_http_limit_args(p, ServerConfig, "max_connections")
    # Tests: serve a random model (JSON of ModelConfig fields plus "seed" and "std") with --model's tokenizer.
    p.add_argument("--random-weights", default=None, help=argparse.SUPPRESS)
    add_engine_args(p)
    add_disagg_args(p)
    p.set_defaults(func=cmd_serve)

    # `pdserve bench [sweep | compare]`: the parser and commands live in pdserve/bench/commands.py
    from pdserve.bench.commands import add_bench_parser

    add_bench_parser(sub)

    p = sub.add_parser("router", help="prefill/decode disaggregation router in front of P and D instances")
    p.add_argument("--prefill", action="append", required=True, metavar="URL[,URL...]",
                   help="prefill instance URLs (comma-separated or repeated)")
    p.add_argument("--decode", action="append", required=True, metavar="URL[,URL...]",
                   help="decode instance URLs (comma-separated or repeated)")
    arg(p, "--host", RouterConfig, "host")
    arg(p, "--port", RouterConfig, "port")
    arg(p, "--prefill-policy", RouterConfig, "prefill_policy", choices=ROUTER_POLICIES)
    arg(p, "--decode-policy", RouterConfig, "decode_policy", choices=ROUTER_POLICIES)
    arg(p, "--max-retries", RouterConfig, "max_retries",
        help="attempts on another prefill/decode pair when one fails before anything was streamed")
    arg(p, "--request-timeout", RouterConfig, "request_timeout_s",
        help="seconds to wait for an instance's answer, or for the next bytes of one")
    arg(p, "--load-interval", RouterConfig, "load_interval_s",
        help="seconds between polls of every instance's /health and /load")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_http_limit_args(p, RouterConfig, "max_client_connections")
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("top", help="live view of running instances (or a router's): prefill and decode side by side")
    p.add_argument("url", nargs="*", default=["http://127.0.0.1:8000"],
                   help="instance or router URLs (a router's instances are followed; default %(default)s)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls of /metrics")
    p.add_argument("--once", action="store_true", help="print one window and exit")
    p.add_argument("--json", action="store_true", help="print one window as JSON and exit")
    p.set_defaults(func=cmd_top)
    return parser


def cmd_top(args: argparse.Namespace) -> int:
    import os

    from pdserve import dashboard

    if args.interval <= 0:
        raise ValueError("--interval must be positive")
    key = os.environ.get("PDSERVE_API_KEY")
    if not (args.once or args.json):
        dashboard.live(args.url, args.interval, key)
        return 0
    windows = dashboard.one_window(args.url, args.interval, key)
    if args.json:
        print(dashboard.as_json(windows))
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # a pipe or a file: no terminal to fit
            console = Console(width=200)
        console.print(dashboard.render(windows, args.interval))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --disagg` passes them on to instances
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (PdserveError, ValueError) as e:  # bad model path, bad option values
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
