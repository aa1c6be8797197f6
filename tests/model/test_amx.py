"""The AMX paths (model/linear.py): where the CPU has AMX BF16, oneDNN's linear runs AMX tiles, and it
and pdserve's own AMX kernel are autotune candidates and compute the model's prompt-chunk shapes to bf16
rounding against float32. Skipped only where /proc/cpuinfo has no `amx_bf16`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.model.autotune import cpu_info
from pdserve.model.linear import AmxLinear, OneDnnLinear, amx_bf16, available_kernels

if "amx_bf16" not in cpu_info()[1]:
    pytest.skip("this CPU has no AMX BF16", allow_module_level=True)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_onednn_is_a_candidate_and_runs_amx_tiles():
    assert "onednn" in available_kernels()
    # pdserve's AMX kernel builds wherever the compiler knows AMX (-march=native on this CPU)
    assert amx_bf16() and "amx" in available_kernels()
    code = (
        "import torch\n"
        "from pdserve.model.linear import OneDnnLinear\n"
        "lin = OneDnnLinear(torch.randn(960, 576).bfloat16())\n"
        "for m in (1, 64, 512): lin(torch.randn(m, 576).bfloat16())\n"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    impls = [line.split(",")[6] for line in out.stdout.splitlines() if ",exec,cpu,inner_product," in line]
    assert len(impls) == 3 and all("amx" in impl for impl in impls), impls


@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536)])
@pytest.mark.parametrize("m", [512, 2048])
@pytest.mark.parametrize("kernel", [OneDnnLinear, AmxLinear])
def test_prompt_chunk_shapes_match_float32(m, n, k, kernel):
    x, w = rand(m, k, seed=m), rand(n, k, seed=n + k)
    got = kernel(w)(x)
    ref = x.float() @ w.float().T
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3 * k**0.5)
