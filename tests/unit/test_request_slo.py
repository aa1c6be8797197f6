"""Per-request latency targets (`SamplingParams.slo_ttft_ms` / `slo_itl_ms` / `slo_tpot_ms`): their
validation, the `slo` policy's EDF order, step ITL budget and rejection by each request's own targets,
the other policies ignoring them, and the slack speculation-length rule choosing each request's length
within its own TPOT slack (injected step models and clocks). Pure Python: no torch, no timing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pdserve.config import SchedulerConfig
from pdserve.engine.loop import EngineLoop
from pdserve.errors import InvalidRequestError, SLORejectedError
from pdserve.kv.block_manager import BlockManager
from pdserve.request import Request, SamplingParams
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.fake_executor import FakeExecutor
from pdserve.spec import NgramProposer, SpeculativeExecutor
from pdserve.spec.length import StepCost, choose_lengths
from tests.support.scheduler_driver import Driver, assert_all_freed, make_req
from tests.unit.test_slo_policy import decode_req, make_scheduler, policy_of
from tests.unit.test_spec_length import PROMPTS, SPEC, WANT


def with_targets(req: Request, **targets: float | None) -> Request:
    req.params = replace(req.params, **targets)
    return req


# ---- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["slo_ttft_ms", "slo_itl_ms", "slo_tpot_ms"])
@pytest.mark.parametrize("value", [0, 0.0, -5.0, math.inf, math.nan, "10", True])
def test_targets_must_be_positive_finite_numbers(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: value})  # type: ignore[arg-type]


def test_targets_default_to_none_and_accept_numbers() -> None:
    p = SamplingParams()
    assert (p.slo_ttft_ms, p.slo_itl_ms, p.slo_tpot_ms) == (None, None, None)
    p = SamplingParams(slo_ttft_ms=200, slo_itl_ms=12.5, slo_tpot_ms=30.0)
    assert (p.slo_ttft_ms, p.slo_itl_ms, p.slo_tpot_ms) == (200, 12.5, 30.0)


# ---- the slo policy --------------------------------------------------------------------------------


def test_edf_order_uses_each_requests_own_ttft() -> None:
    """One seat. Deadlines: a 1.0 + 0.5 (the default) = 1.5, b 2.0 + 0.05 = 2.05, c 1.2 + 0.1 = 1.3:
    admitted c, a, b, where arrival order would be a, c, b."""
    sched = make_scheduler(max_num_seqs=1, ttft_ms=500.0)
    d = Driver(sched)
    for req_id, arrival, ttft in [("a", 1.0, None), ("b", 2.0, 50.0), ("c", 1.2, 100.0)]:
        req = with_targets(make_req(req_id, [1, 2, 3], 2), slo_ttft_ms=ttft)
        req.arrival_time = arrival
        sched.add_request(req)
    d.run()
    assert d.first_scheduled == ["c", "a", "b"]
    assert_all_freed(sched)


def test_step_itl_budget_is_the_tightest_among_running_decodes() -> None:
    """Known model: 2 ms + 0.1 ms per prompt token (nothing else). Default ITL 50 ms: 480 tokens fit;
    a decode with a 10 ms target shrinks the budget to 80; one with a loose 500 ms target changes
    nothing from the default, and a running *prompt* with a tight target does not shrink it either."""
    sched = make_scheduler(itl_ms=50.0, prior=(0.002, 0.0001, 0.0, 0.0), budget=1_000, min_chunk=4)
    policy = policy_of(sched)
    loose = with_targets(decode_req("batch", 20), slo_itl_ms=500.0)
    assert policy.prefill_budget([])[0] == 480
    assert policy.prefill_budget([decode_req("plain", 20)])[0] == 480
    assert policy.prefill_budget([loose])[0] == 1_000  # only loose decodes: its own target rules
    tight = with_targets(decode_req("chat", 20), slo_itl_ms=10.0)
    assert policy.prefill_budget([loose, tight])[0] == 80
    prompt = with_targets(make_req("p", [1] * 40, 4), slo_itl_ms=3.0)  # still in its prompt
    assert policy.prefill_budget([loose, prompt])[0] == 1_000


def test_a_tight_decode_shrinks_the_chunks_only_while_it_decodes() -> None:
    """Through the scheduler: a long prompt runs beside a decode with a 10 ms ITL target (80-token
    chunks), then beside none (480-token chunks)."""
    sched = make_scheduler(itl_ms=50.0, prior=(0.002, 0.0001, 0.0, 0.0), budget=1_000, min_chunk=4)
    d = Driver(sched)
    chat = with_targets(make_req("chat", [1] * 4, 3), slo_itl_ms=10.0)
    sched.add_request(chat)
    d.step()  # its prompt and first token
    sched.add_request(make_req("doc", [2] * 2_000, 2))
    beside_chat, alone = [], []
    while "doc" in sched.requests and not sched.requests["doc"].num_output_tokens:
        chat_decodes = chat in sched.running
        out = d.step()
        chunk = sum(s.num_new_tokens for s in out.scheduled if s.req.req_id == "doc")
        (beside_chat if chat_decodes else alone).append(chunk)
    assert beside_chat and set(beside_chat) == {80}
    assert alone and alone[0] == 480
    d.run()
    assert_all_freed(sched)


def test_rejection_reads_the_new_requests_own_targets() -> None:
    # 10 ms + 1 ms per prompt token; ITL 50 ms: 40 prompt tokens per 50 ms step.
    prior = (0.010, 0.001, 0.0, 0.0)
    sched = make_scheduler(reject=True, itl_ms=50.0, ttft_ms=500.0, prior=prior, budget=512)
    policy_of(sched).clock = lambda: 10.0
    sched.running.append(decode_req("d", 30))
    req = make_req("r", [2] * 120, 4)  # 3 steps: 150 ms
    req.arrival_time = 10.0
    sched.check_admission(req)  # the default 500 ms
    with pytest.raises(SLORejectedError, match="target 100 ms"):
        sched.check_admission(with_targets(req, slo_ttft_ms=100.0))
    # A waiting request with a later deadline is not ahead of a tight one (EDF), one with an earlier is.
    later = make_req("later", [3] * 200, 4)
    later.arrival_time = 10.0
    sched.add_request(later)
    sched.check_admission(with_targets(req, slo_ttft_ms=200.0))  # 120 tokens ahead, not 320
    earlier = with_targets(make_req("earlier", [3] * 200, 4), slo_ttft_ms=50.0)
    earlier.arrival_time = 10.0
    sched.add_request(earlier)
    with pytest.raises(SLORejectedError, match="time-to-first-token"):
        sched.check_admission(with_targets(req, slo_ttft_ms=200.0))  # 320 ahead: 8 steps


def test_rejection_uses_the_tightest_itl_of_all_accepted() -> None:
    # 1 ms + 4 ms per decode: 5 decodes take 21 ms.
    prior = (0.001, 0.0001, 0.004, 0.0)
    sched = make_scheduler(reject=True, itl_ms=50.0, prior=prior, min_chunk=32)
    sched.running.extend(decode_req(f"d{i}", 20) for i in range(4))
    sched.check_admission(make_req("new", [1] * 4, 4))
    with pytest.raises(SLORejectedError, match="target 20 ms"):
        sched.check_admission(with_targets(make_req("chat", [1] * 4, 4), slo_itl_ms=20.0))
    sched.running[0] = with_targets(sched.running[0], slo_itl_ms=20.0)  # a running one is that tight
    with pytest.raises(SLORejectedError, match="inter-token latency"):
        sched.check_admission(make_req("plain", [1] * 4, 4))


def test_other_policies_ignore_the_targets() -> None:
    config = SchedulerConfig(policy="chunked", max_num_seqs=1)
    sched = Scheduler(config, BlockManager(64, 4, False), make_policy("chunked", config))
    d = Driver(sched)
    for i, ttft in enumerate([1_000.0, 1.0, 10.0]):
        sched.add_request(with_targets(make_req(f"r{i}", [1, 2, 3], 2), slo_ttft_ms=ttft, slo_itl_ms=1.0))
    d.run()
    assert d.first_scheduled == ["r0", "r1", "r2"]


# ---- speculation length per request ------------------------------------------------------------------


def test_own_budgets_give_a_tight_request_fewer_drafts_than_one_with_slack() -> None:
    """Same acceptance, same step: the step costs 20 ms plus 1 ms per verified draft. The request behind
    its TPOT (own budget 21.5 ms: room for one draft of its own) gets 1, the one with slack its cap; one
    whose own budget the draft-free step already passes gets none, and does not take the others' away."""
    cost = StepCost(0.020, 0.001)
    acc = [0.9, 0.9, 0.9]
    assert choose_lengths([4] * 3, acc, cost, [None] * 3, [0.0215, 1.0, None]) == [1, 4, 4]
    assert choose_lengths([4] * 3, acc, cost, [None] * 3, [0.019, 1.0, None]) == [0, 4, 4]
    # The step's hard bound is still the tightest step budget (ITL): 3 drafts in all, by gain.
    assert choose_lengths([4] * 3, [0.5, 0.9, 0.9], cost, [0.0235, None, None], [None, 1.0, 1.0]) == [0, 2, 1]
    # Without own budgets it is the rule as before.
    assert choose_lengths([4, 4], [0.9, 0.3], cost, [None, 0.0245]) == choose_lengths(
        [4, 4], [0.9, 0.3], cost, [None, 0.0245], [None, None]
    )


def test_executor_gives_a_request_behind_its_own_tpot_no_drafts() -> None:
    """Two classes in one engine: requests with a 10 ms TPOT target of their own fall behind at once
    (every clock read is 50 ms later) and get no drafts after their first token; the same run's
    requests without a target (no engine-wide TPOT) keep the full length, and the output is unchanged."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.050
        return now[0]

    asked: dict[str, list[int]] = {}

    class Recording(NgramProposer):
        def propose(self, requests):  # type: ignore[no-untyped-def]
            for r in requests:
                asked.setdefault(r.req_id, []).append(r.num_tokens)
            return super().propose(requests)

    sc = SchedulerConfig(policy="chunked")
    bm = BlockManager(64, 4)
    sched = Scheduler(sc, bm, make_policy("chunked", sc), clock=clock)
    proposer = Recording(SPEC.prompt_lookup_min, SPEC.prompt_lookup_max)
    cheap = StepTimeModel((0.010, 0.0004, 0.0, 0.0))
    ex = SpeculativeExecutor(FakeExecutor(bm), SPEC, proposer, step_model=cheap, clock=clock)
    loop = EngineLoop(sched, ex, vocab_size=8, max_model_len=256)
    tight_params = SamplingParams(max_tokens=24, ignore_eos=True, slo_tpot_ms=10.0)
    tight = [loop.add_request(p, tight_params) for p in PROMPTS]
    loose = [loop.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    done = {}
    while loop.has_unfinished_requests():
        for o in loop.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done[i] for i in tight] == [done[i] for i in loose] == WANT
    assert all(sum(asked[i][1:]) == 0 for i in tight)  # after the first tokens: none
    assert max(n for i in loose for n in asked[i]) == 3


# ---- server: parsing and per-request goodput -----------------------------------------------------------


def test_request_bodies_carry_the_targets_and_bad_values_are_400() -> None:
    from pdserve.server.protocol import (
        APIError,
        ChatCompletionRequest,
        CompletionRequest,
        decode_body,
        sampling_params,
    )

    body = b'{"prompt": "hi", "slo_ttft_ms": 100, "slo_itl_ms": 12.5, "slo_tpot_ms": 20}'
    p = sampling_params(decode_body(body, CompletionRequest), 4, None)
    assert (p.slo_ttft_ms, p.slo_itl_ms, p.slo_tpot_ms) == (100.0, 12.5, 20.0)
    chat = decode_body(b'{"messages": [], "slo_itl_ms": 8}', ChatCompletionRequest)
    assert sampling_params(chat, 4, None).slo_itl_ms == 8.0
    assert sampling_params(decode_body(b'{"prompt": "hi"}', CompletionRequest), 4, None).slo_ttft_ms is None
    for bad, param in [
        (b'{"prompt": "hi", "slo_ttft_ms": 0}', "slo_ttft_ms"),
        (b'{"prompt": "hi", "slo_itl_ms": -1}', "slo_itl_ms"),
        (b'{"prompt": "hi", "slo_tpot_ms": "20"}', "slo_tpot_ms"),
        (b'{"prompt": "hi", "slo_tpot_ms": 1e400}', "slo_tpot_ms"),
    ]:
        with pytest.raises(APIError) as e:
            sampling_params(decode_body(bad, CompletionRequest), 4, None)
        assert (e.value.status, e.value.param) == (400, param)
        assert param in e.value.message


def test_latency_targets_resolve_and_judge() -> None:
    from pdserve.request import LatencyTargets

    own = SamplingParams(slo_ttft_ms=100.0, slo_tpot_ms=20.0)
    t = LatencyTargets.resolve(own, 0.5, 0.05, None)
    assert t == LatencyTargets(ttft=0.1, itl=0.05, tpot=0.02)
    assert LatencyTargets.resolve(SamplingParams(), None, None, None).is_empty
    assert t.results(0.09, 0.05, 0.021) == {"ttft": True, "itl": True, "tpot": False, "all": False}
    assert t.results(0.2, None, None) == {"ttft": False, "itl": True, "tpot": True, "all": False}
    assert LatencyTargets(itl=0.01).results(5.0, 0.009, 1.0) == {"itl": True, "all": True}
    assert LatencyTargets().results(1.0, 1.0, 1.0) == {}


def test_metrics_count_met_and_missed_targets() -> None:
    from prometheus_client import generate_latest

    from pdserve.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.observe_slo({"ttft": True, "tpot": False, "all": False})
    m.observe_slo({"ttft": True, "all": True})
    text = generate_latest(m.registry).decode()
    assert 'pdserve:request_slo_met_total{model_name="m",target="ttft"} 2.0' in text
    assert 'pdserve:request_slo_met_total{model_name="m",target="all"} 1.0' in text
    assert 'pdserve:request_slo_missed_total{model_name="m",target="tpot"} 1.0' in text
    assert 'pdserve:request_slo_missed_total{model_name="m",target="itl"} 0.0' in text


def test_targets_cross_the_front_to_core_message() -> None:
    import msgspec

    from pdserve.engine.process.messages import AddRequest, FrontMessage

    params = SamplingParams(max_tokens=3, slo_ttft_ms=120.0, slo_itl_ms=15.0, slo_tpot_ms=25.0)
    frame = msgspec.msgpack.encode(AddRequest("r", [1, 2], params, 1.0))
    got = msgspec.msgpack.decode(frame, type=FrontMessage)
    assert isinstance(got, AddRequest) and got.params == params
    plain = msgspec.msgpack.encode(AddRequest("r", [1, 2], SamplingParams(), 1.0))
    assert msgspec.msgpack.decode(plain, type=FrontMessage).params.slo_ttft_ms is None
