"""Decode attention per step on a bf16, an int8 and an fp8 e4m3 KV cache, side by side: the cpu-paged
C++ kernel (what the engine calls) at each context length and batch size, with the bytes each step must
read from the cache and the GB/s that makes.

    .venv/bin/python benchmarks/attention_kernels.py [--contexts 256,1024,2048,4096,8192] [--batches 1,16,64]
        [--heads 9 --kv-heads 3 --head-dim 64] [--json results/attention_kernels.json]
    .venv/bin/python benchmarks/attention_kernels.py --kv-dtypes bf16 --paths auto,avx2,portable,torch

`--paths` times other decode paths on the bf16 cache beside it, each in its own column: `amx` the
AVX-512 kernel with q.k and p.v on AMX tiles (CPUs with AMX), `avx2` and `portable` the C++ kernel's AVX2 + FMA
path and its portable loop forced (`paged_decode(isa=...)`), `torch` the reference's gather + bmm; `auto`
the C++ kernel's default (the fastest ISA the build has; the engine's `--attention-backend auto` measures
it against `amx` at start). Speculative decoding's verification gives a sequence R query rows (its drafts
and the token before them) over the same context: `verifyR` (e.g. `verify4`) times them as the engine
runs them today, through the C++ prefill kernel (on AMX tiles where the CPU has them), and `rowsR` as R
decode rows each over its own causal prefix (one table row repeated; the K/V of the sequence read R
times, from L2 after the first): what verification costs next to the plain decode of the same context.

Decode is bandwidth-bound: a step reads every running sequence's K and V once. A quantized row is D bytes
plus 4 bytes of row parameters instead of 2D bytes (0.53x at head_dim 64), so the int8/fp8 columns should
approach that ratio of the bf16 time where the cache comes from DRAM. To keep the measurement out of the
caches, each point cycles through enough layer caches (blocks scattered at random, as a long-running
server's are) that one pass reads at least `--min-bytes` (capped at `--max-layers`); the time is one
layer's call, the median over `--steps` passes (`--stat best`: the fastest pass, which drops the passes
another process interrupted on a busy host), and "step" multiplies it by `--model-layers` (SmolLM2: 30).
The figures depend on the host and on what else runs on it: measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from pdserve.attention.base import DecodeGroup
from pdserve.attention.cpu_paged import CpuPagedAttention
from pdserve.attention.torch_ref import TorchAttention
from pdserve.bench.machine import cpu_flags, cpu_name
from pdserve.kv.cache import LayerCache

KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def random_cache(kv_dtype: str, kvh: int, num_blocks: int, block_size: int, head_dim: int) -> LayerCache:
    """Random contents in the storage dtype, values of a few units as real K/V have (larger ones make
    softmax weights underflow into denormals, which the CPU handles hundreds of times slower: a benchmark
    artefact); fp8 without the NaN codes."""
    shape = (kvh, num_blocks, block_size, head_dim)
    if kv_dtype == "bf16":
        return LayerCache(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())
    codes = [torch.randint(-126, 127, shape, dtype=torch.int8) for _ in range(2)]  # no 0x7f / 0xff (fp8 NaN)
    k, v = (c.view(KV_DTYPES[kv_dtype]) for c in codes)
    if kv_dtype == "int8":  # float16 (scale, zero) per row: values in [-2.5, 2.5]
        params = torch.tensor([5.0 / 255.0, -2.5]).half().expand(*shape[:3], 2).contiguous()
        return LayerCache(k, v, params, params.clone())
    unit = 2.5 / 448.0  # the largest code is 2.5
    return LayerCache(k, v, torch.full(shape[:3], unit), torch.full(shape[:3], unit))


def bytes_per_call(batch: int, context: int, kvh: int, heads: int, head_dim: int, kv_dtype: str) -> int:
    """What one layer's decode reads and writes: every context row of K and V (with its parameters when
    quantized), the queries and the output."""
    row = head_dim * (2 if kv_dtype == "bf16" else 1) + (0 if kv_dtype == "bf16" else 4)
    return 2 * batch * context * kvh * row + 2 * batch * heads * head_dim * 2


def decode_call(attn: CpuPagedAttention, path: str):  # type: ignore[no-untyped-def]
    """The decode function a column times: `auto` the engine's, else one path forced (see --paths)."""
    if path == "auto":
        return attn.decode
    if path == "torch":
        return lambda q, cache, g, scale: TorchAttention.decode(attn, q, cache, g, scale)
    return lambda q, cache, g, scale: attn._kernel.paged_decode(
        q, cache.k, cache.v, g.block_table, g.context_lens, scale, cache.k_scale, cache.v_scale, isa=path
    )


def verify_call(attn: CpuPagedAttention, path: str):  # type: ignore[no-untyped-def]
    """`verifyR` / `rowsR` (see --paths): R query rows per sequence of the group, the last R positions
    of its context; the rows' inputs are built on the first call for each group (the warm-up pass)."""
    verify = path.startswith("verify")
    r = int(path.removeprefix("verify" if verify else "rows"))
    inputs: dict[int, tuple] = {}

    def call(q, cache, g, scale):  # type: ignore[no-untyped-def]
        if id(g) not in inputs:
            b = q.shape[0]
            qr = q.repeat_interleave(r, 0)
            if verify:
                inputs[id(g)] = (qr, torch.arange(b) * r, torch.full((b,), r), g.context_lens, torch.empty_like(qr))
            else:
                ctx = (g.context_lens.view(-1, 1) - r + 1 + torch.arange(r)).reshape(-1)
                amx = attn._kernel.decode_amx_fast_path(q.dtype == cache.k.dtype == torch.bfloat16, q.shape[1],
                                                        cache.k.shape[0], q.shape[2], cache.k.shape[2])
                inputs[id(g)] = (qr, g.block_table.repeat_interleave(r, 0), ctx, "amx" if amx else "auto")
        k = attn._kernel
        if verify:
            qr, starts, lens, ctx, out = inputs[id(g)]
            args = (g.block_table, starts, lens, ctx, scale, out)
            if not k.paged_prefill_amx(qr, cache.k, cache.v, *args):
                k.paged_prefill(qr, cache.k, cache.v, *args, cache.k_scale, cache.v_scale, "auto")
            return out
        qr, table, ctx, isa = inputs[id(g)]
        return k.paged_decode(qr, cache.k, cache.v, table, ctx, scale, cache.k_scale, cache.v_scale, isa=isa)

    return call


def decode_inputs(kv_dtype: str, batch: int, context: int, heads: int, kvh: int, head_dim: int, block_size: int,
                  min_bytes: float, max_layers: int) -> tuple[torch.Tensor, list[LayerCache], list[DecodeGroup]]:
    """One step's queries and enough layer caches (blocks scattered at random) that one pass over them
    reads at least `min_bytes` (capped at `max_layers`), each with its decode group."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    nbytes = bytes_per_call(batch, context, kvh, heads, head_dim, kv_dtype)
    layers = max(1, min(max_layers, math.ceil(min_bytes / nbytes)))
    g = torch.Generator().manual_seed(0)
    caches, groups = [], []
    for _ in range(layers):
        caches.append(random_cache(kv_dtype, kvh, num_blocks, block_size, head_dim))
        table = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq)
        mask = (torch.arange(blocks_per_seq * block_size) < context).view(1, 1, 1, -1).expand(batch, 1, 1, -1)
        groups.append(DecodeGroup(0, batch, table, torch.full((batch,), context, dtype=torch.int64), mask))
    return torch.randn(batch, heads, head_dim).bfloat16(), caches, groups


def measure(attn: CpuPagedAttention, kv_dtype: str, batch: int, context: int, args: argparse.Namespace,
            path: str = "auto") -> dict:
    kvh, heads, d = args.kv_heads, args.heads, args.head_dim
    nbytes = bytes_per_call(batch, context, kvh, heads, d, kv_dtype)
    q, caches, groups = decode_inputs(kv_dtype, batch, context, heads, kvh, d, args.block_size, args.min_bytes,
                                      args.max_layers)
    layers = len(caches)
    scale = d**-0.5
    decode = verify_call(attn, path) if path.startswith(("verify", "rows")) else decode_call(attn, path)
    for cache, group in zip(caches, groups):  # warm-up: page faults, thread pool
        decode(q, cache, group, scale)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for cache, group in zip(caches, groups):
            decode(q, cache, group, scale)
        times.append((time.perf_counter() - t0) / layers)
    t = statistics.median(times) if args.stat == "median" else min(times)
    return {
        "kv_dtype": kv_dtype, "path": path, "batch": batch, "context": context, "layers_cycled": layers,
        "us_per_layer": t * 1e6, "ms_per_step": t * 1e3 * args.model_layers, "bytes_per_layer": nbytes,
        "gb_per_s": nbytes / t / 1e9, "us_per_layer_median": statistics.median(times) * 1e6,
        "us_per_layer_best": min(times) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--paths", default="auto",
                    help="decode paths on the bf16 cache, one column each: auto, amx, avx2, portable, torch, "
                         "verifyR, rowsR (R query rows per sequence, e.g. verify4)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--model-layers", type=int, default=30, help="layers per model step (SmolLM2-135M: 30)")
    ap.add_argument("--steps", type=int, default=20, help="timed passes per point")
    ap.add_argument("--stat", choices=["median", "best"], default="median")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--min-bytes", type=float, default=512e6, help="cache bytes one pass reads at least")
    ap.add_argument("--max-layers", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    attn = CpuPagedAttention()
    kv_dtypes = args.kv_dtypes.split(",")
    paths = {
        k: attn.kernel_paths(random_cache(k, args.kv_heads, 1, args.block_size, args.head_dim), args.heads)[0]
        for k in kv_dtypes
    }
    print(f"host: {cpu_name()}, {torch.get_num_threads()} threads, "
          f"{' '.join(f for f, on in cpu_flags().items() if on)}")
    for k, p in paths.items():
        print(f"decode {k}: {p}")
    # Columns: each kv dtype through the engine's path, and the bf16 cache through each other path.
    columns = [(k, "auto") for k in kv_dtypes if k != "bf16" or "auto" in args.paths.split(",")]
    if "bf16" in kv_dtypes:
        columns += [("bf16", p) for p in args.paths.split(",") if p != "auto"]
    names = {(k, p): k if p == "auto" else f"{k} {p}" for k, p in columns}
    results = []
    header = f"{'batch':>5} {'context':>7} " + " ".join(
        f"{names[c] + ' us':>15} {'GB/s':>6}" + ("" if names[c] == "bf16" else f" {'x bf16':>6}") for c in columns
    )
    print(header)
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            row = {names[(k, p)]: measure(attn, k, batch, context, args, p) for k, p in columns}
            results += row.values()
            cells = []
            for k, r in row.items():
                cell = f"{r['us_per_layer']:>15.1f} {r['gb_per_s']:>6.1f}"
                if k != "bf16" and "bf16" in row:
                    cell += f" {row['bf16']['us_per_layer'] / r['us_per_layer']:>6.2f}"
                cells.append(cell)
            print(f"{batch:>5} {context:>7} " + " ".join(cells), flush=True)
    print(f"us: one layer's decode call ({args.stat} of {args.steps}); x bf16: the bf16 time over this one "
          f"(a speed-up); a model step is {args.model_layers} such calls")
    if args.json:
        payload = {
            "host": cpu_name(), "threads": torch.get_num_threads(), "flags": cpu_flags(), "paths": paths,
            "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "block_size": args.block_size},
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
