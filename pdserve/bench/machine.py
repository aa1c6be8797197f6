"""This machine's roofs: peak GEMM throughput per dtype and memory read bandwidth; and the report
`pdserve bench machine` prints (`machine_report`): CPU flags, DRAM and cache-sized read bandwidth, the
roofs, and the A/B table of the model's own projections under each matmul kernel per row count.

Benchmarks divide what a phase achieves by these to say how close it gets: prefill is judged against
the GEMM roof, decode against the bandwidth roof. Everything runs on the current
`torch.get_num_threads()` threads, warmed up first, timed with `time.perf_counter`, and reported as
the best of a few windows. A figure measured here names its host by this report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.model.autotune import cpu_info


@dataclass(slots=True)
class MachineLimits:
    matmul_flops: dict[str, float] = field(default_factory=dict)  # dtype name -> FLOP/s
    memory_bandwidth: float = 0.0  # bytes read per second
    num_threads: int = 0
    cpu: str = ""


def _best_rate(fn: Callable[[], object], work: float, seconds: float, rounds: int = 5) -> float:
    """Highest `work`-per-second rate of `fn` over `rounds` windows sharing `seconds`.

    A roof is a maximum, and other processes on the machine only ever slow a window down, so the best
    window is a steadier estimate than the mean. Each window runs `fn` at least once; a few untimed calls
    first warm caches, the allocator and the thread pool.
    """
    for _ in range(3):
        fn()
    window = seconds / rounds
    best = 0.0
    for _ in range(rounds):
        iters = 0
        start = time.perf_counter()
        while True:
            fn()
            iters += 1
            elapsed = time.perf_counter() - start
            if elapsed >= window:
                break
        best = max(best, work * iters / elapsed)
    return best


@torch.inference_mode()
def measure_matmul_flops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """FLOP/s of a [m×k] @ [k×n] matmul, counting 2·m·k·n FLOP per product, output buffer reused."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    return _best_rate(lambda: torch.matmul(a, b, out=out), 2.0 * m * k * n, seconds)


@torch.inference_mode()
def measure_memory_bandwidth(nbytes: int = 512 << 20, seconds: float = 0.5) -> float:
    """Read bandwidth in bytes/s: the time to sum a float32 tensor of `nbytes` bytes, counting only the
    bytes read (the result is one scalar). Pick `nbytes` well above the last-level cache."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)  # ones, not empty: pages get touched
    out = torch.empty((), dtype=torch.float32)
    return _best_rate(lambda: torch.sum(x, dim=0, out=out), x.numel() * x.element_size(), seconds)


def cpu_name() -> str:
    return cpu_info()[0]


# What decides which matmul kernel wins: AVX-512 BF16 dot products (pdserve's kernel) vs AMX tiles (pdserve's AMX
# kernel, oneDNN's).
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> dict[str, bool]:
    flags = set(cpu_info()[1])
    return {f: f in flags for f in RELEVANT_FLAGS}


def measure_machine(
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    hidden: int = 576,
    seconds: float = 0.5,
    nbytes: int = 512 << 20,
) -> MachineLimits:
    """Measure the roofs: the compute roof per dtype is a large prefill-shaped GEMM,
    2048×hidden @ hidden×4·hidden; the bandwidth roof reads `nbytes`."""
    flops = {
        name: measure_matmul_flops(2048, hidden, 4 * hidden, getattr(torch, name), seconds) for name in dtypes
    }
    return MachineLimits(
        matmul_flops=flops,
        memory_bandwidth=measure_memory_bandwidth(nbytes, seconds),
        num_threads=torch.get_num_threads(),
        cpu=cpu_name(),
    )


REPORT_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 2048)


def kernel_ab(
    weights: Mapping[str, Sequence[torch.Tensor]],
    rows: Sequence[int],
    bf16_roof: float,
    dram_bandwidth: float,
    repeats: int = 5,
    head_ops: Sequence[str] = ("lm_head",),
    weight_dtype: str | None = None,
) -> dict:
    """Every kernel timed at every row count on these weights (a complete A/B table, no early stop),
    the kernel that wins per op and row count, and what the winners reach: the layer projections'
    FLOP/s against the bf16 matmul roof (a prompt chunk's GEMMs; `head_ops` are left out there, since
    a prompt step runs the output head on its last rows only), and all weight bytes streamed per
    second against DRAM bandwidth (a decode step reads every weight once)."""
    from pdserve.model.linear import measure_linears

    table = measure_linears(weights, rows, repeats=repeats, give_up=math.inf, weight_dtype=weight_dtype)
    shape = {op: (int(ws[0].shape[0]), int(ws[0].shape[1]), len(ws)) for op, ws in weights.items()}
    layer_ops = [op for op in shape if op not in head_ops]
    macs = sum(shape[op][0] * shape[op][1] * shape[op][2] for op in layer_ops)
    from pdserve.model.linear import Int8Weight

    int8 = isinstance(next(iter(weights.values()))[0], Int8Weight)
    wbytes = sum((1 if int8 else ws[0].element_size()) * math.prod(shape[op]) for op, ws in weights.items())
    chosen = table.chosen_seconds()
    per_rows = []
    for i, m in enumerate(table.buckets):
        winners = {op: table.winners(op)[i] for op in table.seconds}
        layer_s = sum(table.seconds[op][winners[op]][i] for op in layer_ops)
        flops = 2.0 * m * macs / layer_s
        totals = {c: table.total_seconds(c)[i] for c in table.order}
        per_rows.append({
            "rows": m,
            "ms": {c: None if math.isinf(t) else 1e3 * t for c, t in totals.items()},
            "chosen_ms": 1e3 * chosen[i],
            "winners": winners,
            "layer_flops": flops,
            "fraction_of_bf16_roof": flops / bf16_roof if bf16_roof else None,
            "weight_bytes_per_s": wbytes / chosen[i],
            "fraction_of_dram_bandwidth": wbytes / chosen[i] / dram_bandwidth if dram_bandwidth else None,
        })
    return {"ops": {op: list(v) for op, v in shape.items()}, "weight_bytes": wbytes, "rows": per_rows,
            "weight_dtype": weight_dtype or ("int8" if int8 else "bfloat16"),
            "table": table.to_json()}


def machine_report(
    weights: Mapping[str, Sequence[torch.Tensor]] | None = None,
    model_name: str = "",
    rows: Sequence[int] = REPORT_ROWS,
    repeats: int = 5,
    seconds: float = 0.5,
    dram_bytes: int = 1 << 30,
    cache_bytes: Sequence[int] = (1 << 20, 32 << 20),
    hidden: int = 576,
    weight_dtype: str | None = None,
) -> dict:
    """The host's CPU, flags, read bandwidth at DRAM and cache sizes, fp32/bf16 matmul roofs and, with
    `weights` (a model's `linear_weights()`), the kernel A/B table (`weight_dtype` "w8a8": `Int8Weight`s
    with the int8 x int8 kernels among the candidates). JSON-ready."""
    limits = measure_machine(("float32", "bfloat16"), hidden, seconds, dram_bytes)
    cpu, _ = cpu_info()
    bandwidth = {str(n): measure_memory_bandwidth(n, seconds) for n in cache_bytes}
    bandwidth[str(dram_bytes)] = limits.memory_bandwidth
    report = {
        "cpu": cpu,
        "flags": cpu_flags(),
        "threads": limits.num_threads,
        "torch": torch.__version__,
        "read_bandwidth": bandwidth,
        "dram_bandwidth": limits.memory_bandwidth,
        "matmul_flops": limits.matmul_flops,
        "model": model_name,
        "kernels": None,
    }
    if weights is not None:
        # The compute roof of a bf16 GEMM is the faster of torch's bf16 and fp32 matmuls: a CPU without native
        # bf16 (no AVX-512 BF16 / AMX: AMD Zen 3) runs torch's bf16 matmul at a few GFLOP/s, and pdserve's
        # bf16 kernels there on the fp32 units.
        roof = max(limits.matmul_flops["bfloat16"], limits.matmul_flops["float32"])
        report["kernels"] = kernel_ab(weights, rows, roof, limits.memory_bandwidth, repeats, weight_dtype=weight_dtype)
    return report


def format_report(r: Mapping) -> str:
    def mib(n: str) -> str:
        return f"{int(n) / (1 << 20):g} MiB"

    flags = " ".join(f for f, on in r["flags"].items() if on) or "(none of the relevant ones)"
    missing = " ".join(f for f, on in r["flags"].items() if not on)
    lines = [
        f"CPU        : {r['cpu']}, {r['threads']} threads, torch {r['torch']}",
        f"flags      : {flags}" + (f"   (absent: {missing})" if missing else ""),
        "read BW    : " + ", ".join(f"{v / 1e9:.0f} GB/s at {mib(n)}" for n, v in r["read_bandwidth"].items()),
        "matmul roof: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in r["matmul_flops"].items())
        + " (2048 x hidden @ hidden x 4*hidden)",
    ]
    k = r.get("kernels")
    if k:
        ops = list(k["ops"])
        cands = list(k["table"]["order"])
        lines.append("")
        wd = {"int8": "int8-weight", "w8a8": "w8a8"}.get(k.get("weight_dtype"), "bf16")
        lines.append(f"{wd} projections of {r['model'] or 'the model'}: " + ", ".join(
            f"{op} {n}x{kk} x{c}" for op, (n, kk, c) in k["ops"].items()) + f"; {k['weight_bytes'] / 1e6:.0f} MB")
        lines.append("ms per full pass (each weight cold), the winner per op; with the winners: the layer projections'")
        lines.append("GFLOP/s and % of the matmul roof, the faster of bf16 and fp32 (prompt chunks), weights streamed")
        lines.append("GB/s and % of DRAM BW (decode)")
        lines.append(f"{'rows':>5} " + " ".join(f"{c:>9}" for c in cands) + f" {'chosen':>9}  "
                     + " ".join(f"{op:>8}" for op in ops) + f"  {'GFLOP/s':>8} {'%roof':>6} {'GB/s W':>7} {'%BW':>5}")
        for row in k["rows"]:
            cells = " ".join(f"{'-':>9}" if row["ms"][c] is None else f"{row['ms'][c]:>9.2f}" for c in cands)
            picks = " ".join(f"{row['winners'][op]:>8}" for op in ops)
            roof = row["fraction_of_bf16_roof"]
            bw = row["fraction_of_dram_bandwidth"]
            lines.append(
                f"{row['rows']:>5} {cells} {row['chosen_ms']:>9.2f}  {picks}  {row['layer_flops'] / 1e9:>8.0f} "
                f"{100 * roof if roof else 0:>5.0f}% {row['weight_bytes_per_s'] / 1e9:>7.1f} {100 * bw if bw else 0:>4.0f}%"
            )
    return "\n".join(lines)
