"""The decode attention kernel of two or more source trees, side by side, call by call.

    .venv/bin/python benchmarks/decode_ab.py [--revs HEAD~1,worktree] [--shapes 9/3,14/2]
        [--batches 16,64] [--context 2048] [--kv-dtypes bf16,int8] [--decode-kernel cpp|amx|avx2] [--rounds 12]

A kernel change is worth what it measures against its parent on the same host in the same minutes; on a
shared 2-core host the speed of DRAM drifts by tens of percent over minutes, so two runs one after the
other say little. Here each revision (`git archive` of its `pdserve/` into a temporary directory;
`worktree`: this checkout as it is) gets a worker process that builds its own C++ extension and the
same inputs (`attention_kernels.py`'s random caches, blocks scattered at random, enough layers cycled
that one pass reads `--min-bytes`, so the blocks come from DRAM), and the workers take turns: every
round times one pass of every point in every worker, in a shuffled order. Printed: us per layer call,
median and best over the rounds, per point and revision, and each revision's median against the
first's. The workers run with `OMP_WAIT_POLICY=PASSIVE` (unless set): otherwise the idle workers'
OpenMP threads spin after each call and steal the cores from the one being timed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def points(args: argparse.Namespace) -> list[tuple[int, int, int, str]]:
    """(heads, kv heads, batch, kv dtype) for every shape, batch and dtype."""
    shapes = [tuple(int(x) for x in s.split("/")) for s in args.shapes.split(",")]
    return [(h, kvh, b, dt) for h, kvh in shapes for b in map(int, args.batches.split(","))
            for dt in args.kv_dtypes.split(",")]


def worker(args: argparse.Namespace) -> None:
    """Build the inputs of every point, then time one pass per index read from stdin."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import attention_kernels as ak

    from pdserve.attention.cpu_paged import AttentionPlan, CpuPagedAttention

    attn = CpuPagedAttention(AttentionPlan(decode="cpp" if args.decode_kernel == "avx2" else args.decode_kernel))
    decode = attn.decode
    if args.decode_kernel == "avx2":  # the AVX2 + FMA kernel forced on a CPU that has more
        def decode(q, cache, g, scale):  # type: ignore[no-redef]
            return attn._decode_cpp(q, cache, g, scale, "avx2")
    d = args.head_dim
    setups = []
    for h, kvh, b, dt in points(args):
        torch.manual_seed(0)
        q, caches, groups = ak.decode_inputs(dt, b, args.context, h, kvh, d, args.block_size, args.min_bytes,
                                             args.max_layers)
        for c, gr in zip(caches, groups):  # warm-up: the build, page faults, the thread pool
            decode(q, c, gr, d**-0.5)
        setups.append((q, caches, groups))
    paths = {dt: "C++ AVX2 + FMA (forced)" if args.decode_kernel == "avx2" else attn.kernel_paths(s[1][0], h)[0]
             for (h, _, _, dt), s in zip(points(args), setups)}
    print("ready " + "; ".join(paths.values()), flush=True)
    for line in sys.stdin:
        q, caches, groups = setups[int(line)]
        t0 = time.perf_counter()
        for c, gr in zip(caches, groups):
            decode(q, c, gr, d**-0.5)
        print((time.perf_counter() - t0) / len(caches) * 1e6, flush=True)


def source_tree(rev: str, tmp: Path) -> Path:
    """A directory whose `pdserve/` is that revision's (worktree: this checkout)."""
    if rev == "worktree":
        return REPO
    out = tmp / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    blob = subprocess.run(["git", "-C", str(REPO), "archive", rev, "pdserve"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(out, filter="data")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", default="HEAD~1,worktree", help="git revisions, or `worktree`; the first is the base")
    ap.add_argument("--shapes", default="9/3,14/2", help="heads/kv heads (SmolLM2: 9/3, Qwen2.5-0.5B: 14/2)")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--kv-dtypes", default="bf16,int8", help="bf16, int8, fp8_e4m3")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--decode-kernel", default="cpp", choices=["cpp", "amx", "avx2"],
                    help="the C++ kernel's default path, its AMX one (a bf16 cache on an AMX CPU; others as cpp), "
                         "or its AVX2 + FMA one forced (what an AVX2-only host runs)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--min-bytes", type=float, default=400e6, help="cache bytes one pass reads at least")
    ap.add_argument("--max-layers", type=int, default=30)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    revs = args.revs.split(",")
    pts = points(args)
    forwarded = [a for a in sys.argv[1:] if a != "--worker"]
    with tempfile.TemporaryDirectory(prefix="pdserve-decode-ab-") as tmp_dir:
        tmp = Path(tmp_dir)
        procs = {}
        for rev in revs:
            tree = source_tree(rev, tmp)
            env = dict(os.environ, PYTHONPATH=str(tree))
            if rev != "worktree":  # its own build (the checkout's is cached where it always is)
                env["TORCH_EXTENSIONS_DIR"] = str(tmp / f"ext-{len(procs)}")
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            procs[rev] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", *forwarded], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
        for rev, p in procs.items():
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if not line.startswith("ready"):
                sys.exit(f"worker for {rev} failed to start (its stderr is above)")
            print(f"{rev}: {line[6:]}")
        times: dict[tuple[str, int], list[float]] = {(r, i): [] for r in revs for i in range(len(pts))}
        for _ in range(args.rounds):
            for i in range(len(pts)):
                for rev in random.sample(revs, len(revs)):
                    p = procs[rev]
                    assert p.stdin is not None and p.stdout is not None
                    p.stdin.write(f"{i}\n")
                    p.stdin.flush()
                    times[(rev, i)].append(float(p.stdout.readline()))
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait()
    print(f"us per layer call, median / best of {args.rounds} rounds; context {args.context}, head_dim "
          f"{args.head_dim}, blocks of {args.block_size}; x: the first revision's median over this one's")
    print(f"{'heads/kv':>8} {'batch':>5} {'kv':>8} " + " ".join(f"{r[:20]:>24}" for r in revs))
    for i, (h, kvh, b, dt) in enumerate(pts):
        base = statistics.median(times[(revs[0], i)])
        cells = []
        for r in revs:
            med = statistics.median(times[(r, i)])
            cells.append(f"{med:8.0f} / {min(times[(r, i)]):6.0f} {base / med:5.2f}x")
        print(f"{f'{h}/{kvh}':>8} {b:>5} {dt:>8} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
