"""Single-stream TPOT of a target model with and without a draft model proposing, side by side in one run.

    .venv/bin/python benchmarks/spec_draft.py [--model qwen2.5-coder-1.5b-instruct]
        [--draft-model qwen2.5-coder-0.5b-instruct] [--num-prompts 4] [--max-tokens 96] [--json out.json]

Workloads as `benchmarks/spec_decode.py`: the bench's `code-edit` dataset (`pdserve/bench/code_edit.py`)
and ShareGPT from `pdserve.bench.datasets`. Requests run one at a time (batch 1), greedy; the same engine settings with
`{"method": "draft", ...}` (or `--method ngram`: prompt lookup) on and off, one engine at a time. Prints TPOT per workload, the speedup, the acceptance rate and
the mean acceptance length (tokens per verification step).
"""

from __future__ import annotations

import argparse
import gc
import json

from pdserve import LLM, SamplingParams
from pdserve.bench.code_edit import sample_code_edit
from pdserve.bench.datasets import sample_sharegpt


def run(llm: LLM, prompts: list, params: SamplingParams, chat: bool) -> dict[str, float]:
    """Mean TPOT over `prompts` run one at a time, and the speculation counters' change over them."""
    before = _stats(llm)
    tpots = []
    for p in prompts:
        o = (llm.chat(p, params, use_tqdm=False) if chat else llm.generate(p, params, use_tqdm=False))[0]
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is not None and m.first_token_time is not None and m.finished_time is not None and n > 1:
            tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    after = _stats(llm)
    return {"tpot_ms": 1000 * sum(tpots) / max(1, len(tpots)), **{k: after[k] - before[k] for k in after}}


def _stats(llm: LLM) -> dict[str, int]:
    s = llm.engine.spec_decode_stats
    if s is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--method", choices=("draft", "ngram"), default="draft",
                    help="ngram: prompt-lookup drafts instead of the draft model (same one-engine-at-a-time runs)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON here")
    args = ap.parse_args()

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec: dict[str, object] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft":
        spec["model"] = args.draft_model
    results: dict[str, dict[str, dict[str, float]]] = {}
    # One engine at a time (the 1.5B alone needs several GB): every workload without, then with the draft.
    for mode in ("off", "spec"):
        llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, kv_cache_memory_gb=0.5,
                  speculative_config=spec if mode == "spec" else None)
        workloads = {
            "code-edit": ([[{"role": "user", "content": r.prompt}] for r in sample_code_edit(llm.tokenizer, args.num_prompts)], True),
            "sharegpt": ([r.prompt for r in sample_sharegpt(llm.tokenizer, args.num_prompts, seed=0, max_prompt_len=512)], False),  # type: ignore[arg-type]
        }
        for name, (prompts, chat) in workloads.items():
            run(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=8), chat)  # warm-up
            results.setdefault(name, {})[mode] = run(llm, prompts, params, chat)
        del llm
        gc.collect()
    rows = []
    for name, r in results.items():
        off, s = r["off"], r["spec"]
        rows.append({
            "workload": name,
            "tpot_off_ms": off["tpot_ms"],
            "tpot_draft_ms": s["tpot_ms"],
            "speedup": off["tpot_ms"] / s["tpot_ms"] if s["tpot_ms"] else float("nan"),
            "acceptance_rate": s["accepted"] / s["draft_tokens"] if s["draft_tokens"] else 0.0,
            "mean_acceptance_length": 1 + s["accepted"] / s["drafts"] if s["drafts"] else 0.0,
        })
    proposer = f"draft {args.draft_model}" if args.method == "draft" else "n-gram prompt lookup"
    print(f"target {args.model}, {proposer}, k = {args.num_speculative_tokens}")
    print(f"{'workload':<10} {'TPOT off ms':>12} {'TPOT spec ms':>14} {'speedup':>8} {'accept':>7} {'mean len':>9}")
    for row in rows:
        print(f"{row['workload']:<10} {row['tpot_off_ms']:>12.2f} {row['tpot_draft_ms']:>14.2f} {row['speedup']:>7.2f}x "
              f"{row['acceptance_rate']:>7.2f} {row['mean_acceptance_length']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
