"""What a structured-output constraint costs a decode step, side by side in one run: the same batch of
sequences decoding with and without a JSON schema, and where the difference goes.

    .venv/bin/python benchmarks/structured_outputs.py [--model M] [--batches 1,16,64] [--context 128]
        [--steps 24] [--repeats 3] [--schema records|short-strings] [--json results/structured_outputs.json]

Each batch size: that many requests with `--context` random prompt tokens, all constrained by the
`--schema` JSON schema (a long array: no request completes inside the timed steps) or none (ignore_eos), prefilled, two decode steps to warm the shape, then `--steps` decode-only steps timed one
by one (`engine.step()`, the whole step: schedule with the grammars' bitmasks, forward, sampling, the
grammars taking their tokens, detokenizing). The two settings alternate `--repeats` times; the best mean
per setting is kept. The parts: llguidance computing the batch's bitmasks, packing them into one
tensor (`TokenMasks`) and the engine's sampler taking greedy tokens under them, against without (timed
apart on the same grammars and shapes; the sampler's mask kernels are those the engine measured
fastest at start: printed). Greedy sampling.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.machine import cpu_flags, cpu_name
from pdserve.runner.kernels import TokenMasks
from pdserve.runner.sampler import SamplingMetadata
from pdserve.structured import StructuredOutputs, bitmasks

# A list of records (the common case), and a list of strings of at most 8 characters: a length bound on
# strings is llguidance's slow case (its precomputed token sets for JSON strings no longer apply: ~7x the
# mask time at SmolLM2's vocabulary on host G).
SCHEMAS = {
    "records": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age", "email"],
        },
        "minItems": 200,
    },
    "short-strings": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 500},
}


def step_times(
    llm: LLM, batch: int, context: int, steps: int, schema: dict | None, seed: int
) -> list[float]:
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    rng = random.Random(seed)
    vocab = min(eng.model_config.vocab_size, 30_000)
    so = StructuredOutputs(json=schema) if schema is not None else None
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=so is None, structured_outputs=so)
    ids = [eng.add_request([rng.randrange(100, vocab) for _ in range(context)], params) for _ in range(batch)]
    while any(r.is_prefill for r in eng.scheduler.requests.values()):
        eng.step()
    eng.step()
    eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    for i in ids:
        eng.abort_request(i)
    assert all(eng.scheduler.requests.get(i) is None for i in ids)
    return times


def mask_parts(llm: LLM, batch: int, schema: dict, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per step of: the batch's bitmasks (llguidance, each grammar in a fresh state: a
    matcher keeps the mask of its current state), packing them, masking and taking greedy tokens."""
    eng = llm.engine
    assert eng.grammars is not None
    so = StructuredOutputs(json=schema)
    outs = llm.generate([[100 + i] * 8 for i in range(batch)], SamplingParams(temperature=0, max_tokens=repeats + 1,
                        structured_outputs=so), use_tqdm=False)
    texts = [o.outputs[0].token_ids for o in outs]
    grammars = [eng.grammars.compile(so) for _ in range(batch)]
    bitmask = 0.0
    for j in range(repeats):
        t = time.perf_counter()
        masks = bitmasks(grammars)
        bitmask += (time.perf_counter() - t) / repeats
        for g, ids in zip(grammars, texts):
            if j < len(ids) and not g.is_complete:
                g.accept(ids[j])
    vocab = eng.model_config.vocab_size
    logits = torch.randn(batch, vocab).to(eng.dtype)
    params = [SamplingParams(temperature=0)] * batch
    t = time.perf_counter()
    for _ in range(repeats):
        TokenMasks.from_rows(masks, vocab, torch.device("cpu"))
    pack = (time.perf_counter() - t) / repeats
    md = SamplingMetadata.from_params(params, {}, vocab, torch.device("cpu"), allowed=masks)
    plain = SamplingMetadata.from_params(params, {}, vocab, torch.device("cpu"))
    sampler = eng.runner.sampler  # with the mask kernels the engine chose
    t = time.perf_counter()
    for _ in range(repeats):
        sampler(logits, md)
    masked = (time.perf_counter() - t) / repeats
    t = time.perf_counter()
    for _ in range(repeats):
        sampler(logits, plain)
    free = (time.perf_counter() - t) / repeats
    return {"bitmask_ms": bitmask * 1e3, "pack_ms": pack * 1e3, "sample_masked_ms": masked * 1e3,
            "sample_plain_ms": free * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="records")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    llm = LLM(model=args.model, kv_cache_memory_gb=2.0)
    print(f"sampling kernels: {llm.engine.runner.sampler.kernels.name}")
    print(f"host: {cpu_name()}, threads {torch.get_num_threads()}, "
          f"flags {' '.join(f for f, on in sorted(cpu_flags().items()) if on)}")
    llm.engine.grammars.compile(StructuredOutputs(json_object=True))  # type: ignore[union-attr]  (token table)
    rows = []
    print(f"{'batch':>5} {'plain ms':>9} {'json ms':>9} {'overhead':>9} | {'bitmask':>8} {'pack':>8} "
          f"{'mask+greedy':>11} {'greedy':>7} (ms per step)")
    for batch in (int(b) for b in args.batches.split(",")):
        best = {False: float("inf"), True: float("inf")}
        for r in range(args.repeats):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                schema = SCHEMAS[args.schema] if constrained else None
                ts = step_times(llm, batch, args.context, args.steps, schema, seed=r)
                best[constrained] = min(best[constrained], sum(ts) / len(ts))
        parts = mask_parts(llm, batch, SCHEMAS[args.schema])
        plain, con = best[False] * 1e3, best[True] * 1e3
        row = {"batch": batch, "plain_ms": plain, "json_ms": con, "overhead": con / plain - 1, **parts}
        rows.append(row)
        print(f"{batch:>5} {plain:>9.2f} {con:>9.2f} {100 * row['overhead']:>8.1f}% | {parts['bitmask_ms']:>8.2f} "
              f"{parts['pack_ms']:>8.2f} {parts['sample_masked_ms']:>11.2f} {parts['sample_plain_ms']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": cpu_name(), "flags": sorted(f for f, on in cpu_flags().items() if on), "threads": torch.get_num_threads(),
                       "model": args.model or "default", "schema": args.schema, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
