"""pdserve's GEMM (the AMX or the AVX-512 kernel) of two or more source trees, side by side, call by call.

    .venv/bin/python benchmarks/linear_ab.py [--revs HEAD~1,worktree] [--kernel amx|pdserve]
        [--shapes 9728x896,896x4864] [--layers 24] [--rows 32,64,128,256,512,1024,2048] [--rounds 5]

A kernel change is worth what it measures against its parent on the same host in the same minutes (this
machine kind's speed moves by tens of percent within minutes). Each revision (`git archive` of its
`pdserve/` into a temporary directory; `worktree`: this checkout as it is) builds its own copy of
`model/csrc/linear_bf16.cpp` into one process, and the revisions take turns pass by pass, the order
reversed every other round. A pass is `--layers` distinct weights of each shape (N x K, packed from
random bf16; by default Qwen2.5-0.5B's gate_up and down of 24 layers, 627 MB: they stream from DRAM as
in a decode step; `--layers 1` keeps them in cache). oneDNN (`F.linear` on the unpacked weights) runs
beside them unless `--no-onednn`. Printed: ms per pass (best of the rounds), TFLOP/s, each revision
against the first, and whether its output is bit-equal to the first's.

glibc serves an allocation over 32 MB with a fresh mmap unless its heap already has a free chunk that
size, and the engine's heap has (0 minor faults per decode step), but a fresh process has not: outputs
over 32 MB (e.g. 2,048 rows x 9,728 columns) would page-fault on every call and time the kernel of
nobody. So the script raises the mmap threshold first (`mallopt`, glibc only).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from decode_ab import source_tree  # a revision's `pdserve/` from `git archive` (benchmarks/ is on sys.path)

_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1


def keep_large_allocations_in_the_heap() -> bool:
    """Let glibc reuse freed heap memory for large tensors instead of mapping fresh pages per call."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))
    except (OSError, AttributeError):
        return False


def build(tree: Path) -> Any:
    """That tree's linear extension, built as the engine builds its own (`pdserve.model.linear._build`),
    named by its sources' hash (identical trees share one build)."""
    from pdserve.model.linear import _build

    csrc = tree / "model" / "csrc"
    digest = hashlib.sha1()
    for f in sorted([*csrc.glob("*.h"), csrc / "linear_bf16.cpp", *(tree / "csrc").glob("*.h")]):
        digest.update(f.read_bytes())
    return _build(f"pdserve_linear_ab_{digest.hexdigest()[:12]}", str(csrc / "linear_bf16.cpp"),
                  "AVX-512 BF16 or AVX2 + FMA")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", default="HEAD~1,worktree", help="git revisions, or `worktree`, comma-separated")
    ap.add_argument("--kernel", default="amx", choices=("amx", "pdserve"))
    ap.add_argument("--shapes", default="9728x896,896x4864", help="N x K of each weight of a layer")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rows", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-onednn", action="store_true")
    args = ap.parse_args()
    print(f"glibc mmap threshold raised: {keep_large_allocations_in_the_heap()}")
    torch.set_grad_enabled(False)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    revs = args.revs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        exts = [build(source_tree(rev, Path(tmp)) / "pdserve") for rev in revs]
    if args.kernel == "amx" and not exts[0].amx_available():
        raise SystemExit("no AMX BF16 here (CPU, OS or compiler): try --kernel pdserve")
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for _ in range(args.layers)] for n, k in shapes]
    packed = [[exts[0].pack(w) for w in ws] for ws in weights]  # one packing: the layout is the kernels' contract
    Pass = Callable[[list[torch.Tensor]], torch.Tensor]

    def kernel_pass(ext: Any) -> Pass:
        f = ext.linear_amx if args.kernel == "amx" else ext.linear

        def run(xs: list[torch.Tensor]) -> torch.Tensor:
            for i in range(args.layers):
                for (n, _), p, x in zip(shapes, packed, xs):
                    out = f(x, p[i], n)
            return out

        return run

    def onednn_pass(xs: list[torch.Tensor]) -> torch.Tensor:
        for i in range(args.layers):
            for w, x in zip(weights, xs):
                out = F.linear(x, w[i])
        return out

    candidates: dict[str, Pass] = {rev: kernel_pass(ext) for rev, ext in zip(revs, exts)}
    if not args.no_onednn:
        candidates["onednn"] = onednn_pass
    names = list(candidates)
    flops = 2 * sum(n * k for n, k in shapes) * args.layers
    print(f"{args.kernel} kernel, {args.layers} layers of {args.shapes}: ms per pass, best of {args.rounds}")
    print("rows | " + " | ".join(names) + " | " + " | ".join(f"{r} x {revs[0]}" for r in revs[1:]))
    for m in map(int, args.rows.split(",")):
        xs = [torch.randn(m, k, generator=gen).bfloat16() for _, k in shapes]
        first = candidates[revs[0]](xs)
        same = {r: torch.equal(candidates[r](xs), first) for r in revs[1:]}
        best = dict.fromkeys(names, float("inf"))
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                t = time.perf_counter()
                candidates[name](xs)
                best[name] = min(best[name], time.perf_counter() - t)
        cells = [f"{best[n] * 1e3:.2f} ({m * flops / best[n] / 1e12:.2f} TF/s)" for n in names]
        ratios = [f"{best[revs[0]] / best[r]:.2f}x{'' if same[r] else ' (bits differ)'}" for r in revs[1:]]
        print(f"{m} | " + " | ".join(cells + ratios), flush=True)


if __name__ == "__main__":
    main()
