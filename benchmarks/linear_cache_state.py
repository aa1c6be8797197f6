"""The projections' kernels with the L3 as the autotune leaves it and with it evicted, as in a real step.

    .venv/bin/python benchmarks/linear_cache_state.py [--model smollm2-135m-instruct] [--rows 8,16,32,64,168]
        [--kernels onednn,pdserve] [--evict-mb 128] [--repeats 4]

The autotune (`pdserve.model.linear.measure_linears`) times a forward's projections in layer order, so
each weight is read as in a step; but a model whose projections are not much larger than the L3 (SmolLM2:
212 MB against 105 MB on host E) keeps part of them cached from pass to pass. In a real decode step each
layer's attention reads its KV cache between the layers' projections and evicts them. This times one
30-layer pass of every kernel named, at each row count, both ways (`as tuned`: passes back to back;
`evicted`: a read of --evict-mb before each layer, not timed), interleaved in one process, best of
--repeats: the difference is what the kernel pays for reading its weights from DRAM.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.model.linear import available_kernels
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import load_weights, resolve_model_path

OPS = ("qkv", "o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="8,16,32,64,168")
    ap.add_argument("--kernels", default="onednn,pdserve")
    ap.add_argument("--evict-mb", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=0)
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    rows = [int(r) for r in args.rows.split(",")]
    known = available_kernels()
    names = [k for k in args.kernels.split(",") if k]
    missing = [k for k in names if k not in known]
    if missing:
        raise SystemExit(f"unavailable here: {missing}; available: {sorted(known)}")
    cfg, hf = load_weights(resolve_model_path(args.model), torch.float32)
    model = LlamaModel(cfg)
    model.load_hf_weights(hf, consume=True)
    model = model.to(torch.bfloat16)
    weights = {op: ws for op, ws in model.linear_weights().items() if op in OPS}
    packed = {k: {op: [known[k](w) for w in ws] for op, ws in weights.items()} for k in names}
    evict = torch.ones(args.evict_mb << 18)  # float32: evict_mb MB

    @torch.inference_mode()
    def one_pass(kernel: str, n: int, evicted: bool) -> float:
        xs = {op: torch.randn(n, ws[0].shape[1]).bfloat16() for op, ws in weights.items()}
        spent = 0.0
        for i in range(cfg.num_layers):
            if evicted:
                evict.sum()
            for op in OPS:
                t0 = time.perf_counter()
                packed[kernel][op][i](xs[op])
                spent += time.perf_counter() - t0
        return spent

    for k in names:
        for n in rows:
            one_pass(k, n, False)  # oneDNN creates its primitive per row count once
    best: dict[tuple[str, int, bool], float] = {}
    for _ in range(args.repeats):
        for n in rows:
            for k in names:
                for evicted in (False, True):
                    t = one_pass(k, n, evicted)
                    best[(k, n, evicted)] = min(t, best.get((k, n, evicted), t))
    mb = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws) / 1e6
    print(f"{cfg.num_layers}-layer pass of the projections ({mb:.0f} MB bf16), ms, best of {args.repeats}; "
          f"as tuned / L3 evicted ({args.evict_mb} MB read before each layer), {torch.get_num_threads()} threads")
    print("rows " + "".join(f"{k:>24}" for k in names))
    for n in rows:
        cells = "".join(f"{best[(k, n, False)] * 1e3:>12.1f} /{best[(k, n, True)] * 1e3:>9.1f}" for k in names)
        print(f"{n:4d} {cells}")


if __name__ == "__main__":
    main()
