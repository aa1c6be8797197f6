"""This machine's roofs: peak GEMM throughput per dtype and memory read bandwidth.

Benchmarks divide what a phase achieves by these to say how close it gets: prefill is judged against
the GEMM roof, decode against the bandwidth roof. Everything runs on the current
`torch.get_num_threads()` threads, warmed up first, timed with `time.perf_counter`, and reported as
the best of a few windows.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


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
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
