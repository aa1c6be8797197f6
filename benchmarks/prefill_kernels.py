"""Prefill attention kernels side by side: the C++ flash kernel on AVX-512 BF16, its AMX variant (where the
CPU has AMX), its AVX2 + FMA variant (any x86-64 CPU from Haswell / Zen on), and torch's SDPA on bf16 and on
float32-widened inputs, on the attention shapes of SmolLM2 (9 / 3 heads, head_dim 64), Qwen2.5-0.5B
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
          f"{limits.memory_bandwidth / 1e9:.0f} GB/s, matmul bf16 {limits.matmul_flops['bfloat16'] / 1e12:.2f} / float32 "
          f"{limits.matmul_flops['float32'] / 1e12:.2f} TFLOP/s")
    rows = []
    names = ("avx512", "amx", "avx2", "sdpa", "sdpa-f32")
    print(f"{'shape':>10} {'case':>9} | " + " ".join(f"{n + ' ms':>11}" for n in names) +
          f" | {'best GF/s':>9} | best C++ vs best SDPA   (-: no such kernel on this CPU)")
    for name, (H, KVH, D) in SHAPES.items():
        bs = args.block_size
        has = {"avx512": bool(k.prefill_fast_path(True, H, KVH, D, bs)),
               "amx": bool(k.prefill_amx_fast_path(True, H, KVH, D, bs)),
               "avx2": bool(k.prefill_avx2_path(True, H, KVH, D, bs)), "sdpa": True, "sdpa-f32": True}
        for case, seqs in CASES.items():
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
            c0, n0 = seqs[0]
            mask = None if c0 == 0 else torch.ones(n0, c0 + n0, dtype=torch.bool).tril(c0)

            def sdpa(dtype: torch.dtype) -> float:
                qq = torch.randn(1, H, n0, D).to(dtype)
                kk, vv = torch.randn(1, H, c0 + n0, D).to(dtype), torch.randn(1, H, c0 + n0, D).to(dtype)
                return len(seqs) * best(lambda: F.scaled_dot_product_attention(
                    qq, kk, vv, attn_mask=mask, is_causal=mask is None), args.repeats)

            run = {"avx512": lambda: k.paged_prefill(*call, isa="avx512"), "amx": lambda: k.paged_prefill_amx(*call),
                   "avx2": lambda: k.paged_prefill(*call, isa="avx2")}
            t = {n: (best(run[n], args.repeats) if n in run else sdpa(torch.bfloat16 if n == "sdpa" else torch.float32))
                 if has[n] else float("nan") for n in names}
            rows.append({"shape": name, "case": case, "flops": flops,
                         **{f"{n.replace('-', '_')}_s": (v if v == v else None) for n, v in t.items()}})
            cpp = min((v for n, v in t.items() if v == v and "sdpa" not in n), default=float("nan"))
            sd = min(t["sdpa"], t["sdpa-f32"])
            t_best = min(sd, cpp) if cpp == cpp else sd
            print(f"{name:>10} {case:>9} | " + " ".join(f"{ms(t[n]):>11}" for n in names) +
                  f" | {flops / t_best / 1e9:9.0f} | {ratio(sd, cpp)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": {"cpu": cpu_name(), "flags": [f for f, on in cpu_flags().items() if on], "threads": torch.get_num_threads(),
                                "dram_bytes_per_s": limits.memory_bandwidth,
                                "bf16_flops": limits.matmul_flops["bfloat16"],
                                "f32_flops": limits.matmul_flops["float32"]}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
