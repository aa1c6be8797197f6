"""Preemption under KV pressure: recompute vs swap to the host tier, side by side in one run.

    .venv/bin/python benchmarks/preemption.py [--num-prompts 64] [--kv-cache-memory-gb 0.15]

The same ShareGPT requests (seed 0, dataset output lengths, ignore_eos, greedy) through one engine per
mode with a KV cache far smaller than the batch's peak demand, so the scheduler must preempt. Reports
wall time, requests/s, preemptions, the tokens computed beyond the minimum (prompt + output - 1 per
request: what recomputation costs), the blocks copied each way and the time spent copying, and whether
both modes produced the same tokens. Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import time

from pdserve import LLM, SamplingParams
from pdserve.bench.datasets import sample_sharegpt


def run(mode: str, args: argparse.Namespace) -> dict:
    llm = LLM(model=args.model, dtype=args.dtype, scheduler=args.scheduler, preemption_mode=mode,
              swap_space_gb=args.swap_space, kv_cache_memory_gb=args.kv_cache_memory_gb, kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    eng = llm.engine
    copy_time = 0.0
    swap = eng.kv_cache.swap

    def timed_swap(swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        nonlocal copy_time
        t = time.perf_counter()
        swap(swap_in, swap_out)
        copy_time += time.perf_counter() - t

    eng.kv_cache.swap = timed_swap  # type: ignore[method-assign]
    reqs = sample_sharegpt(eng.tokenizer, args.num_prompts, seed=args.seed)  # type: ignore[arg-type]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in eng.step_records)
    minimum = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    s = eng.scheduler
    return {
        "mode": mode,
        "kv_blocks": eng.block_manager.num_blocks,
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "preemptions": s.num_preemptions,
        "tokens_computed": computed,
        "tokens_recomputed": computed - minimum,
        "blocks_swapped_out": s.num_swapped_out_blocks,
        "blocks_swapped_in": s.num_swapped_in_blocks,
        "copy_time_s": copy_time,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--scheduler", default="chunked")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.15)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | int8 | fp8_e4m3")
    p.add_argument("--swap-space", type=float, default=4.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    results = [run(mode, args) for mode in ("recompute", "swap")]
    same = sum(a == b for a, b in zip(results[0]["token_ids"], results[1]["token_ids"]))
    cols = ["mode", "kv_blocks", "elapsed_s", "requests_per_s", "output_tokens_per_s", "preemptions",
            "tokens_recomputed", "blocks_swapped_out", "copy_time_s"]
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    rec, swp = results
    print(f"swap vs recompute: {rec['elapsed_s'] / swp['elapsed_s']:.2f}x speed; "
          f"{same}/{len(rec['token_ids'])} requests with identical tokens (bf16 batches differ in rounding)")
    if args.out:
        for r in results:
            del r["token_ids"]
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "identical_requests": same}, f, indent=2)


if __name__ == "__main__":
    main()
