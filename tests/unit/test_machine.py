import math

import torch

from pdserve.bench.machine import (
    MachineLimits,
    measure_machine,
    measure_matmul_flops,
    measure_memory_bandwidth,
)


def positive_finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_matmul_flops_positive():
    for dtype in (torch.float32, torch.bfloat16):
        assert positive_finite(measure_matmul_flops(16, 32, 8, dtype, seconds=0.01))


def test_memory_bandwidth_positive():
    assert positive_finite(measure_memory_bandwidth(1 << 20, seconds=0.01))


def test_measure_machine():
    limits = measure_machine(dtypes=("float32", "bfloat16"), hidden=16, seconds=0.01, nbytes=1 << 20)
    assert isinstance(limits, MachineLimits)
    assert set(limits.matmul_flops) == {"float32", "bfloat16"}
    assert all(positive_finite(v) for v in limits.matmul_flops.values())
    assert positive_finite(limits.memory_bandwidth)
    assert limits.num_threads == torch.get_num_threads() >= 1
    assert limits.cpu
