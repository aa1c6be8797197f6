"""What each storage option costs in accuracy, against bf16, in one run (docs/accuracy.md).

    .venv/bin/python benchmarks/accuracy.py [--model qwen2.5-coder-0.5b-instruct] [--options fp32,kv-int8]
        [--num-prompts 200] [--max-total-len 1024] [--chunk 16] [--max-tokens 128] [--json out.json]

Every option (`pdserve.bench.accuracy.OPTIONS`, or `--define NAME=JSON` for another) gets its own engine
on the same base settings. Over ShareGPT conversations (first human turn through the chat template,
first gpt reply as the reference, cut to --max-total-len tokens) it prints, per option against the
baseline: mean and max KL(p_base || p_option) of the next-token distributions over every reply position,
teacher-forced through the paged KV cache in chunks of --chunk tokens; top-1 agreement; the perplexity of
the reference reply and its relative change; and, from greedy continuations of every prompt (up to
--max-tokens; 0 skips them), the share identical to the baseline's and the mean / median first index
where they differ (an identical pair counts as its length).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from tqdm.auto import tqdm

from pdserve.bench.accuracy import (
    BASELINE,
    MAX_SCORED_ROWS,
    OPTIONS,
    OptionError,
    base_config,
    build_engines,
    evaluate,
    format_table,
    parse_option,
    plan_steps,
    sample_conversations,
    select_options,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a registered name, .gguf file or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--options", default=",".join(n for n in OPTIONS if n != BASELINE),
                    help=f"comma-separated options to compare (known: {', '.join(OPTIONS)})")
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=JSON",
                    help='another option, e.g. kv-int8-bs32=\'{"kv_cache_dtype": "int8", "block_size": 32}\'')
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-len", type=int, default=1024, help="prompt + reference reply, in tokens")
    ap.add_argument("--chunk", type=int, default=16, help="reply tokens per teacher-forced step (1: decode)")
    ap.add_argument("--batch-size", type=int, default=16, help="conversations scored together per step")
    ap.add_argument("--max-scored-rows", type=int, default=MAX_SCORED_ROWS,
                    help="scored positions per step at most (each is a vocab-sized float32 row per engine)")
    ap.add_argument("--max-tokens", type=int, default=128, help="greedy continuation length (0: skip)")
    ap.add_argument("--greedy-prompts", type=int, default=None,
                    help="greedy continuations of the first N conversations only (default: all)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="greedy continuations run together")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="let the matmul kernel vary with the row count (adds kernel rounding to the figures)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        defined = dict(parse_option(spec) for spec in args.define)
        options = select_options(args.baseline, [n for n in args.options.split(",") if n], defined)
        base = base_config(
            args.model, max_total_len=args.max_total_len, max_tokens=args.max_tokens,
            max_num_seqs=max(args.max_num_seqs, args.batch_size), device=args.device,
            num_threads=args.num_threads, batch_invariant=not args.no_batch_invariant, seed=args.seed,
        )
        engines = build_engines(base, options)
    except OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer = engines[args.baseline].tokenizer
    convs = sample_conversations(
        tokenizer, args.num_prompts, args.seed, max_total_len=args.max_total_len  # type: ignore[arg-type]
    )
    num_steps = len(plan_steps(convs, args.chunk, args.batch_size))
    t0 = time.perf_counter()
    with tqdm(total=num_steps, desc="teacher-forced steps", unit="step") as bar:
        results = evaluate(engines, args.baseline, convs, options, chunk=args.chunk, max_batch=args.batch_size,
                           max_tokens=args.max_tokens, progress=bar.update, max_rows=args.max_scored_rows,
                           greedy_prompts=args.greedy_prompts)
    elapsed = time.perf_counter() - t0
    num_reply = sum(len(c.reply_ids) for c in convs)
    model = engines[args.baseline].model_name
    print(f"{model}: {len(convs)} conversations, {num_reply} reply positions, chunk {args.chunk}, "
          f"baseline {args.baseline} {options[args.baseline]}; {len(engines)} engines, {elapsed:.0f} s")
    print("95% CI: percentile bootstrap over conversations (2,000 resamples) of the token-weighted mean KL")
    print(format_table(args.baseline, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model": model, "baseline": args.baseline,
                       "num_conversations": len(convs), "num_reply_positions": num_reply, "seconds": elapsed,
                       "results": [r.to_dict() for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
