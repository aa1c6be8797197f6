"""Decode TPOT against context length for each KV-cache dtype, side by side in one run.

    .venv/bin/python benchmarks/kv_quant.py [--contexts 256,1024,2048,4096,8192] [--batches 1,16,64]
        [--kv-dtypes bfloat16,int8,fp8_e4m3,int4] [--steps 8] [--max-kv-gb 8] [--json results/kv_quant.json]

The real model (bundled SmolLM2-135M by default, bf16) is loaded once. For each kv dtype the script builds
a KV cache of that dtype and a `ModelRunner` over the same model (attention chosen as the engine chooses
it: `--attention-backend auto` falls back to the torch reference where a backend cannot read the dtype,
and the table says which ran), fills the cache with synthetic K/V (random values and scales, every page
touched: a never-written page would be read from the kernel's zero page and look infinitely fast), and
times decode steps through `ModelRunner.execute`: `batch` sequences of `context` tokens each, every one
in blocks of its own (the engine's block size for each kv dtype unless `--block-size`: 128 tokens on a
CPU, int4 16), one new token per sequence per step. What a step costs is weight streaming
(independent of the kv dtype) plus reading the batch's KV, which int8/fp8 halves.

Beside each TPOT it times decode attention alone on the same cache: the backend's `decode` for every
layer, the step's queries at random (a 30-layer cache of GBs, blocks distinct per layer and sequence: read
cold from DRAM, as in a step). Both are the median over `--steps`; `--repeats N` times every point N times
and prints the best with the spread (max / min - 1). Every dtype's cache is built at the start and each
point runs the dtypes in turn, the order reversed every other repeat: this host kind's DRAM bandwidth
drifts by the minute, and one dtype's whole sweep after another's measured the drift (int8 0.75x bf16 at
batch 1 in one such run, ~1.0x alternating).

A (batch, context) point whose cache would exceed `--max-kv-gb` in some dtype is skipped in that dtype
(bf16 at 64 x 8k needs ~12 GB for SmolLM2, int8 ~6 GB: that is the capacity gain); the caches coexist,
so the memory used is up to `--max-kv-gb` per dtype. Prints ms per step
(TPOT) and attention ms per step per dtype with the speedup over the first dtype, the capacity (tokens per
GiB of `--kv-cache-memory-gb`, before int4's residual pool) and the host (`measure_machine`); writes
JSON with `--json`. On a busy machine the figures mean little: run on a quiet one, repeat, read the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from pdserve import LLM
from pdserve.attention.base import DecodeGroup
from pdserve.batch import Batch, BatchRequest
from pdserve.bench.machine import cpu_flags, measure_machine
from pdserve.config import default_block_size
from pdserve.engine.llm_engine import make_attention
from pdserve.kv.cache import KVCache, KVLayout
from pdserve.request import SamplingParams
from pdserve.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)


@dataclass(slots=True)
class DecodeStep:
    """What `ModelRunner.execute` reads from a scheduler output: the step as a `Batch`."""

    batch: Batch

    def to_batch(self) -> Batch:
        return self.batch


def decode_steps(batch: int, context: int, steps: int, block_size: int) -> list[DecodeStep]:
    """`steps` consecutive decode steps of `batch` sequences that each hold `context` tokens, in blocks
    of their own (sequence i owns blocks [i * per_seq, (i + 1) * per_seq))."""
    per_seq = -(-(context + steps) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    return [
        DecodeStep(Batch([BatchRequest(f"r{i}", [100 + i], context + s, tables[i], True, 0, GREEDY)
                          for i in range(batch)], batch))
        for s in range(steps)
    ]


def fill_synthetic(cache: KVCache) -> None:
    """Random K/V (and scales) in every page, layer by layer (no full-size temporary)."""
    g = torch.Generator().manual_seed(0)
    for layer in range(cache.data.shape[0]):
        d = cache.data[layer]
        if d.dtype == torch.uint8:  # int4: packed pairs, any byte is valid
            d.random_(0, 256, generator=g)
            cache.k_qparams[layer].uniform_(0.001, 0.02, generator=g)
            cache.v_qparams[layer].uniform_(0.001, 0.02, generator=g)
        elif d.dtype == torch.int8:
            d.random_(-128, 128, generator=g)
        elif d.dtype == torch.float8_e4m3fn:
            d.view(torch.uint8).random_(0, 0x70, generator=g)  # finite positive e4m3 patterns only
        else:
            d.normal_(0, 1, generator=g)
        if cache.scales is not None and d.dtype == torch.int8:  # float16 (scale, zero) pairs in the 4 bytes
            for params in (cache.layers[layer].k_scale, cache.layers[layer].v_scale):
                params[..., 0].uniform_(0.001, 0.02, generator=g)
                params[..., 1].uniform_(-2.5, -0.1, generator=g)
        elif cache.scales is not None:
            cache.scales[layer].uniform_(0.001, 0.02, generator=g)


def time_point(runner: ModelRunner, batch: int, context: int, steps: int, block_size: int) -> float:
    """Median seconds per decode step (after one warm-up step of the shape)."""
    plan = decode_steps(batch, context, steps + 1, block_size)
    runner.execute(plan[0])  # type: ignore[arg-type]
    times = []
    for step in plan[1:]:
        t0 = time.perf_counter()
        runner.execute(step)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_attention(runner: ModelRunner, cache: KVCache, batch: int, context: int, steps: int, block_size: int,
                   num_heads: int, head_dim: int, dtype: torch.dtype) -> float:
    """Median seconds of one step's decode attention: the backend's decode over every layer of the cache
    for `batch` sequences of `context + 1` tokens (the tables of `decode_steps`), random bf16 queries."""
    step = decode_steps(batch, context, 1, block_size)[0].batch
    per_seq = len(step.requests[0].block_ids)
    table = torch.tensor([r.block_ids for r in step.requests], dtype=torch.int64)
    lens = torch.full((batch,), context + 1, dtype=torch.int64)
    mask = (torch.arange(per_seq * block_size) < lens[:, None]).view(batch, 1, 1, -1)
    group = DecodeGroup(0, batch, table, lens, mask)
    q = torch.randn(batch, num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    attn, scale = runner.attn, head_dim**-0.5
    for layer in cache.layers:  # warm-up (page tables, thread pool)
        attn.decode(q, layer, group, scale)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for layer in cache.layers:
            attn.decode(q, layer, group, scale)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", default="256,1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--kv-dtypes", default="bfloat16,int8,fp8_e4m3,int4")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per point (median)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per block (default: the engine's for each kv dtype, config.default_block_size)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-kv-gb", type=float, default=8.0, help="skip points whose cache would be larger")
    ap.add_argument("--repeats", type=int, default=1, help="times each point is measured (best, spread)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    kv_dtypes = args.kv_dtypes.split(",")

    # The engine's own cache is not used: a few blocks, so its memory goes to the caches built here.
    llm = LLM(args.model, dtype=args.dtype, num_blocks=4, block_size=args.block_size,
              max_model_len=max(contexts) + args.steps + 2, num_threads=args.num_threads)
    eng = llm.engine
    cfg = eng.model_config
    print(f"model {eng.model_name}, {eng.dtype}, {torch.get_num_threads()} threads")
    limits = measure_machine(dtypes=("bfloat16",))
    host = (f"{limits.cpu}, {limits.num_threads} threads, {' '.join(f for f, on in cpu_flags().items() if on)}, "
            f"DRAM {limits.memory_bandwidth / 1e9:.1f} GB/s, bf16 matmul {limits.matmul_flops['bfloat16'] / 1e9:.0f} GFLOP/s")
    print(f"host: {host}")

    Times = dict[str, list[float] | None]
    tpot: dict[tuple[int, int], Times] = {(b, c): {} for b in batches for c in contexts}
    attn_s: dict[tuple[int, int], Times] = {(b, c): {} for b in batches for c in contexts}
    backends: dict[str, str] = {}
    capacity: dict[str, int] = {}  # tokens per GiB
    block_sizes: dict[str, int] = {}
    runs: dict[str, tuple[ModelRunner, KVCache, int]] = {}  # every dtype's cache at once: points alternate
    for kv_dtype in kv_dtypes:
        bs = block_sizes[kv_dtype] = args.block_size or default_block_size(eng.device.type, kv_dtype)
        layout = KVLayout.for_model(cfg, bs, kv_dtype, eng.dtype)
        capacity[kv_dtype] = 2**30 // layout.block_bytes * bs
        fits = [(b, c) for b in batches for c in contexts
                if b * -(-(c + args.steps + 1) // bs) * layout.block_bytes <= args.max_kv_gb * 2**30]
        for key in tpot.keys() - set(fits):
            tpot[key][kv_dtype] = attn_s[key][kv_dtype] = None
        if not fits:
            continue
        num_blocks = max(b * -(-(c + args.steps + 1) // bs) for b, c in fits)
        # int4: the blocks each point's steps write stay open (a few per sequence, never freed here)
        residual = 2 * sum(b for b, _ in fits) * args.repeats + 8 if layout.is_int4 else 0
        cache = KVCache(layout, num_blocks, eng.device, num_residual_slots=residual)
        fill_synthetic(cache)
        attn = make_attention(args.attention_backend, eng.dtype, eng.device, layout.kv_dtype)
        attn.warmup(cache.layers[0], cfg.num_heads)
        backends[kv_dtype] = attn.name
        runs[kv_dtype] = (ModelRunner(eng.model, cache, attn, eng.device), cache, bs)
        paths = getattr(attn, "kernel_paths", None)  # cpu-paged names the kernels it runs for this cache
        kernels = f" (decode {paths(cache.layers[0], cfg.num_heads)[0]})" if paths else ""
        print(f"{kv_dtype}: {layout.describe()}; {num_blocks} blocks, {cache.nbytes / 2**30:.2f} GiB; "
              f"{capacity[kv_dtype]} tokens per GiB; attention {attn.name}{kernels}", flush=True)
    for (b, c), times in tpot.items():
        live = [d for d in runs if times.get(d, []) is not None]
        for d in live:
            tpot[(b, c)][d], attn_s[(b, c)][d] = [], []
        for r in range(args.repeats):  # the dtypes in turn, the order reversed every other repeat
            for d in live if r % 2 == 0 else live[::-1]:
                runner, cache, bs = runs[d]
                tpot[(b, c)][d].append(time_point(runner, b, c, args.steps, bs))  # type: ignore[union-attr]
                attn_s[(b, c)][d].append(time_attention(  # type: ignore[union-attr]
                    runner, cache, b, c, args.steps, bs, cfg.num_heads, cfg.head_dim, eng.dtype))
        for d in live:
            print(f"  {d} batch {b} context {c}: TPOT {[round(x * 1e3, 2) for x in tpot[(b, c)][d]]} ms, "  # type: ignore[union-attr]
                  f"attention {[round(x * 1e3, 2) for x in attn_s[(b, c)][d]]} ms", flush=True)  # type: ignore[union-attr]
    del runs

    first = kv_dtypes[0]
    spread = lambda t: f" ±{(max(t) / min(t) - 1) * 100:.0f}%" if len(t) > 1 else ""  # noqa: E731

    def table(title: str, times: dict[tuple[int, int], Times]) -> list[dict]:
        print(f"{title} (ms per step, best of {args.repeats}{', spread max/min - 1' if args.repeats > 1 else ''})")
        head = ["batch", "context"] + [f"{d} ms" for d in kv_dtypes] + [f"{d} x{first}" for d in kv_dtypes[1:]]
        print(" | ".join(head))
        out = []
        for (b, c), t in times.items():
            cells = [str(b), str(c)] + [f"{min(t[d]) * 1e3:.2f}{spread(t[d])}" if t.get(d) else "skip" for d in kv_dtypes]
            base = t.get(first)
            cells += [f"{min(base) / min(t[d]):.2f}" if base and t.get(d) else "-" for d in kv_dtypes[1:]]
            print(" | ".join(cells))
            out.append({"batch": b, "context": c,
                        "ms": {d: ([x * 1e3 for x in t[d]] if t.get(d) else None) for d in kv_dtypes}})  # type: ignore[union-attr]
        return out

    rows = table("TPOT, whole model", tpot)
    attention_rows = table("decode attention, all layers", attn_s)
    print("capacity (tokens per GiB): " + ", ".join(
        f"{d} {n} ({n / capacity[first]:.2f}x)" for d, n in capacity.items()))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": eng.model_name, "dtype": str(eng.dtype), "threads": torch.get_num_threads(),
                       "host": host, "block_size": block_sizes, "attention": backends, "steps": args.steps,
                       "repeats": args.repeats, "tokens_per_gib": capacity, "tpot": rows,
                       "decode_attention": attention_rows}, f, indent=1)


if __name__ == "__main__":
    main()
