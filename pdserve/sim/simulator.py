"""A workload through the real scheduler and engine loop on simulated time: the step-time model decides how
long each step takes, nothing runs a model.

    model = fit_step_model(steps)                      # StepSample rows recorded by a real run
    result = simulate(workload, model, SimConfig(...))   # the same scheduler code, a fake executor, a manual clock

What is simulated is exactly what the scheduler does (`Scheduler`, its policy, the block manager, preemption,
chunking, the engine loop's bookkeeping): only the step's duration is a model, the same four-term linear one
the `slo` policy fits online (`pdserve.scheduler.step_model`), fitted here in one batch. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import RequestRecord
from pdserve.config import SchedulerConfig
from pdserve.engine.loop import EngineLoop
from pdserve.kv.block_manager import BlockManager
from pdserve.request import SamplingParams
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.fake_executor import FakeExecutor, ManualClock


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: seconds and its shape, as `EngineLoop.step_records` and the offline benchmark's
    `steps` rows record it (context tokens: each request's tokens computed once the step has run, its own
    new ones included, summed over the step's requests; the `slo` policy's convention)."""

    duration: float
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int


@dataclass(frozen=True, slots=True)
class SimRequest:
    prompt_len: int
    output_len: int
    arrival: float = 0.0  # seconds from the start of the run


@dataclass(frozen=True, slots=True)
class SimConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int = 4096
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class SimRequestResult:
    arrival: float
    first_token: float  # seconds, simulated clock
    finished: float
    output_len: int
    token_times: list[float]  # when each step that gave it tokens ended (one entry per step)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first (0 for a single-token output)."""
        return (self.finished - self.first_token) / max(1, self.output_len - 1)


@dataclass(frozen=True, slots=True)
class SimResult:
    elapsed: float  # seconds from the first arrival to the last token
    steps: list[StepSample]
    requests: list[SimRequestResult]
    num_preemptions: int

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.elapsed if self.elapsed > 0 else math.inf

    def records(self, prompt_lens: Sequence[int]) -> list[RequestRecord]:
        """The requests as the benchmark client records them (sent at arrival, one "chunk" per step that
        gave tokens), so `pdserve.bench.metrics` computes TTFT, TPOT, ITL and goodput as for a real run."""
        return [
            RequestRecord(
                i, prompt_lens[i], r.output_len, r.arrival, send_time=r.arrival, token_times=list(r.token_times),
                end_time=r.finished, output_len=r.output_len, usage_reported=True, success=True,
            )
            for i, r in enumerate(self.requests)
        ]


def fit_step_model(steps: Sequence[StepSample]) -> StepTimeModel:
    """The step-time model least-squares fitted on `steps` (every step weighted alike, non-negative
    coefficients; a negligible prior only keeps features that never vary determined)."""
    model = StepTimeModel(prior_weight=1e-6, forgetting=1.0, refit_interval=max(1, len(steps)))
    for s in steps:
        model.observe(s.duration, s.prefill_tokens, s.decode_seqs, s.context_tokens)
    model.refit()
    return model


def step_shape(out: SchedulerOutput) -> tuple[int, int, int]:
    """(prefill tokens, decode sequences, context tokens) of a scheduled step, as `EngineLoop` records
    them (it reads the context after the step: what each request had computed plus this step's tokens)."""
    context = sum(s.req.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
    return out.num_prefill_tokens, out.num_decode_tokens, context


def simulate(workload: Sequence[SimRequest], model: StepTimeModel, config: SimConfig = SimConfig()) -> SimResult:
    """Run `workload` (greedy, ignore_eos, each request its own output length) through the scheduler with
    `config`, each step taking what `model` predicts for its shape."""
    clock = ManualClock()
    sched_cfg = config.scheduler
    # No prefix caching: the synthetic prompts share no text (each starts with its own token).
    bm = BlockManager(config.num_blocks, config.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(sched_cfg, bm, make_policy(sched_cfg.policy, sched_cfg, clock=clock), clock=clock)

    def step_time(out: SchedulerOutput) -> float:
        return model.predict(*step_shape(out))

    executor = FakeExecutor(bm, sample=lambda req: 1, clock=clock, step_time=step_time, check_kv=False)
    vocab = len(workload) + 2
    loop = EngineLoop(scheduler, executor, vocab_size=vocab, max_model_len=sched_cfg.max_model_len)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    ids: dict[str, int] = {}
    times: dict[int, list[float]] = {i: [] for i in range(len(workload))}
    done: dict[int, float] = {}
    steps: list[StepSample] = []
    nxt = 0
    start = workload[order[0]].arrival if workload else 0.0
    clock.now = start
    while len(done) < len(workload):
        while nxt < len(order) and workload[order[nxt]].arrival <= clock.now:
            i = order[nxt]
            r = workload[i]
            prompt = [i + 2] + [1] * (r.prompt_len - 1)
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            ids[loop.add_request(prompt, params, arrival_time=r.arrival)] = i
            nxt += 1
        if not loop.has_unfinished_requests():
            clock.now = workload[order[nxt]].arrival  # idle until the next arrival
            continue
        ran = executor.num_steps
        outputs = loop.step()
        if executor.num_steps == ran:  # nothing could be scheduled: only an arrival can change that
            if nxt == len(order):
                raise RuntimeError("the scheduler makes no progress on this workload (KV blocks too few?)")
            clock.now = max(clock.now, workload[order[nxt]].arrival)
            continue
        rec = loop.step_records[-1]
        steps.append(StepSample(rec.duration, rec.num_prefill_tokens, rec.num_decode_tokens, rec.num_context_tokens))
        for o in outputs:
            i = ids[o.request_id]
            if o.outputs[0].new_token_ids:
                times[i].append(clock.now)
            if o.finished:
                if o.error is not None:
                    raise RuntimeError(f"simulated request {i} failed: {o.error}")
                done[i] = clock.now
    results = [
        SimRequestResult(w.arrival, times[i][0], done[i], w.output_len, times[i]) for i, w in enumerate(workload)
    ]
    return SimResult(clock.now - start, steps, results, scheduler.num_preemptions)
