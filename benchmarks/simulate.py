"""The simulator against real runs: fit the step-time model on one recorded run, replay other runs' workloads
through the real scheduler on simulated time, and compare with what those runs measured.

    .venv/bin/python benchmarks/offline_throughput.py --hf-num-prompts 0 --skip-phases --out results/A.json
    .venv/bin/python benchmarks/offline_throughput.py --hf-num-prompts 0 --skip-phases \\
        --max-num-batched-tokens 256 --out results/B.json
    .venv/bin/python benchmarks/simulate.py --calibrate results/A.json --predict results/A.json,results/B.json
    .venv/bin/python benchmarks/simulate.py --calibrate results/A.json --plan --rate 4 --slo ttft=2000,tpot=100 \
        [--budgets 256,512,1024,2048] [--max-seqs 16,32,64,128,256]
    .venv/bin/python benchmarks/simulate.py --calibrate results/A.json --replay-bench results/bench.json \
        --max-num-seqs 16 --max-num-batched-tokens 2048 --slo ttft=2000,tpot=100
    .venv/bin/python benchmarks/simulate.py --calibrate results/A.json --plan-split 4 --rate 12 \
        --slo ttft=1000,tpot=50 [--link-gbps 10] [--link-latency-ms 0.5]

Each recorded run (`offline_throughput.py`'s JSON) carries its steps (seconds and shape), its workload
(each request's prompt and output tokens), its scheduler settings and its cache's geometry, so a
prediction replays exactly that workload under exactly those settings (`pdserve.sim.simulator`). Printed
per run: measured and simulated seconds and steps, the error, and the fitted coefficients.

`--replay-bench` replays a serving run that `pdserve bench --out` recorded (each request's lengths and
arrival time) under the scheduler settings given (those of the server it measured), and prints its
latencies and goodput beside the simulated ones.

`--plan-split N` compares N colocated instances with every prefill / decode split of N (xPyD,
`pdserve.sim.simulator.simulate_cluster`; the KV of each prompt crossing a link of `--link-gbps`, sent layer by layer while
the prompt computes, as pdserve's connector does), each instance with the calibration run's settings and
step-time model, the workload arriving at `--rate`.

`--plan` replays the calibration run's workload arriving as a Poisson process (`--rate`, seeded) under
every token budget x most-sequences candidate (`pdserve.sim.planner`), and ranks them by goodput under
`--slo`, judged as `pdserve bench serve --slo` judges a real run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from pdserve.bench.metrics import BenchMetrics, RequestRecord, compute_metrics, parse_slo
from pdserve.config import SchedulerConfig
from pdserve.scheduler.step_model import TERMS, StepTimeModel
from pdserve.sim.planner import plan, plan_split, poisson_arrivals
from pdserve.sim.simulator import LinkModel, SimConfig, SimRequest, StepSample, fit_step_model, simulate


def load(path: str) -> dict:
    with open(path) as f:
        run = json.load(f)["pdserve"]
    for key in ("steps", "workload", "scheduler", "num_blocks", "block_size"):
        if key not in run:
            raise SystemExit(f"{path}: no '{key}' (record it again with the current offline_throughput.py)")
    return run


def samples(path: str) -> list[StepSample]:
    """A recorded run's steps, or a served run's (`pdserve serve --step-log`: a .jsonl file of rows).
    Rows: seconds, forward seconds, prompt tokens, decode tokens, sequences, context tokens."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = load(path)["steps"]
    return [StepSample(r[0], r[2], r[3], r[5]) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", required=True,
                    help="recorded runs (offline_throughput.py JSON, or `pdserve serve --step-log` .jsonl) whose steps "
                         "fit the model, comma-separated")
    ap.add_argument("--workload-from", default=None,
                    help="a recorded offline run whose workload, settings and cache --plan and --replay-bench use "
                         "(default: the first --calibrate run)")
    ap.add_argument("--predict", default=None, help="recorded runs to replay and compare (comma-separated)")
    ap.add_argument("--plan", action="store_true", help="rank scheduler settings for --rate and --slo")
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson) for --plan")
    ap.add_argument("--slo", default=None, help="ttft=MS,tpot=MS,itl=MS for --plan")
    ap.add_argument("--budgets", default="256,512,1024,2048", help="token budgets per step for --plan")
    ap.add_argument("--max-seqs", default="16,32,64,128,256", help="most sequences per step for --plan")
    ap.add_argument("--plan-split", type=int, default=0, help="N: N colocated instances against every xPyD split")
    ap.add_argument("--link-gbps", type=float, default=10.0, help="KV link bandwidth for --plan-split (GB/s)")
    ap.add_argument("--link-latency-ms", type=float, default=0.5, help="KV link latency for --plan-split")
    ap.add_argument("--replay-bench", default=None, help="a `pdserve bench --out` JSON to replay and compare")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="for --replay-bench (default: the calibration run's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="for --replay-bench (likewise)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/simulate.json")
    args = ap.parse_args()
    if not (args.predict or args.plan or args.replay_bench or args.plan_split):
        ap.error("give --predict runs, --plan, --plan-split or --replay-bench")

    steps = [s for path in args.calibrate.split(",") for s in samples(path)]
    model = fit_step_model(steps)
    coef = ", ".join(f"{t} {c * 1e3:.4g} ms" for t, c in zip(TERMS, model.coefficients))
    print(f"step-time model from {len(steps)} steps of {args.calibrate}: {coef}")
    fitted = [model.predict(s.prefill_tokens, s.decode_seqs, s.context_tokens) for s in steps]
    print(f"  in-sample: sum of steps {sum(s.duration for s in steps):.1f} s measured, {sum(fitted):.1f} s fitted")
    rows = []
    if args.predict:
        print(f"{'run':40s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s} {'steps':>6s} {'sim steps':>9s}")
    for path in args.predict.split(",") if args.predict else []:
        run = load(path)
        sched = scheduler_of(run)
        workload = [SimRequest(p, o) for p, o in run["workload"]]
        sim = simulate(workload, model, SimConfig(sched, run["num_blocks"], run["block_size"]))
        measured = sum(r[0] for r in run["steps"])
        err = sim.elapsed / measured - 1
        rows.append({"run": path, "measured_s": measured, "elapsed_s": run["elapsed_s"], "simulated_s": sim.elapsed,
                     "error": err, "steps": len(run["steps"]), "simulated_steps": len(sim.steps),
                     "preemptions": run.get("preemptions"), "simulated_preemptions": sim.num_preemptions})
        print(f"{path:40s} {measured:10.1f} {sim.elapsed:11.1f} {err:+7.1%} {len(run['steps']):6d} {len(sim.steps):9d}")
    replayed = replay_bench(args, model) if args.replay_bench else None
    planned = plan_table(args, model) if args.plan else None
    split = split_table(args, model) if args.plan_split else None
    with open(args.out, "w") as f:
        json.dump({"calibrate": args.calibrate, "coefficients": dict(zip(TERMS, model.coefficients)), "runs": rows,
                   "replay": replayed, "plan": planned, "split": split}, f, indent=1)
    print(f"wrote {args.out}")


def scheduler_of(run: dict) -> SchedulerConfig:
    return SchedulerConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in run["scheduler"].items()})


def reference_run(args: argparse.Namespace) -> dict:
    return load(args.workload_from or args.calibrate.split(",")[0])


def replay_bench(args: argparse.Namespace, model: StepTimeModel) -> dict:
    run = reference_run(args)
    with open(args.replay_bench) as f:
        recorded = [RequestRecord(**{**r, "slo": None}) for r in json.load(f)["records"]]
    recorded = [r for r in recorded if r.success]
    start = min(r.arrival_time for r in recorded)
    workload = [SimRequest(r.prompt_len, r.output_len, r.arrival_time - start) for r in recorded]
    sched = scheduler_of(run)
    changes = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    sched = dataclasses.replace(sched, **{k: v for k, v in changes.items() if v is not None})
    slo = parse_slo(args.slo) if args.slo else None
    sim = simulate(workload, model, SimConfig(sched, run["num_blocks"], run["block_size"]))
    measured = compute_metrics(recorded, max(r.end_time for r in recorded) - start, slo)
    simulated = compute_metrics(sim.records([r.prompt_len for r in recorded]), sim.elapsed, slo)
    print(f"\nreplay of {args.replay_bench} ({len(workload)} requests; max_num_seqs {sched.max_num_seqs}, "
          f"budget {sched.max_num_batched_tokens}):")
    print(f"{'':10s} {'goodput':>8s} {'req/s':>6s} {'TTFT p50':>9s} {'p90':>7s} {'p99':>7s} {'TPOT p50':>9s} "
          f"{'p99':>6s} {'ITL p50':>8s} {'p99':>6s}")
    out = {}
    for name, m in (("measured", measured), ("simulated", simulated)):
        print(f"{name:10s} {m.goodput or 0:8.2f} {m.request_throughput:6.2f} {m.ttft.median:9.0f} {m.ttft.p90:7.0f} "
              f"{m.ttft.p99:7.0f} {m.tpot.median:9.1f} {m.tpot.p99:6.1f} {m.itl.median:8.1f} {m.itl.p99:6.1f}")
        out[name] = {"goodput": m.goodput, "requests_per_s": m.request_throughput, "ttft_ms": dataclasses.asdict(m.ttft),
                     "tpot_ms": dataclasses.asdict(m.tpot), "itl_ms": dataclasses.asdict(m.itl)}
    return out


def plan_table(args: argparse.Namespace, model: StepTimeModel) -> list[dict]:
    run = reference_run(args)
    sched = scheduler_of(run)
    workload = poisson_arrivals([(p, o) for p, o in run["workload"]], args.rate, args.seed)
    slo = parse_slo(args.slo) if args.slo else None
    rows = plan(workload, model, SimConfig(sched, run["num_blocks"], run["block_size"]),
                budgets=[int(b) for b in args.budgets.split(",")], max_seqs=[int(m) for m in args.max_seqs.split(",")],
                slo=slo)
    print(f"\nplan: {len(workload)} requests at {args.rate} req/s, SLO {args.slo}, best first")
    print(f"{'budget':>6s} {'seqs':>5s} {HEADER}")
    out = []
    for r in rows:
        print(f"{r.max_num_batched_tokens:6d} {r.max_num_seqs:5d} {columns(r.metrics, r.num_preemptions)}")
        out.append({"max_num_batched_tokens": r.max_num_batched_tokens, "max_num_seqs": r.max_num_seqs,
                    **summary(r.metrics, r.num_preemptions)})
    return out


HEADER = f"{'goodput':>8s} {'req/s':>6s} {'TTFT p50':>9s} {'p99':>8s} {'TPOT p50':>9s} {'p99':>7s} {'ITL p99':>8s} {'preempt':>7s}"


def columns(m: BenchMetrics, preemptions: int) -> str:
    """One row of a plan's table, under HEADER."""
    return (f"{m.goodput or 0:8.2f} {m.request_throughput:6.2f} {m.ttft.median:9.0f} {m.ttft.p99:8.0f} "
            f"{m.tpot.median:9.1f} {m.tpot.p99:7.1f} {m.itl.p99:8.1f} {preemptions:7d}")


def summary(m: BenchMetrics, preemptions: int) -> dict:
    return {"goodput": m.goodput, "requests_per_s": m.request_throughput, "ttft_ms": dataclasses.asdict(m.ttft),
            "tpot_ms": dataclasses.asdict(m.tpot), "itl_ms": dataclasses.asdict(m.itl), "preemptions": preemptions}


def split_table(args: argparse.Namespace, model: StepTimeModel) -> list[dict]:
    run = reference_run(args)
    if "kv_bytes_per_token" not in run:
        raise SystemExit("the reference run has no kv_bytes_per_token: record it with the current offline_throughput.py")
    link = LinkModel(run["kv_bytes_per_token"], args.link_gbps * 1e9, args.link_latency_ms / 1e3, run["num_layers"])
    workload = poisson_arrivals([(p, o) for p, o in run["workload"]], args.rate, args.seed)
    slo = parse_slo(args.slo) if args.slo else None
    rows = plan_split(workload, model, SimConfig(scheduler_of(run), run["num_blocks"], run["block_size"]),
                      num_instances=args.plan_split, link=link, slo=slo)
    print(f"\nsplit: {len(workload)} requests at {args.rate} req/s over {args.plan_split} instances, SLO {args.slo}, "
          f"KV {run['kv_bytes_per_token']} B/token over {args.link_gbps} GB/s, best first")
    print(f"{'cluster':>12s} {HEADER}")
    out = []
    for r in rows:
        print(f"{r.name:>12s} {columns(r.metrics, r.num_preemptions)}")
        out.append({"cluster": r.name, **summary(r.metrics, r.num_preemptions)})
    return out


if __name__ == "__main__":
    main()
