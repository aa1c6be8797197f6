"""Prefill attention kernels side by side: the C++ flash kernel on AVX-512 BF16, its AMX variant (where the
CPU has AMX), and torch's SDPA, on the attention shapes of SmolLM2 (9 / 3 heads, head_dim 64), Qwen2.5-0.5B
(14 / 2, 64) and Qwen2.5-1.5B (12 / 2, 128).

    .venv/bin/python benchmarks/prefill_kernels.py [--repeats 7] [--block-size 128] [--json out.json]

Cases: one fresh prompt of 256, 1,024, 2,048 tokens; 8 prompts of 256 in one call (a packed step); a
512-token chunk after 2,048 cached tokens (chunked prefill). The C++ kernels read K/V through a block table
of scattered blocks; SDPA gets contiguous fresh K/V (GQA expanded), so it reads less than a real step.
Best of `--repeats` per kernel and case, all in one process back to back; GFLOP/s count the causal
q.k and p.v products.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pdserve.attention.cpu_paged import load_kernel
from pdserve.bench.machine import cpu_flags, cpu_name, measure_machine

SHAPES = {"smollm2": (9, 3, 64), "qwen-0.5b": (14, 2, 64), "qwen-1.5b": (12, 2, 128)}
CASES = {"1x256": [(0, 256)], "1x1024": [(0, 1024)], "1x2048": [(0, 2048)], "8x256": [(0, 256)] * 8,
         "2048+512": [(2048, 512)]}


def best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ms(t: float) -> str:
    return f"{t * 1e3:.2f}" if t == t else "-"


def ratio(slow: float, fast: float) -> str:
    return f"{slow / fast:.2f}x" if slow == slow and fast == fast else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    k = load_kernel()
    limits = measure_machine()
    print(f"host: {cpu_name()}, {torch.get_num_threads()} threads, {' '.join(f for f, on in cpu_flags().items() if on)}; DRAM read "
          f"{limits.memory_bandwidth / 1e9:.0f} GB/s, bf16 matmul {limits.matmul_flops['bfloat16'] / 1e12:.2f} TFLOP/s")
    rows = []
    print(f"{'shape':>10} {'case':>9} | {'avx512 ms':>9} {'amx ms':>8} {'sdpa ms':>8} | {'best GF/s':>9} | "
          "amx vs avx512 / best vs sdpa   (-: no such kernel on this CPU)")
    for name, (H, KVH, D) in SHAPES.items():
        avx = bool(k.prefill_fast_path(True, H, KVH, D, args.block_size))
        amx = bool(k.prefill_amx_fast_path(True, H, KVH, D, args.block_size))
        for case, seqs in CASES.items():
            bs = args.block_size
            g = torch.Generator().manual_seed(0)
            nb = sum(-(-(c + n) // bs) for c, n in seqs)
            kc = torch.randn(KVH, nb, bs, D, generator=g).bfloat16()
            vc = torch.randn(KVH, nb, bs, D, generator=g).bfloat16()
            perm = torch.randperm(nb, generator=g).tolist()
            tables = [[perm.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            total = sum(n for _, n in seqs)
            q = torch.randn(total, H, D, generator=g).bfloat16()
            out = torch.empty_like(q)
            starts = torch.tensor([sum(n for _, n in seqs[:i]) for i in range(len(seqs))])
            lens, ctx = torch.tensor([n for _, n in seqs]), torch.tensor([c + n for c, n in seqs])
            flops = sum(4 * H * D * n * (c + (n + 1) / 2) for c, n in seqs)
            call = (q, kc, vc, table, starts, lens, ctx, D**-0.5, out)
            t_avx = best(lambda: k.paged_prefill(*call), args.repeats) if avx else float("nan")
            t_amx = best(lambda: k.paged_prefill_amx(*call), args.repeats) if amx else float("nan")
            c0, n0 = seqs[0]
            qq = torch.randn(1, H, n0, D).bfloat16()
            kk, vv = torch.randn(1, H, c0 + n0, D).bfloat16(), torch.randn(1, H, c0 + n0, D).bfloat16()
            mask = None if c0 == 0 else torch.ones(n0, c0 + n0, dtype=torch.bool).tril(c0)
            t_sdpa = len(seqs) * best(
                lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None), args.repeats)
            rows.append({"shape": name, "case": case, "avx512_s": t_avx if avx else None, "amx_s": t_amx if amx else None,
                         "sdpa_s": t_sdpa, "flops": flops})
            t_best = min(t_sdpa, *(t for t in (t_avx, t_amx) if t == t))
            print(f"{name:>10} {case:>9} | {ms(t_avx):>9} {ms(t_amx):>8} {ms(t_sdpa):>8} | {flops / t_best / 1e9:9.0f} | "
                  f"{ratio(t_avx, t_amx)} / {ratio(t_sdpa, t_best)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": {"cpu": cpu_name(), "flags": [f for f, on in cpu_flags().items() if on], "threads": torch.get_num_threads(),
                                "dram_bytes_per_s": limits.memory_bandwidth,
                                "bf16_flops": limits.matmul_flops["bfloat16"]}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
