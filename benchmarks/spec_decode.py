"""Single-stream TPOT with and without n-gram speculative decoding, side by side in one run.

    .venv/bin/python benchmarks/spec_decode.py [--num-prompts 4] [--max-tokens 96] [--dtype bfloat16]

Workloads: (a) code editing, generated reproducibly from a fixed list of snippets (each prompt asks the
model to fix or rewrite the snippet, so the answer repeats much of the prompt), (b) ShareGPT
(`pdserve.bench.datasets`). Requests run one at a time (batch 1), greedy, on the bundled SmolLM2 unless
`--model`; the same engine settings with `--speculative-config` on and off. Prints TPOT per workload,
the speedup, the acceptance rate and the mean acceptance length (tokens per verification step).
"""

from __future__ import annotations

import argparse
import json
import random

from pdserve import LLM, SamplingParams
from pdserve.bench.datasets import sample_sharegpt

SNIPPETS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) + 1\n",
    "def is_prime(n):\n    if n < 2:\n        return True\n    for d in range(2, n):\n        if n % d == 0:\n"
    "            return False\n    return True\n",
    "def reverse_words(s):\n    words = s.split(' ')\n    words.reverse\n    return ' '.join(words)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        count += 1\n        return self.count\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return b\n",
    "def read_lines(path):\n    f = open(path)\n    lines = f.readlines()\n    return [l.strip() for l in lines]\n",
]
ASKS = [
    "Fix the bug in this Python function and return the whole corrected code:",
    "Rewrite this code with type hints and a docstring, keeping its behaviour:",
    "Rename the variables in this code to clearer names and return the full code:",
]


def code_edit_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": f"{rng.choice(ASKS)}\n\n```python\n{SNIPPETS[i % len(SNIPPETS)]}```"}]
        for i in range(n)
    ]


def run(llm: LLM, prompts: list, params: SamplingParams, chat: bool) -> dict[str, float]:
    tpots, outs = [], 0
    for p in prompts:  # one at a time: single-stream
        o = (llm.chat(p, params, use_tqdm=False) if chat else llm.generate(p, params, use_tqdm=False))[0]
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        outs += n
        if m is not None and m.first_token_time is not None and m.finished_time is not None and n > 1:
            tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    return {"tpot_ms": 1000 * sum(tpots) / max(1, len(tpots)), "output_tokens": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llms = {
        "off": LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, kv_cache_memory_gb=0.5),
        "ngram": LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, kv_cache_memory_gb=0.5,
                     speculative_config=spec),
    }
    tok = llms["off"].tokenizer
    workloads = {
        "code-edit": (code_edit_prompts(args.num_prompts), True),
        "sharegpt": ([r.prompt for r in sample_sharegpt(tok, args.num_prompts, seed=0, max_prompt_len=512)], False),  # type: ignore[arg-type]
    }
    rows = []
    for name, (prompts, chat) in workloads.items():
        results = {}
        for mode, llm in llms.items():
            run(llm, prompts[:1], params, chat)  # warm-up (kernels, allocator)
            before = _stats(llm)
            results[mode] = run(llm, prompts, params, chat)
            after = _stats(llm)
            results[mode].update({k: after[k] - before[k] for k in after})
        s = results["ngram"]
        rows.append({
            "workload": name,
            "tpot_off_ms": results["off"]["tpot_ms"],
            "tpot_ngram_ms": s["tpot_ms"],
            "speedup": results["off"]["tpot_ms"] / s["tpot_ms"] if s["tpot_ms"] else float("nan"),
            "acceptance_rate": s["accepted"] / s["draft_tokens"] if s["draft_tokens"] else 0.0,
            "mean_acceptance_length": 1 + s["accepted"] / s["drafts"] if s["drafts"] else 0.0,
        })
    print(f"{'workload':<10} {'TPOT off ms':>12} {'TPOT ngram ms':>14} {'speedup':>8} {'accept':>7} {'mean len':>9}")
    for r in rows:
        print(f"{r['workload']:<10} {r['tpot_off_ms']:>12.2f} {r['tpot_ngram_ms']:>14.2f} {r['speedup']:>7.2f}x "
              f"{r['acceptance_rate']:>7.2f} {r['mean_acceptance_length']:>9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


def _stats(llm: LLM) -> dict[str, int]:
    s = llm.engine.spec_decode_stats
    if s is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens}


if __name__ == "__main__":
    main()
