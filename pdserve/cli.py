"""Command line: `pdserve generate "prompt"`, `pdserve chat`. Later: serve, router, bench, sim, plan."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.errors import PdserveError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--scheduler", default="prefill-first", help="scheduling policy: prefill-first | chunked")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--chunk-size", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def make_llm(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        scheduler=args.scheduler,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        seed=args.seed,
    )


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


def main(argv: list[str] | None = None) -> int:
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

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
