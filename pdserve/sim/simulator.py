"""Workloads through the real scheduler and engine loop on simulated time: a step-time model decides how long
each step takes, nothing runs a model.

    model = fit_step_model(steps)                        # StepSample rows recorded by a real run
    result = simulate(workload, model, SimConfig(...))   # one instance
    result = simulate_cluster(workload, model, ClusterConfig(2, 2, prefill, decode, LinkModel(...)))  # 2P2D

What is simulated is exactly what the scheduler does (`Scheduler`, its policy, the block manager, preemption,
chunking, the engine loop's bookkeeping): only the step's duration is a model, the same four-term linear one
the `slo` policy fits online (`pdserve.scheduler.step_model`), fitted here in one batch.

Each instance is the real `EngineLoop` over a `FakeExecutor` (slot checks off, scripted tokens). Several run
on one clock: colocated ones behind a least-loaded router, or prefill and decode instances (xPyD), where a
disaggregated instance gets a `SimConnector` in place of the `KVConnector`, so the loop runs its real
transfer paths (blocks reserved on the decode side first, the prefill side holding its blocks until the KV
is delivered, the first token arriving with it). The link (`LinkModel`): a prompt's KV is
`kv_bytes_per_token` per token; it takes `latency_s` plus its bytes over `bandwidth` (bytes/s), and with
`overlap` (pdserve's layer-by-layer sending) only what the prompt's compute did not already hide, at least
one layer's share, comes after the step that finishes the prompt. The driver starts, each time, whatever
happens first: an arrival, or the step of the instance that can start one earliest. A request's tokens
are seen where it decodes (TTFT: when its first token reaches the decode instance). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import RequestRecord
from pdserve.config import SchedulerConfig
from pdserve.engine.loop import EngineLoop
from pdserve.kv.block_manager import BlockManager
from pdserve.outputs import RequestOutput
from pdserve.request import Request, SamplingParams
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.fake_executor import FakeExecutor, ManualClock
from pdserve.transfer.types import KVDone, RemoteDecode, RemotePrefill, TransferEvents


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
    `config`, each step taking what `model` predicts for its shape: one colocated instance of
    `simulate_cluster` (one driver for every shape of cluster)."""
    return simulate_cluster(workload, model, ClusterConfig(1, 0, config))


# ---- clusters: colocated instances behind a router, or xPyD over a modelled KV link -------------------------

@dataclass(frozen=True, slots=True)
class LinkModel:
    kv_bytes_per_token: int  # K and V of every layer (2 x layers x kv heads x head_dim x element size)
    bandwidth: float  # bytes per second
    latency_s: float = 0.0
    num_layers: int = 1  # the share of a prompt's KV that is always sent after its last step (with overlap)
    overlap: bool = True  # sent layer by layer while the prompt computes (pdserve's connector)

    def tail(self, num_tokens: int, compute_s: float) -> float:
        """Seconds from the end of the prompt's last step to its KV's delivery."""
        transfer = num_tokens * self.kv_bytes_per_token / self.bandwidth
        if self.overlap:
            transfer = max(transfer - compute_s, transfer / self.num_layers)
        return self.latency_s + transfer


@dataclass(slots=True)
class _Transfer:
    num_tokens: int
    first_start: float | None = None  # the start of the first step that computed some of the prompt
    done_at: float | None = None  # when the KV and the first token reach the decode side
    first_token: int = 0
    delivered_at: float | None = None  # when the decode side took it (the sender's ack)


@dataclass(slots=True)
class SimConnector:
    """The `KVConnector` calls the engine loop makes, over a shared table of modelled transfers."""

    link: LinkModel
    clock: ManualClock
    transfers: dict[str, _Transfer]  # by transfer id, shared by every instance of the cluster
    _sends: dict[str, tuple[Request, str]] = field(default_factory=dict)  # req_id -> (request, transfer id)
    _receives: dict[str, tuple[Request, str]] = field(default_factory=dict)

    def start_send(self, req: Request, spec: RemoteDecode) -> None:
        self.transfers.setdefault(spec.transfer_id, _Transfer(req.num_prompt_tokens - spec.skip_tokens))
        self._sends[req.req_id] = (req, spec.transfer_id)

    def layer_hook(self, steps: list[tuple[Request, int]]) -> Callable[[int], None] | None:
        now = self.clock()
        for req, _ in steps:
            sent = self._sends.get(req.req_id)
            if sent is not None and self.transfers[sent[1]].first_start is None:
                self.transfers[sent[1]].first_start = now
        return None

    def finish_send(self, req: Request) -> bool:
        sent = self._sends.get(req.req_id)
        if sent is None:
            return False
        t = self.transfers[sent[1]]
        now = self.clock()
        t.first_token = req.output_token_ids[-1]
        t.done_at = now + self.link.tail(t.num_tokens, now - (t.first_start if t.first_start is not None else now))
        return True

    def start_receive(self, req: Request, spec: RemotePrefill) -> None:
        self.transfers.setdefault(spec.transfer_id, _Transfer(req.num_prompt_tokens))  # (its blocks are reserved)
        self._receives[req.req_id] = (req, spec.transfer_id)

    def poll(self) -> TransferEvents:
        now = self.clock()
        ev = TransferEvents()
        for req_id, (req, tid) in list(self._receives.items()):
            t = self.transfers[tid]
            if t.done_at is not None and t.done_at <= now:
                t.delivered_at = now
                ev.received.append((req, KVDone(tid, t.first_token, None)))
                del self._receives[req_id]
        for req_id, (req, tid) in list(self._sends.items()):
            t = self.transfers[tid]
            if t.delivered_at is not None and t.delivered_at <= now:
                ev.sent.append((req, True, None))
                del self._sends[req_id]
        return ev

    def next_event(self) -> float:
        """The earliest time a poll here would find something (inf: not known yet)."""
        times = [self.transfers[tid].done_at for _, tid in self._receives.values()]
        times += [self.transfers[tid].delivered_at for _, tid in self._sends.values()]
        return min((t for t in times if t is not None), default=math.inf)

    def cancel(self, req_id: str) -> None:
        self._sends.pop(req_id, None)
        self._receives.pop(req_id, None)

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """`num_decode` 0: `num_prefill` colocated instances ("both"); else xPyD over `link`."""

    num_prefill: int
    num_decode: int = 0
    prefill: SimConfig = field(default_factory=SimConfig)
    decode: SimConfig = field(default_factory=SimConfig)
    link: LinkModel | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 0:
            raise ValueError("a cluster needs at least one prefill (or colocated) instance")
        if self.num_decode and self.link is None:
            raise ValueError("prefill and decode instances need a link model")

    @property
    def name(self) -> str:
        return f"{self.num_prefill} colocated" if not self.num_decode else f"{self.num_prefill}P{self.num_decode}D"


@dataclass(slots=True)
class _Instance:
    loop: EngineLoop
    executor: FakeExecutor
    connector: SimConnector | None
    free_at: float = 0.0
    # Its last step could schedule nothing (no blocks): only an arrival or a transfer event can change that.
    blocked: bool = False

    @property
    def load(self) -> int:
        s = self.loop.scheduler
        return len(s.waiting) + len(s.running) + len(s.to_reserve) + len(s.receiving) + len(s.sending)

    def next_start(self) -> float:
        """The earliest time this instance can start a step that does something (inf: none now)."""
        s = self.loop.scheduler
        if (s.waiting or s.running or s.swapped or s.to_reserve) and not self.blocked:
            return self.free_at
        if self.connector is not None:  # a delivery or an ack it will poll
            return max(self.free_at, self.connector.next_event())
        return math.inf


def _instance(
    role: str, config: SimConfig, model: StepTimeModel, clock: ManualClock, vocab: int,
    link: LinkModel | None, transfers: dict[str, _Transfer],
) -> _Instance:
    sched_cfg = config.scheduler
    bm = BlockManager(config.num_blocks, config.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(sched_cfg, bm, make_policy(sched_cfg.policy, sched_cfg, clock=clock), clock=clock)

    def step_time(out: SchedulerOutput) -> float:
        return model.predict(*step_shape(out))

    executor = FakeExecutor(bm, sample=lambda req: 1, clock=clock, step_time=step_time, check_kv=False)
    connector = SimConnector(link, clock, transfers) if role != "both" and link is not None else None
    loop = EngineLoop(scheduler, executor, vocab_size=vocab, max_model_len=sched_cfg.max_model_len,
                      connector=connector, role=role)  # type: ignore[arg-type]  (duck-typed connector)
    return _Instance(loop, executor, connector)


def simulate_cluster(
    workload: Sequence[SimRequest], prefill_model: StepTimeModel, config: ClusterConfig,
    decode_model: StepTimeModel | None = None,
) -> SimResult:
    """Run `workload` (greedy, ignore_eos) through the cluster; `decode_model` defaults to the prefill
    instances' model. The result's steps are every instance's, in the order they ran."""
    clock = ManualClock()
    vocab = len(workload) + 2
    transfers: dict[str, _Transfer] = {}
    roles = ["both"] * config.num_prefill if not config.num_decode else ["prefill"] * config.num_prefill
    front = [_instance(r, config.prefill, prefill_model, clock, vocab, config.link, transfers) for r in roles]
    back = [
        _instance("decode", config.decode, decode_model or prefill_model, clock, vocab, config.link, transfers)
        for _ in range(config.num_decode)
    ]
    users = {id(x) for x in back or front}  # the instances where requests produce the tokens a client sees
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    owner: dict[tuple[int, str], int] = {}  # (id of the instance the client reads, req id) -> workload index
    times: dict[int, list[float]] = {i: [] for i in range(len(workload))}
    done: dict[int, float] = {}
    steps: list[StepSample] = []
    start = workload[order[0]].arrival if workload else 0.0
    nxt = 0
    while len(done) < len(workload):
        t_arrival = workload[order[nxt]].arrival if nxt < len(order) else math.inf
        inst = min(front + back, key=lambda x: x.next_start())
        t_step = inst.next_start()
        if t_arrival <= t_step:
            if t_arrival == math.inf:
                raise RuntimeError("the cluster makes no progress on this workload (KV blocks too few?)")
            clock.now = t_arrival
            i = order[nxt]
            nxt += 1
            _admit(i, workload[i], front, back, owner)
            continue
        clock.now = t_step
        ran = inst.executor.num_steps
        outputs = inst.loop.step()
        inst.free_at = clock.now
        inst.blocked = inst.executor.num_steps == ran and not outputs
        if not inst.blocked and inst.executor.num_steps != ran:
            rec = inst.loop.step_records[-1]
            steps.append(StepSample(rec.duration, rec.num_prefill_tokens, rec.num_decode_tokens, rec.num_context_tokens))
        if id(inst) in users:
            # a first token that came with the KV reached the decode side at the step's start (its poll)
            _collect(id(inst), outputs, t_step if inst.connector is not None else clock.now, clock.now, owner, times, done)
    results = [SimRequestResult(w.arrival, times[i][0], done[i], w.output_len, times[i]) for i, w in enumerate(workload)]
    preemptions = sum(x.loop.scheduler.num_preemptions for x in front + back)
    return SimResult(max(done.values(), default=start) - start, steps, results, preemptions)


def _admit(
    i: int, r: SimRequest, front: list[_Instance], back: list[_Instance], owner: dict[tuple[int, str], int]
) -> None:
    prompt = [i + 2] + [1] * (r.prompt_len - 1)
    params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
    p = min(front, key=lambda x: x.load)
    p.free_at = max(p.free_at, r.arrival)  # an idle instance starts on it when it arrives, not before
    p.blocked = False
    if not back:
        owner[(id(p), p.loop.add_request(prompt, params, arrival_time=r.arrival))] = i
        return
    d = min(back, key=lambda x: x.load)
    d.free_at = max(d.free_at, r.arrival)
    d.blocked = False
    tid = f"t{i}"
    owner[(id(d), d.loop.add_request(prompt, params, arrival_time=r.arrival, kv_transfer=RemotePrefill(tid)))] = i
    p.loop.add_request(prompt, params, arrival_time=r.arrival, kv_transfer=RemoteDecode(tid, "sim"))


def _collect(
    inst_id: int, outputs: list[RequestOutput], first_at: float, now: float, owner: dict[tuple[int, str], int],
    times: dict[int, list[float]], done: dict[int, float],
) -> None:
    """Token times of the requests whose tokens this instance's step gave: a request's first at
    `first_at`, the others at `now` (the step's end)."""
    for o in outputs:
        i = owner.get((inst_id, o.request_id))
        if i is None:
            continue
        if o.error is not None:
            raise RuntimeError(f"simulated request {i} failed: {o.error}")
        if o.outputs[0].new_token_ids:
            times[i].append(first_at if not times[i] else now)
        if o.finished:
            done[i] = now
