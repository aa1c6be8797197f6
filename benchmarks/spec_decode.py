"""N-gram speculative decoding against plain decoding, side by side in one run.

    .venv/bin/python benchmarks/spec_decode.py [--num-prompts 4] [--max-tokens 96] [--dtype bfloat16]
    .venv/bin/python benchmarks/spec_decode.py --saturation [--saturation-prompts 200]

Single stream (default): requests one at a time (batch 1), greedy, on (a) the code-edit workload (the
bench's `code-edit` dataset, `pdserve/bench/code_edit.py`: rename/fix/annotate one Python stdlib
function, so the answer repeats much of the prompt; sent as chat) and (b) ShareGPT. Prints TPOT with
and without n-gram drafts, the speedup, the acceptance rate and the mean acceptance length (1 + accepted
/ drafts, tokens per verification step).

`--saturation`: the issue's floor, "never below 0.95x the non-speculative throughput at saturation".
ShareGPT prompts (each asking its reference reply's length, ignore_eos) all submitted at once, offline,
with and without n-gram; prints output-token throughput of both and their ratio.

`--slo-itl-ms X` / `--slo-tpot-ms Y` (either, with or without `--saturation`): every engine runs the
`slo` scheduler policy (ITL target X, default the policy's) and n-gram runs twice, with the
acceptance-only length rule ("accept") and the slack rule ("slack", with the TPOT target Y), so the
two rules compare side by side (docs/speculative.md, "Speculation length from latency slack"); the
tables add each mode's mean chosen speculation length.

The same engine settings for every mode, on the bundled SmolLM2 unless `--model`; a warm-up before
each measured run. `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from pdserve import LLM, SamplingParams
from pdserve.bench.code_edit import sample_code_edit
from pdserve.bench.datasets import SampleRequest, sample_sharegpt
from pdserve.config import CacheConfig, CodeEditMix, EngineConfig, SchedulerConfig, SpeculativeConfig


def run_single_stream(llm: LLM, prompts: list, params: SamplingParams, chat: bool) -> dict[str, float]:
    tpots, outs = [], 0
    for p in prompts:  # one at a time: single-stream
        o = (llm.chat(p, params, use_tqdm=False) if chat else llm.generate(p, params, use_tqdm=False))[0]
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        outs += n
        if m is not None and m.first_token_time is not None and m.finished_time is not None and n > 1:
            tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    return {"tpot_ms": 1000 * sum(tpots) / max(1, len(tpots)), "output_tokens": outs}


def run_batch(llm: LLM, samples: list[SampleRequest], max_tokens: int | None = None) -> dict[str, float]:
    """Every sample at once (each asking its `output_len`, at most `max_tokens`); output tokens per
    second of wall time."""
    params = [
        SamplingParams(temperature=0, max_tokens=min(s.output_len, max_tokens or s.output_len),
                       ignore_eos=True)
        for s in samples
    ]
    t0 = time.perf_counter()
    outs = llm.generate([s.prompt for s in samples], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": n, "output_tok_s": n / elapsed if elapsed > 0 else 0.0}


def measure(llm: LLM, run) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """`run(llm)`'s figures plus the speculation counters it moved."""
    before = _stats(llm)
    result = run(llm)
    after = _stats(llm)
    result.update({k: after[k] - before[k] for k in after})
    return result


def acceptance(s: dict[str, float]) -> tuple[float, float]:
    """(acceptance rate, mean acceptance length) of a run's counter deltas; zeros without drafts."""
    if not s["drafts"]:
        return 0.0, 0.0
    return s["accepted"] / s["draft_tokens"], 1 + s["accepted"] / s["drafts"]


def single_stream(args: argparse.Namespace, llms: dict[str, LLM]) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tok = llms["off"].tokenizer
    code = sample_code_edit(tok, args.num_prompts, args.seed, CodeEditMix(max_len=args.code_max_len))
    chats = sample_sharegpt(tok, args.num_prompts, args.seed, max_prompt_len=512)
    workloads = {
        "code-edit": ([[{"role": "user", "content": s.prompt}] for s in code], True),
        "sharegpt": ([s.prompt for s in chats], False),
    }
    rows = []
    for name, (prompts, chat) in workloads.items():
        results = {}
        for mode, llm in llms.items():
            run_single_stream(llm, prompts[:1], params, chat)  # warm-up (kernels, allocator)
            results[mode] = measure(llm, lambda l: run_single_stream(l, prompts, params, chat))
        off = results["off"]["tpot_ms"]
        for mode in spec_modes(llms):
            s = results[mode]
            rate, length = acceptance(s)
            rows.append({
                "workload": name,
                "mode": mode,
                "tpot_off_ms": off,
                "tpot_spec_ms": s["tpot_ms"],
                "speedup": off / s["tpot_ms"] if s["tpot_ms"] else float("nan"),
                "acceptance_rate": rate,
                "mean_acceptance_length": length,
                "mean_chosen_length": chosen_length(s),
            })
    print(f"{'workload':<10} {'mode':<6} {'TPOT off ms':>12} {'TPOT spec ms':>13} {'speedup':>8} "
          f"{'accept':>7} {'mean len':>9} {'chosen':>7}")
    for r in rows:
        print(f"{r['workload']:<10} {r['mode']:<6} {r['tpot_off_ms']:>12.2f} {r['tpot_spec_ms']:>13.2f} "
              f"{r['speedup']:>7.2f}x {r['acceptance_rate']:>7.2f} {r['mean_acceptance_length']:>9.2f} "
              f"{r['mean_chosen_length']:>7.2f}")
    return rows


def saturation(args: argparse.Namespace, llms: dict[str, LLM]) -> list[dict]:
    tok = llms["off"].tokenizer
    samples = sample_sharegpt(tok, args.saturation_prompts, args.seed, max_prompt_len=1024)
    results = {}
    for mode, llm in llms.items():
        run_batch(llm, samples[: min(4, len(samples))], 16)  # warm-up
        results[mode] = measure(llm, lambda l: run_batch(l, samples, args.saturation_max_tokens))
    off = results["off"]
    rows = []
    for mode in spec_modes(llms):
        on = results[mode]
        rate, length = acceptance(on)
        rows.append({
            "workload": f"sharegpt x{len(samples)} at once",
            "mode": mode,
            "output_tok_s_off": off["output_tok_s"],
            "output_tok_s_spec": on["output_tok_s"],
            "ratio": on["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else float("nan"),
            "drafts": on["drafts"],
            "acceptance_rate": rate,
            "mean_acceptance_length": length,
            "mean_chosen_length": chosen_length(on),
        })
    print(f"{'workload':<26} {'mode':<6} {'off tok/s':>10} {'spec tok/s':>11} {'ratio':>6} {'drafts':>7} "
          f"{'accept':>7} {'mean len':>9} {'chosen':>7}")
    for r in rows:
        print(f"{r['workload']:<26} {r['mode']:<6} {r['output_tok_s_off']:>10.1f} "
              f"{r['output_tok_s_spec']:>11.1f} {r['ratio']:>5.2f}x {r['drafts']:>7} {r['acceptance_rate']:>7.2f} "
              f"{r['mean_acceptance_length']:>9.2f} {r['mean_chosen_length']:>7.2f}")
    print("target: ratio >= 0.95 (speculation must not cost throughput at saturation)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=4, help="single stream: prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96, help="single stream: tokens per request")
    ap.add_argument("--code-max-len", type=int, default=512, help="code-edit: tokens of the quoted function")
    ap.add_argument("--saturation", action="store_true", help="offline ShareGPT at saturation instead")
    ap.add_argument("--saturation-prompts", type=int, default=200)
    ap.add_argument("--saturation-max-tokens", type=int, default=None,
                    help="cap on each request's output (default: its ShareGPT reply's length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="default: 0.5 single stream, 4 at saturation")
    ap.add_argument("--slo-itl-ms", type=float, default=None,
                    help="run the slo policy with this ITL target; compare the acceptance and slack rules")
    ap.add_argument("--slo-tpot-ms", type=float, default=None,
                    help="the slack rule's TPOT target (implies the slo policy, as --slo-itl-ms)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                             prompt_lookup_min=2, prompt_lookup_max=5)
    if args.slo_itl_ms is None and args.slo_tpot_ms is None:
        modes = {"off": None, "ngram": spec}
    else:
        modes = {
            "off": None,
            "accept": replace(spec, length_rule="acceptance"),
            "slack": replace(spec, length_rule="slack", slo_tpot_ms=args.slo_tpot_ms),
        }
    llms = {mode: make_llm(args, s) for mode, s in modes.items()}
    rows = saturation(args, llms) if args.saturation else single_stream(args, llms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


def make_llm(args: argparse.Namespace, spec: SpeculativeConfig | None) -> LLM:
    """One engine of the comparison: the same settings for every mode, the `slo` policy when a latency
    target is given (the slack rule reads its step-time model)."""
    slo = args.slo_itl_ms is not None or args.slo_tpot_ms is not None
    itl = {} if args.slo_itl_ms is None else {"slo_itl_ms": args.slo_itl_ms}
    scheduler = SchedulerConfig(policy="slo", **itl) if slo else SchedulerConfig()
    kv_gb = args.kv_cache_memory_gb or (4.0 if args.saturation else 0.5)
    return LLM.from_config(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.num_threads, speculative=spec,
        cache=CacheConfig(kv_cache_memory_gb=kv_gb), scheduler=scheduler,
    ))


def spec_modes(llms: dict[str, LLM]) -> list[str]:
    return [m for m in llms if m != "off"]


def chosen_length(s: dict[str, float]) -> float:
    """Mean speculation length the rule chose (0 where it could not speculate)."""
    return s["chosen"] / s["choices"] if s["choices"] else 0.0


def _stats(llm: LLM) -> dict[str, int]:
    s = llm.engine.spec_decode_stats
    if s is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "choices": 0, "chosen": 0}
    return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "choices": s.num_length_choices, "chosen": s.num_chosen_tokens}


if __name__ == "__main__":
    main()
