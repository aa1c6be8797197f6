"""Structured outputs with n-gram speculation, against without, side by side in one run: chat requests
for JSON records under a schema (keys and punctuation repeat, so prompt-lookup drafts often hold), greedy,
each engine's output checked equal to the other's.

    .venv/bin/python benchmarks/structured_spec.py [--model M] [--batches 1,8] [--max-tokens 256]
        [--repeats 3] [--num-speculative-tokens 4]

Per batch size: that many requests (different numbers of records asked for), run to the end by
`LLM.generate` on an engine without speculation and one with `{"method": "ngram"}`, alternating
`--repeats` times; the best wall time of each is kept. Prints output tokens per second, the speedup and
the share of drafts accepted. Prints the host's CPU flags first.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve import LLM, SamplingParams, StructuredOutputs
from pdserve.bench.machine import cpu_flags, cpu_name

SCHEMA = {  # at least 6 records: the keys and their punctuation repeat in the output
    "type": "array",
    "minItems": 6,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                       "city": {"type": "string"}},
        "required": ["name", "age", "email", "city"],
        "additionalProperties": False,
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="float32: outputs equal bit for bit (bf16: the verify step's "
                    "GEMM shapes differ from a decode step's, so near ties can flip)")
    args = ap.parse_args()
    print(f"host: {cpu_name()}, {torch.get_num_threads()} threads, {' '.join(f for f, on in cpu_flags().items() if on)}")
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engines = {"plain": LLM(model=args.model, dtype=args.dtype),
               "ngram": LLM(model=args.model, dtype=args.dtype, speculative_config=ngram)}
    tok = engines["plain"].engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputs(json=SCHEMA))
    print(f"{'batch':>6}{'plain tok/s':>14}{'ngram tok/s':>14}{'speedup':>10}{'accepted':>10}{'same out':>10}")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content":
                   f"List {4 + i % 5} people as JSON records with name, age, email and city."}]), add_special_tokens=False)
                   for i in range(batch)]
        best: dict[str, float] = {}
        outs: dict[str, list[list[int]]] = {}
        accepted = drafted = 0
        for _ in range(args.repeats):
            for name, llm in engines.items():
                stats = llm.engine.spec_decode_stats
                before = (stats.num_accepted_tokens, stats.num_draft_tokens) if stats else (0, 0)
                t = time.perf_counter()
                got = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t
                outs[name] = [o.outputs[0].token_ids for o in got]
                best[name] = min(best.get(name, dt), dt)
                stats = llm.engine.spec_decode_stats
                if stats:
                    accepted += stats.num_accepted_tokens - before[0]
                    drafted += stats.num_draft_tokens - before[1]
        tokens = sum(len(o) for o in outs["plain"])
        rate = {n: tokens / best[n] for n in engines}
        share = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
        print(f"{batch:>6}{rate['plain']:>14.1f}{rate['ngram']:>14.1f}{rate['ngram'] / rate['plain']:>9.2f}x"
              f"{share:>10}{str(outs['plain'] == outs['ngram']):>10}")


if __name__ == "__main__":
    main()
