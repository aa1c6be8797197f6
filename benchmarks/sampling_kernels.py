"""The sampler's kernels side by side: torch's ops and the C++ kernels in each instruction set this build
has (`pdserve/runner/csrc/sampling.cpp`), ms per call on the vocabularies of the bundled models.

    python benchmarks/sampling_kernels.py [--rows 1,16,64,160] [--vocab 49152,151936] [--dtype bfloat16]

Per (rows, vocab): greedy (the argmax of each row), a temperature-1 draw from the logits as the model
gives them, and greedy under a structured-output mask with half the tokens allowed; median of `--repeats`
calls, each op and kernel in turn on the same inputs. Prints the host's CPU flags first (figures are only comparable on one host).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.bench.machine import cpu_flags, cpu_name
from pdserve.runner.kernels import ISA_NAMES, SamplingKernels, TokenMasks, load_kernels


def median_ms(f: Callable[[], object], repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,160")
    ap.add_argument("--vocab", default="49152,151936", help="SmolLM2's and Qwen2.5's vocabularies")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    ext = load_kernels()
    isas = list(ext.isas()) if ext is not None else []
    kernels: dict[str, SamplingKernels] = {"torch": SamplingKernels(None)}
    kernels.update({ISA_NAMES[i]: SamplingKernels(ext, i, i, i) for i in isas})
    dtype = getattr(torch, args.dtype)
    print(f"host: {cpu_name()}, {torch.get_num_threads()} threads, {' '.join(f for f, on in cpu_flags().items() if on)}")
    print(f"torch {torch.__version__}, logits {args.dtype}")
    names = list(kernels)
    print(f"{'op':<14}{'rows':>6}{'vocab':>8}" + "".join(f"{n + ' ms':>12}" for n in names) + f"{'best x torch':>14}")
    g = torch.Generator().manual_seed(0)
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(rows, vocab, generator=g).to(dtype)
            words = (vocab + 31) // 32
            packed = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64)
            masks = TokenMasks(torch.arange(rows), packed.to(torch.int32))
            temperature, u = torch.ones(rows), torch.rand(rows, generator=g)
            ops: dict[str, Callable[[SamplingKernels], object]] = {
                "greedy": lambda k: k.greedy(logits),
                "draw T=1": lambda k: k.draw(logits, temperature, u),
                "masked greedy": lambda k: k.argmax(logits, masks),
            }
            for op, call in ops.items():
                ms = [median_ms(lambda k=k: call(k), args.repeats) for k in kernels.values()]
                print(f"{op:<14}{rows:>6}{vocab:>8}" + "".join(f"{m:>12.3f}" for m in ms) + f"{ms[0] / min(ms[1:] or ms):>13.1f}x")


if __name__ == "__main__":
    main()
