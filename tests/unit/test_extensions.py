"""A build killed midway leaves torch's lock file behind; the next load must clear it, not wait forever."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    int answer() { return 42; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
""")


def test_a_stale_torch_lock_file_does_not_hang_the_next_load(tmp_path):
    src = tmp_path / "tiny_ext.cpp"
    src.write_text(SOURCE)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    code = (
        "import os, sys\n"
        "from pdserve.extensions import _build_directory, load_extension\n"
        "d = _build_directory('pdserve_test_tiny_ext'); os.makedirs(d, exist_ok=True)\n"
        "open(os.path.join(d, 'lock'), 'w').close()  # what an interrupted build leaves\n"
        f"ext = load_extension('pdserve_test_tiny_ext', [{str(src)!r}], ['-O0'], [])\n"
        "print(ext.answer())\n"
    )
    # torch's own load() would spin on the lock file forever: the timeout is the test's failure.
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "42"
    assert "interrupted build" in out.stderr
