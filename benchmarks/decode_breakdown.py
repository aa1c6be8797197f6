"""Where a decode step's time goes: the projections + output head (weight streaming), attention (KV
reads, including the step's KV write), the fused elementwise ops, and everything else (embedding,
sampling, batch building, Python), at a few batch sizes of decoding sequences.

    .venv/bin/python benchmarks/decode_breakdown.py [--batches 1,10,80] [--context 300] [--steps 24]
    .venv/bin/python benchmarks/decode_breakdown.py --sharegpt-at 30,150,500,1000 [--steps 10]
    .venv/bin/python benchmarks/decode_breakdown.py --kv-cache-dtypes bfloat16,int8 --batches 16 --context 2048

`--kv-cache-dtypes` builds one engine per KV dtype (each with its own `--kv-cache-memory-gb`), gives them
the same prompts and times their decode steps in `--rounds` rounds that alternate the engines (on a host
whose DRAM bandwidth drifts by the minute, one engine after the other measured the drift), then prints
each part's time ratio against the first: where a quantized cache's step time goes besides attention.

The second form runs the offline benchmark's workload (200 ShareGPT requests, seed 0, ignore_eos) and
times `--steps` steps from each listed step on: the batch as it really is, blocks scattered over the
cache, contexts of every length.

Each component is timed by wrapping its calls in this script only (perf_counter around each call: ~1 us
each, ~150 calls a step), so the sum slightly overstates the step. Prints the table with the bytes
each part must read and the GB/s it reaches, next to this host's DRAM read bandwidth; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import defaultdict

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.machine import cpu_flags, cpu_name, measure_memory_bandwidth
from pdserve.config import ModelConfig


class Timed:
    """A callable that adds its own wall time to `acc[key]`."""

    def __init__(self, fn, acc: dict, key: str) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.acc, self.key = fn, acc, key

    def __call__(self, *args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = self.fn(*args)
        self.acc[self.key] += time.perf_counter() - t0
        return out


class TimedMethods:
    """A proxy whose named methods are timed into `acc[key]`; everything else passes through."""

    def __init__(self, inner, names: tuple[str, ...], acc: dict, key: str) -> None:  # type: ignore[no-untyped-def]
        self._inner = inner
        for n in names:
            setattr(self, n, Timed(getattr(inner, n), acc, key))

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


def bf16_weight_bytes(cfg: ModelConfig) -> int:
    """The projections' and the output head's bytes in bf16: what a decode step streams at the least.
    From the shapes, not the tensors: the packed kernels hold the weights (and a bucketed op more than
    one layout of them), and the float parameters are freed once packed."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = d * hd * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * hd * d + 3 * d * cfg.intermediate_size
    return 2 * (cfg.num_layers * per_layer + cfg.vocab_size * d)


PARTS = ("linears", "attention", "elementwise")


def part_times(step: float, parts: dict[str, float], kv_bytes: float, weight_bytes: int) -> dict:
    """A row's times (seconds per step in, ms out; "other" is the step less the timed parts) and the rates
    the projections and attention read their bytes at."""
    parts = {**parts, "other": step - sum(parts.values())}
    return {"step_ms": 1e3 * step, **{f"{k}_ms": 1e3 * v for k, v in parts.items()},
            "weight_gb_per_s": weight_bytes / parts["linears"] / 1e9,
            "kv_gb_per_s": kv_bytes / parts["attention"] / 1e9, "kv_mb_per_step": kv_bytes / 1e6}


def sharegpt_rows(eng, acc: dict, marks: list[int], steps: int, weight_bytes: int, kv_bytes_per_token: int) -> list[dict]:  # type: ignore[no-untyped-def]
    """The offline benchmark's requests, all added at once; `steps` steps timed from each step in `marks`."""
    from pdserve.bench.datasets import sample_sharegpt

    for r in sample_sharegpt(eng.tokenizer, 200, seed=0):
        eng.add_request(r.prompt, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    rows, done = [], 0
    for mark in marks:
        while done < mark and eng.has_unfinished_requests():
            eng.step()
            done += 1
        running = list(eng.scheduler.running)
        if not running:
            break
        ctx = sum(r.num_computed_tokens for r in running)
        acc.clear()
        t0 = time.perf_counter()
        n = 0
        while n < steps and eng.has_unfinished_requests():
            eng.step()
            n += 1
        done += n
        step = (time.perf_counter() - t0) / n
        rows.append({"batch": len(running), "at_step": mark, "context_tokens": ctx,
                     **part_times(step, {k: acc[k] / n for k in PARTS}, ctx * kv_bytes_per_token, weight_bytes)})
    while eng.has_unfinished_requests():
        eng.step()
    return rows


MAX_TOKENS = 1024  # per sequence of the --batches form: more than its prompts' mixed steps and the timed ones


class Probe:
    """One engine with `kv_dtype`'s cache and its parts timed (this script's wrappers)."""

    def __init__(self, args, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
        max_len = args.context + MAX_TOKENS
        llm = LLM(model=args.model, dtype="bfloat16", linear_kernel=args.linear_kernel, max_num_seqs=256,
                  kv_cache_dtype=kv_dtype, kv_cache_memory_gb=args.kv_cache_memory_gb,
                  max_model_len=max(2048, max_len))
        self.kv_dtype, self.llm = kv_dtype, llm
        eng = self.eng = llm.engine
        model, self.cfg = eng.model, eng.model_config
        acc = self.acc = defaultdict(float)
        for layer in model.layers:
            layer.packed = {n: Timed(p, acc, "linears") for n, p in layer.packed.items()}
        if model.packed_lm_head is not None:
            model.packed_lm_head = Timed(model.packed_lm_head, acc, "linears")
        eng.runner.attn = TimedMethods(eng.runner.attn, ("forward",), acc, "attention")
        model.ops = TimedMethods(model.ops, ("add_rms_norm", "rope_qkv", "silu_mul"), acc, "elementwise")
        self.weight_bytes = bf16_weight_bytes(self.cfg)
        layout = eng.kv_layout
        self.kv_bytes_per_token = layout.block_bytes / layout.block_size  # scales included
        print(f"{kv_dtype}: {layout.describe()}; {eng.kv_cache.num_blocks} blocks of {layout.block_size} tokens")
        plan = model.linear_plan
        print(plan.describe() if plan is not None else "linears: plain F.linear")
        self.ids: list[str] = []
        self.total: dict[str, float] = defaultdict(float)
        self.steps = 0

    def sharegpt(self, marks: list[int], steps: int) -> list[dict]:
        """The ShareGPT form's rows (`sharegpt_rows`), labelled with this engine's kv dtype."""
        got = sharegpt_rows(self.eng, self.acc, marks, steps, self.weight_bytes, self.kv_bytes_per_token)
        return [{"kv_cache_dtype": self.kv_dtype, **r} for r in got]

    def start(self, prompts: list[list[int]]) -> None:
        """Every prompt decoding (the first ones decode while the others' prompts are still chunked in:
        room for every sequence to keep running through the timed steps; aborted by `stop`)."""
        eng = self.eng
        eng.block_manager.reset_prefix_cache()
        self.ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
                    for p in prompts]
        while eng.scheduler.waiting or any(r.is_prefill for r in eng.scheduler.running):
            eng.step()
        eng.step()  # warm the decode shape
        self.ctx = sum(r.num_computed_tokens for r in eng.scheduler.running)  # the first ones decoded meanwhile
        self.total.clear()
        self.steps = 0

    def time_steps(self, n: int) -> None:
        self.acc.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            self.eng.step()
        self.total["step"] += time.perf_counter() - t0
        for k in PARTS:
            self.total[k] += self.acc[k]
        self.steps += n

    def stop(self) -> dict:
        """The row of the timed steps, and the sequences aborted."""
        b = len(self.ids)
        if len(self.eng.scheduler.running) != b:
            raise RuntimeError(f"batch {b}: {len(self.eng.scheduler.running)} sequences ran (KV cache too small? "
                               f"raise --kv-cache-memory-gb)")
        for rid in self.ids:
            self.eng.abort_request(rid)
        n = self.steps
        kv_bytes = (self.ctx + b * n / 2) * self.kv_bytes_per_token
        return {"kv_cache_dtype": self.kv_dtype, "batch": b,
                **part_times(self.total["step"] / n, {k: self.total[k] / n for k in PARTS}, kv_bytes, self.weight_bytes)}


def measure_batches(args, probes: list[Probe]) -> list[dict]:  # type: ignore[no-untyped-def]
    """Each batch size on every probe's engine, the same prompts; the timed steps in `args.rounds` rounds
    that alternate the engines (reversed every other round), so a host whose bandwidth drifts by the
    minute weighs on every kv dtype alike and the ratios are side by side."""
    rng = random.Random(0)
    rows = []
    vocab = probes[0].cfg.vocab_size
    per_round = max(1, args.steps // args.rounds)
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(b)]
        for p in probes:
            p.start(prompts)
        for r in range(args.rounds):
            for p in (probes if r % 2 == 0 else probes[::-1]):
                p.time_steps(per_round)
        rows += [p.stop() for p in probes]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,10,80")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens per sequence before decoding")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per batch size")
    ap.add_argument("--rounds", type=int, default=4,
                    help="--batches form with several kv dtypes: the timed steps in this many rounds, engines alternating")
    ap.add_argument("--sharegpt-at", default=None, help="time the ShareGPT run from these step numbers instead")
    ap.add_argument("--linear-kernel", default="auto")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="comma list: one engine each, one after the other, the same batches (e.g. bfloat16,int8)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    ap.add_argument("--out", default="results/decode_breakdown.json")
    args = ap.parse_args()

    dram = measure_memory_bandwidth(1 << 30, 0.5)
    print(f"host: {cpu_name()}, {torch.get_num_threads()} threads, "
          f"{' '.join(f for f, on in cpu_flags().items() if on)}; DRAM read {dram / 1e9:.0f} GB/s")
    dtypes = args.kv_cache_dtypes.split(",")
    rows: list[dict] = []
    if args.sharegpt_at:  # each engine runs the whole workload, one after the other
        marks = [int(x) for x in args.sharegpt_at.split(",")]
        for kv_dtype in dtypes:
            probe = Probe(args, kv_dtype)
            rows += probe.sharegpt(marks, args.steps)
            weight_bytes = probe.weight_bytes
            del probe
    else:
        probes = [Probe(args, kv_dtype) for kv_dtype in dtypes]  # all built first: their steps alternate
        weight_bytes = probes[0].weight_bytes
        rows = measure_batches(args, probes)
    where = (f"ShareGPT run, {args.steps} steps from steps {args.sharegpt_at} (batch = running sequences)"
             if args.sharegpt_at else f"context {args.context} tokens per sequence")
    print(f"weights {weight_bytes / 1e6:.0f} MB per step; {where}")
    print(f"{'kv':>9} {'batch':>5} {'step ms':>8} {'linears':>8} {'W GB/s':>7} {'attn':>7} {'KV MB':>6} "
          f"{'KV GB/s':>8} {'elemwise':>8} {'other':>7}")
    for r in rows:
        print(f"{r['kv_cache_dtype']:>9} {r['batch']:>5} {r['step_ms']:>8.1f} {r['linears_ms']:>8.1f} "
              f"{r['weight_gb_per_s']:>7.1f} {r['attention_ms']:>7.1f} {r['kv_mb_per_step']:>6.0f} "
              f"{r['kv_gb_per_s']:>8.1f} {r['elementwise_ms']:>8.1f} {r['other_ms']:>7.1f}")
    if len(dtypes) > 1 and not args.sharegpt_at:
        base = {r["batch"]: r for r in rows if r["kv_cache_dtype"] == dtypes[0]}
        print(f"x {dtypes[0]} (its time / this one's), per part:")
        for r in rows:
            if r["kv_cache_dtype"] != dtypes[0]:
                b0 = base[r["batch"]]
                print(f"{r['kv_cache_dtype']:>9} {r['batch']:>5} " + " ".join(
                    f"{k} {b0[k + '_ms'] / r[k + '_ms']:.2f}x" for k in ("step", "linears", "attention", "elementwise", "other")))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"host": {"cpu": cpu_name(), "flags": cpu_flags(), "dram_bandwidth": dram,
                            "threads": torch.get_num_threads()}, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
