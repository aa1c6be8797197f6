"""benchmarks/linear_cache_state.py runs on the bundled model and prints a row per row count."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "linear_cache_state.py"


def test_prints_both_cache_states_for_every_row_count():
    from pdserve.model.linear import available_kernels

    kernel = "pdserve" if "pdserve" in available_kernels() else "torch"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "1,3", "--kernels", kernel, "--repeats", "1", "--evict-mb", "8"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    assert "30-layer pass of the projections (212 MB bf16)" in out
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+) /\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["1", "3"] and all(float(a) > 0 and float(b) > 0 for _, a, b in rows)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--kernels", "mkl"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "unavailable here: ['mkl']" in bad.stderr
