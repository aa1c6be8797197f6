"""The simulator against real runs: fit the step-time model on one recorded run, replay other runs' workloads
through the real scheduler on simulated time, and compare with what those runs measured.

    .venv/bin/python benchmarks/offline_throughput.py --hf-num-prompts 0 --skip-phases --out results/A.json
    .venv/bin/python benchmarks/offline_throughput.py --hf-num-prompts 0 --skip-phases \\
        --max-num-batched-tokens 256 --out results/B.json
    .venv/bin/python benchmarks/simulate.py --calibrate results/A.json --predict results/A.json,results/B.json

Each recorded run (`offline_throughput.py`'s JSON) carries its steps (seconds and shape), its workload
(each request's prompt and output tokens), its scheduler settings and its cache's geometry, so a
prediction replays exactly that workload under exactly those settings (`pdserve.sim.simulator`). Printed
per run: measured and simulated seconds and steps, the error, and the fitted coefficients.
"""

from __future__ import annotations

import argparse
import json

from pdserve.config import SchedulerConfig
from pdserve.sim.simulator import SimConfig, SimRequest, StepSample, fit_step_model, simulate
from pdserve.scheduler.step_model import TERMS


def load(path: str) -> dict:
    with open(path) as f:
        run = json.load(f)["pdserve"]
    for key in ("steps", "workload", "scheduler", "num_blocks", "block_size"):
        if key not in run:
            raise SystemExit(f"{path}: no '{key}' (record it again with the current offline_throughput.py)")
    return run


def samples(run: dict) -> list[StepSample]:
    # rows: seconds, forward seconds, prompt tokens, decode tokens, sequences, context tokens
    return [StepSample(r[0], r[2], r[3], r[5]) for r in run["steps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", required=True, help="recorded runs whose steps fit the model (comma-separated)")
    ap.add_argument("--predict", required=True, help="recorded runs to replay and compare (comma-separated)")
    ap.add_argument("--out", default="results/simulate.json")
    args = ap.parse_args()

    steps = [s for path in args.calibrate.split(",") for s in samples(load(path))]
    model = fit_step_model(steps)
    coef = ", ".join(f"{t} {c * 1e3:.4g} ms" for t, c in zip(TERMS, model.coefficients))
    print(f"step-time model from {len(steps)} steps of {args.calibrate}: {coef}")
    fitted = [model.predict(s.prefill_tokens, s.decode_seqs, s.context_tokens) for s in steps]
    print(f"  in-sample: sum of steps {sum(s.duration for s in steps):.1f} s measured, {sum(fitted):.1f} s fitted")
    rows = []
    print(f"{'run':40s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s} {'steps':>6s} {'sim steps':>9s}")
    for path in args.predict.split(","):
        run = load(path)
        sched = SchedulerConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in run["scheduler"].items()})
        workload = [SimRequest(p, o) for p, o in run["workload"]]
        sim = simulate(workload, model, SimConfig(sched, run["num_blocks"], run["block_size"]))
        measured = sum(r[0] for r in run["steps"])
        err = sim.elapsed / measured - 1
        rows.append({"run": path, "measured_s": measured, "elapsed_s": run["elapsed_s"], "simulated_s": sim.elapsed,
                     "error": err, "steps": len(run["steps"]), "simulated_steps": len(sim.steps),
                     "preemptions": run.get("preemptions"), "simulated_preemptions": sim.num_preemptions})
        print(f"{path:40s} {measured:10.1f} {sim.elapsed:11.1f} {err:+7.1%} {len(run['steps']):6d} {len(sim.steps):9d}")
    with open(args.out, "w") as f:
        json.dump({"calibrate": args.calibrate, "coefficients": dict(zip(TERMS, model.coefficients)), "runs": rows}, f,
                  indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
