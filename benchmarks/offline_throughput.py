"""Offline throughput on ShareGPT, side by side with transformers, plus per-phase figures.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 200] [--hf-num-prompts 32]

1. pdserve on N ShareGPT requests (seed 0, output lengths from the dataset, ignore_eos, temperature 1.0
   and top_p 1.0 as vLLM's `bench throughput` samples; `--temperature 0`: greedy): requests/s, total and
   output tokens/s (the workload vLLM's `bench throughput` runs).
2. The same first `--hf-num-prompts` requests through transformers `generate` (batched, left-padded)
   and through pdserve, both greedy, in this run, as a ratio.
3. Prefill and decode tokens/s at batch 1, 8, 32, 64 with the fraction of this machine's measured
   roof: matmul FLOP/s for prefill, memory bandwidth for decode at batch 1.
Prints the bf16 linear kernel table in use (`--linear-kernel auto`: measured per row count on this host,
or read from its cache), tables, and writes JSON (`--out`) naming the host (CPU, flags, threads, torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.datasets import SampleRequest, sample_sharegpt
from pdserve.bench.machine import cpu_flags, cpu_name, measure_machine


def run_pdserve(llm: LLM, reqs: list[SampleRequest], temperature: float = 1.0) -> dict:
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()  # a fair run never reuses an earlier run's prompts
    n0 = len(eng.step_records)
    params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = list(eng.step_records)[n0:]
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    prefill_time = sum(s.duration for s in steps if s.num_prefill_tokens)
    return {
        "num_requests": len(reqs),
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "num_steps": len(steps),
        "time_in_steps_with_prefill_s": prefill_time,
        "time_in_decode_only_steps_s": sum(s.duration for s in steps) - prefill_time,
        "preemptions": eng.scheduler.num_preemptions,
        # one row per step: seconds, forward seconds, prompt tokens, decode tokens, sequences, context tokens
        "steps": [[round(s.duration, 5), round(s.forward_time, 5), s.num_prefill_tokens, s.num_decode_tokens,
                   s.num_seqs, s.num_context_tokens] for s in steps],
        # what benchmarks/simulate.py replays: each request's prompt and output tokens, the cache's geometry
        "workload": [[len(o.prompt_token_ids), len(o.outputs[0].token_ids)] for o in outs],
        "scheduler": dataclasses.asdict(eng.scheduler.config),
        "num_blocks": eng.block_manager.num_blocks,
        "kv_bytes_per_token": eng.kv_cache.layout.bytes_per_token,
        "num_layers": eng.kv_cache.layout.num_layers,
        "block_size": eng.block_manager.block_size,
    }


def run_transformers(path: str, reqs: list[SampleRequest], tokenizer, batch_size: int, dtype: torch.dtype) -> dict:  # type: ignore[no-untyped-def]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
    ).eval()
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        ids = [tokenizer.encode(r.prompt) for r in batch]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        max_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=0)
        n_out += sum(r.output_len for r in batch)  # useful tokens only; padding rows' extra tokens don't count
    elapsed = time.perf_counter() - t0
    n_in = sum(r.prompt_len for r in reqs)
    return {
        "num_requests": len(reqs),
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
    }


def phase_figures(llm: LLM, limits, batches: list[int], prompt_len: int, decode_steps: int) -> list[dict]:  # type: ignore[no-untyped-def]
    eng = llm.engine
    cfg = eng.model_config
    layer_params = sum(p.numel() for p in eng.model.layers.parameters())
    head_params = cfg.vocab_size * cfg.hidden_size
    bytes_per_param = torch.empty((), dtype=eng.dtype).element_size()
    weight_bytes = (layer_params + head_params) * bytes_per_param
    peak = limits.matmul_flops[str(eng.dtype).removeprefix("torch.")]
    rng = random.Random(0)
    rows = []
    for b in batches:
        eng.block_manager.reset_prefix_cache()
        prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(b)]
        for p in prompts:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.scheduler.waiting or any(r.is_prefill for r in eng.scheduler.running):
            eng.step()
        t1 = time.perf_counter()
        eng.step()  # warm the decode shape
        t2 = time.perf_counter()
        n = 0
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        t3 = time.perf_counter()
        prefill_tps = b * prompt_len / (t1 - t0)
        decode_tps = b * n / (t3 - t2)
        # Linear layers: 2 FLOPs per weight per token; the LM head only for the sampled rows.
        prefill_flops = prefill_tps * 2 * layer_params + (b / (t1 - t0)) * 2 * head_params
        ctx = prompt_len + decode_steps / 2
        kv_bytes = b * ctx * cfg.kv_bytes_per_token * bytes_per_param / 2
        decode_bw = (weight_bytes + kv_bytes) * (n / (t3 - t2))
        rows.append({
            "batch": b,
            "prefill_tokens_per_s": prefill_tps,
            "prefill_fraction_of_matmul_roof": prefill_flops / peak,
            "decode_tokens_per_s": decode_tps,
            "decode_step_ms": 1e3 * (t3 - t2) / max(n, 1),
            "decode_fraction_of_bandwidth_roof": decode_bw / limits.memory_bandwidth,
            "decode_fraction_of_matmul_roof": decode_tps * 2 * (layer_params + head_params) / peak,
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-num-prompts", type=int, default=32, help="0 skips the transformers comparison")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--scheduler", default="chunked")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=3.0)
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | int8 | fp8_e4m3")
    ap.add_argument("--phase-batches", default="1,8,32,64")
    ap.add_argument("--phase-prompt-len", type=int, default=256)
    ap.add_argument("--skip-phases", action="store_true")
    ap.add_argument("--no-fused-ops", action="store_true", help="plain torch elementwise ops (A/B of model/ops.py)")
    ap.add_argument("--linear-kernel", default="auto", help="auto | pdserve | onednn | fp32 | torch (A/B of model/linear.py)")
    ap.add_argument("--batch-invariant", action="store_true", help="one row-independent kernel for all row counts")
    ap.add_argument("--kernel-cache-dir", default=None, help="measured kernel choices (default ~/.cache/pdserve; '' none)")
    ap.add_argument("--weight-dtype", default="auto", help="auto | bfloat16 | int8 (8-bit projections and head)")
    ap.add_argument("--speculative-config", default=None, help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="1.0 (with top_p 1.0) is what vLLM's `bench throughput` samples with; 0: greedy")
    ap.add_argument("--out", default="results/offline_throughput.json")
    args = ap.parse_args()

    llm = LLM(model=args.model, dtype=args.dtype, scheduler=args.scheduler, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
              kv_cache_dtype=args.kv_cache_dtype, fused_cpu_ops=not args.no_fused_ops, linear_kernel=args.linear_kernel,
              batch_invariant=args.batch_invariant, kernel_cache_dir=args.kernel_cache_dir,
              weight_dtype=args.weight_dtype,
              **({"block_size": args.block_size} if args.block_size else {}),
              speculative_config=json.loads(args.speculative_config) if args.speculative_config else None)
    plan = llm.engine.model.linear_plan
    print(plan.describe() if plan is not None else "bf16 linear kernels: none packed (plain F.linear)")
    tok = llm.engine.tokenizer
    reqs = sample_sharegpt(tok, args.num_prompts, seed=args.seed)
    llm.generate([r.prompt for r in reqs[:8]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    result: dict = {
        "machine": {"cpu": cpu_name(), "flags": [f for f, on in cpu_flags().items() if on],
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "linear_kernels": None if plan is None else {
            "kind": plan.kind, "cache": plan.cache, "cache_hit": plan.cache_hit,
            "table": None if plan.table is None else plan.table.to_json(),
        },
        "config": vars(args),
    }
    print(f"ShareGPT: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} input / "
          f"{sum(r.output_len for r in reqs)} output tokens (seed {args.seed}, ignore_eos, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'})")
    full = run_pdserve(llm, reqs, args.temperature)
    result["pdserve"] = full
    print(f"pdserve      : {full['requests_per_s']:.2f} req/s, {full['total_tokens_per_s']:.0f} total tok/s, "
          f"{full['output_tokens_per_s']:.0f} output tok/s ({full['elapsed_s']:.1f} s, {full['num_steps']} steps, "
          f"{full['preemptions']} preemptions)")

    if args.hf_num_prompts:
        sub = reqs[: args.hf_num_prompts]
        ours = run_pdserve(llm, sub, 0.0)  # transformers' generate runs greedy
        hf = run_transformers(llm.engine.model_name, sub, tok, args.hf_batch_size, llm.engine.dtype)
        result["subset"] = {"pdserve": ours, "transformers": hf,
                            "ratio_output_tokens_per_s": ours["output_tokens_per_s"] / hf["output_tokens_per_s"]}
        print(f"first {len(sub)} requests, same run:")
        print(f"  pdserve      : {ours['requests_per_s']:.2f} req/s, {ours['output_tokens_per_s']:.0f} output tok/s")
        print(f"  transformers : {hf['requests_per_s']:.2f} req/s, {hf['output_tokens_per_s']:.0f} output tok/s "
              f"(generate, batch {args.hf_batch_size})")
        print(f"  ratio        : {result['subset']['ratio_output_tokens_per_s']:.2f}x")

    if not args.skip_phases:
        limits = measure_machine()
        result["machine"]["limits"] = {"matmul_flops": limits.matmul_flops, "memory_bandwidth": limits.memory_bandwidth}
        peak = limits.matmul_flops[str(llm.engine.dtype).removeprefix("torch.")]
        print(f"machine roof: matmul {peak / 1e9:.0f} GFLOP/s ({llm.engine.dtype}), memory {limits.memory_bandwidth / 1e9:.0f} GB/s")
        rows = phase_figures(llm, limits, [int(b) for b in args.phase_batches.split(",")], args.phase_prompt_len, 32)
        result["phases"] = rows
        print(f"{'batch':>5} | {'prefill tok/s':>13} {'% matmul roof':>13} | {'decode tok/s':>12} {'step ms':>8} "
              f"{'% BW roof':>9} {'% matmul roof':>13}")
        for r in rows:
            print(f"{r['batch']:>5} | {r['prefill_tokens_per_s']:>13.0f} {100 * r['prefill_fraction_of_matmul_roof']:>12.0f}% | "
                  f"{r['decode_tokens_per_s']:>12.0f} {r['decode_step_ms']:>8.1f} {100 * r['decode_fraction_of_bandwidth_roof']:>8.0f}% "
                  f"{100 * r['decode_fraction_of_matmul_roof']:>12.0f}%")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
