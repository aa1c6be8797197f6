"""Speed with bf16, int8 (weight-only) and w8a8 (int8 weights and per-token int8 activations) weights
(`--weight-dtype`), side by side in one run: single-stream and batched decode tokens/s, one prompt
chunk's prefill tokens/s, the weight bytes one step streams (projections and output head, as the kernels
serving that row count hold them), and what share of this host's measured DRAM read bandwidth that
stream reaches.

    .venv/bin/python benchmarks/weight_quant.py [--model M] [--weight-dtypes bfloat16,int8,w8a8]
        [--batches 1,16,64] [--chunk 512] [--context 256] [--steps 32] [--linear-kernel auto]
        [--json results/weight_quant.json]

Each batch size: that many sequences with `--context` random prompt tokens are prefilled, one decode
step warms the shape, then `--steps` decode-only steps are timed. The prompt row ("prefill"): one
step that computes a `--chunk`-token prompt chunk, the best of 3 after a warm-up chunk. Every weight
dtype's engine is built first and each point runs the dtypes in turn, `--repeats` times with the order
reversed every other time, keeping the best (this host kind's DRAM bandwidth drifts by the minute: one
dtype's whole sweep after another's measured the drift too). The DRAM bandwidth is
`pdserve bench machine`'s probe (`measure_memory_bandwidth` over 1 GiB). Figures name their host: the
JSON carries the CPU, its flags, the thread count and the bandwidth, and each weight dtype's kernel table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from bisect import bisect_left

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.machine import cpu_flags, cpu_name, measure_memory_bandwidth
from pdserve.model.linear import BucketedLinear, resident_bytes


def streamed_bytes(model, rows: int) -> int:  # type: ignore[no-untyped-def]
    """Bytes of weights one step of `rows` rows reads: every projection's and the head's weights as held
    by the kernel that serves `rows` (a decode step reads each once)."""
    plan = model.linear_plan
    if plan is None:  # plain F.linear on the parameters
        return sum(t.numel() * t.element_size() for ws in model.linear_weights().values() for t in ws)
    total = 0
    for ps in plan.packed.values():
        for p in ps:
            k = p
            if isinstance(p, BucketedLinear):
                k = p.kernels[min(bisect_left(p.bounds, rows), len(p.kernels) - 1)]
            total += resident_bytes(k.weight_tensors())
    return total


def decode_rate(llm: LLM, batch: int, context: int, steps: int, seed: int) -> float:
    """Seconds per decode-only step with `batch` sequences of about `context` tokens."""
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    for _ in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while eng.scheduler.waiting or any(r.is_prefill for r in eng.scheduler.running):
        eng.step()
    eng.step()  # warm the decode shape
    t0 = time.perf_counter()
    n = 0
    while n < steps and eng.has_unfinished_requests():
        eng.step()
        n += 1
    step = (time.perf_counter() - t0) / max(n, 1)
    while eng.has_unfinished_requests():
        eng.step()
    return step


def prefill_rate(llm: LLM, chunk: int, seed: int, repeats: int = 3) -> float:
    """Seconds of the best of `repeats` steps that each compute one fresh `chunk`-token prompt chunk (one
    warm-up chunk first: oneDNN builds a primitive per new shape)."""
    eng = llm.engine
    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    best = float("inf")
    for i in range(repeats + 1):
        eng.block_manager.reset_prefix_cache()
        prompt = [rng.randrange(100, vocab) for _ in range(chunk)]
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        if i > 0:
            best = min(best, dt)
        while eng.has_unfinished_requests():
            eng.step()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--weight-dtypes", default="bfloat16,int8,w8a8", help="the first is the ratios' baseline")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--chunk", type=int, default=512, help="prompt tokens of the prefill row (0: skip it)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence before decoding")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    ap.add_argument("--linear-kernel", default="auto")
    ap.add_argument("--kernel-cache-dir", default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="times each point runs every dtype (best kept)")
    ap.add_argument("--json", default="results/weight_quant.json", help="where to write the figures")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.weight_dtypes.split(",")
    base = dtypes[0]

    dram = measure_memory_bandwidth(1 << 30, 0.5)
    host = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": args.num_threads or torch.get_num_threads(),
            "dram_bandwidth": dram}
    print(f"host: {host['cpu']}, {host['threads']} threads, "
          f"{' '.join(f for f, on in host['flags'].items() if on)}; DRAM read {dram / 1e9:.1f} GB/s")
    plans: dict[str, dict | None] = {}
    llms: dict[str, LLM] = {}
    for wd in dtypes:  # every engine at once: the points alternate between them
        llm = llms[wd] = LLM(
            model=args.model, dtype="bfloat16", weight_dtype=wd, linear_kernel=args.linear_kernel,
            kernel_cache_dir=args.kernel_cache_dir, num_threads=args.num_threads, max_num_seqs=max(batches),
            max_model_len=max(args.context + args.steps + 8, args.chunk + 8),
            max_num_batched_tokens=max(args.chunk, 2048),  # the chunk in one step
        )
        plan = llm.engine.model.linear_plan
        plans[wd] = None if plan is None else {"kind": plan.kind, "describe": plan.describe(),
                                               "table": None if plan.table is None else plan.table.to_json()}
        print(plan.describe() if plan is not None else f"{wd}: plain F.linear")
    points: list[int | str] = [*batches, *(["prefill"] if args.chunk else [])]
    best: dict[tuple[str, int | str], float] = {}
    for point in points:
        for rep in range(args.repeats):  # the dtypes in turn, the order reversed every other repeat
            for wd in dtypes if rep % 2 == 0 else dtypes[::-1]:
                if point == "prefill":
                    t = prefill_rate(llms[wd], args.chunk, seed=7)
                else:
                    t = decode_rate(llms[wd], int(point), args.context, args.steps, seed=int(point))
                best[(wd, point)] = min(t, best.get((wd, point), float("inf")))
    rows = []
    for wd in dtypes:
        model = llms[wd].engine.model
        for point in points:
            n = args.chunk if point == "prefill" else int(point)
            step, wbytes = best[(wd, point)], streamed_bytes(model, n)
            rows.append({"weight_dtype": wd, "batch": point, "step_ms": 1e3 * step, "tok_per_s": n / step,
                         "weight_bytes_per_step": wbytes, "weight_gb_per_s": wbytes / step / 1e9,
                         "fraction_of_dram": wbytes / step / dram,
                         "weight_roof_tok_per_s": n * dram / wbytes})
    del llms
    gc.collect()

    by = {(r["weight_dtype"], r["batch"]): r for r in rows}
    print(f"\ncontext {args.context} tokens per sequence, {args.steps} decode steps timed per batch; "
          f"prefill: one {args.chunk}-token prompt chunk per step; best of {args.repeats}, dtypes alternating")
    print(f"{'batch':>7} {'weights':>8} {'step ms':>8} {'tok/s':>8} {'W MB/step':>9} {'W GB/s':>7} {'%DRAM':>6} "
          f"{'roof tok/s':>10} {'/' + base:>9}")
    speedups: dict[str, dict[str, float]] = {wd: {} for wd in dtypes[1:]}
    for b in [*batches, *(["prefill"] if args.chunk else [])]:
        for wd in dtypes:
            r = by[(wd, b)]
            ratio = ""
            if wd != base:
                speedups[wd][str(b)] = r["tok_per_s"] / by[(base, b)]["tok_per_s"]
                ratio = f"{speedups[wd][str(b)]:.2f}x"
            label = b if b != "prefill" else f"p{args.chunk}"
            print(f"{label:>7} {wd:>8} {r['step_ms']:>8.2f} {r['tok_per_s']:>8.1f} "
                  f"{r['weight_bytes_per_step'] / 1e6:>9.1f} {r['weight_gb_per_s']:>7.1f} "
                  f"{100 * r['fraction_of_dram']:>5.0f}% {r['weight_roof_tok_per_s']:>10.1f} {ratio:>9}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"host": host, "model": args.model, "context": args.context, "steps": args.steps,
                       "chunk": args.chunk, "repeats": args.repeats, "rows": rows, "baseline": base,
                       "speedup_over_baseline": speedups,
                       "linear_plans": plans}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
