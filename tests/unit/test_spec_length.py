"""The slack length rule (`pdserve.spec.length.choose_lengths`) with injected step costs, acceptances and
latency budgets, against exhaustive search; and its wiring in `SpeculativeExecutor` through the real
scheduler and loop on the fake executor (greedy output unchanged, lengths follow the step model and the
TPOT budget). Torch-free."""

from __future__ import annotations

import itertools

import pytest

from pdserve.config import SchedulerConfig, SpeculativeConfig
from pdserve.engine.loop import EngineLoop
from pdserve.kv.block_manager import BlockManager
from pdserve.scheduler.policies import make_policy
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.step_model import StepTimeModel
from pdserve.sim.fake_executor import FakeExecutor, expected_output
from pdserve.spec import SpeculativeExecutor
from pdserve.spec.length import StepCost, choose_lengths, expected_tokens
from tests.support.loop import generate


def goodput(lengths: list[int], acceptances: list[float], cost: StepCost) -> float:
    tokens = sum(expected_tokens(a, k) for a, k in zip(acceptances, lengths))
    return tokens / (cost.base + cost.per_token * sum(lengths))


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_cheap_verification_gives_every_request_its_full_length() -> None:
    caps, acc = [4, 4, 2], [0.9, 0.4, 0.7]
    assert choose_lengths(caps, acc, StepCost(0.020, 0.0), [None] * 3) == caps
    assert choose_lengths(caps, acc, StepCost(0.020, 1e-5), [0.050] * 3) == caps  # slack to spare


def test_compute_bound_batch_drops_to_zero() -> None:
    # 64 decodes at 1 ms each: a verified draft costs as much as a decode, so a draft must be accepted
    # more often than the step's tokens per unit of time would have it (about 0.86 here).
    n = 64
    cost = StepCost(0.010 + n * 0.001, 0.001)
    assert choose_lengths([4] * n, [0.6] * n, cost, [None] * n) == [0] * n
    assert sum(choose_lengths([4] * n, [0.95] * n, cost, [None] * n)) > 0  # near-certain drafts still pay


def test_tight_itl_target_gives_fewer_drafts() -> None:
    cost = StepCost(0.020, 0.002)
    assert choose_lengths([4], [0.8], cost, [None]) == [4]
    assert choose_lengths([4], [0.8], cost, [0.0245]) == [2]  # room for 4.5 ms of drafts
    assert choose_lengths([4], [0.8], cost, [0.019]) == [0]  # at risk even without drafts: none
    # The tightest request's budget binds the step, and the drafts go where they pay most.
    assert choose_lengths([4, 4], [0.9, 0.3], cost, [None, 0.0245]) == [2, 0]


def test_without_latency_targets_or_step_cost_it_is_the_acceptance_rule() -> None:
    caps = [1, 3, 4, 0]  # SpecLengthController's lengths
    assert choose_lengths(caps, [0.2, 0.5, 1.0, 0.0], StepCost(0.013, 0.0), [None] * 4) == caps


@pytest.mark.parametrize("seed", range(6))
def test_greedy_choice_is_the_exhaustive_optimum(seed: int) -> None:
    import random

    rng = random.Random(seed)
    n = 3
    caps = [rng.randint(0, 3) for _ in range(n)]
    acc = [rng.random() for _ in range(n)]
    cost = StepCost(rng.uniform(0.005, 0.03), rng.uniform(0.0, 0.01))
    budget = rng.choice([None, cost.base + rng.uniform(-0.002, 0.02)])
    budgets = [budget, None, None]
    got = choose_lengths(caps, acc, cost, budgets)
    feasible = [
        list(ks) for ks in itertools.product(*(range(c + 1) for c in caps))
        if budget is None or cost.base + cost.per_token * sum(ks) <= budget
    ]
    if not feasible:
        assert got == [0] * n
        return
    best = max(goodput(ks, acc, cost) for ks in feasible)
    assert got in feasible and goodput(got, acc, cost) == pytest.approx(best)


# ---- wiring: SpeculativeExecutor ------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 1, 2], [2, 2, 1, 3, 1, 2, 2, 1], [3, 1] * 6]


class Asked:
    """Wraps the n-gram proposer and records the lengths asked for."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.asked: list[int] = []

    def propose(self, requests):  # type: ignore[no-untyped-def]
        self.asked += [r.num_tokens for r in requests]
        return self.inner.propose(requests)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)


def run(
    spec: SpeculativeConfig, step_model: StepTimeModel | None, *, itl: float | None = None, clock=None
) -> tuple[list[list[int]], Asked, SpeculativeExecutor]:
    from pdserve.spec import NgramProposer

    sc = SchedulerConfig(policy="chunked")
    bm = BlockManager(64, 4)
    kw = {} if clock is None else {"clock": clock}
    sched = Scheduler(sc, bm, make_policy("chunked", sc), **kw)
    fake = FakeExecutor(bm)
    asked = Asked(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
    executor = SpeculativeExecutor(fake, spec, asked, step_model=step_model, itl_target=itl, **kw)
    loop = EngineLoop(sched, executor, vocab_size=8, max_model_len=256)
    return generate(loop, PROMPTS, 24), asked, executor


SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
WANT = [expected_output(p, 24) for p in PROMPTS]


def test_executor_follows_the_step_model_and_keeps_greedy_output() -> None:
    # Nobody feeds these models, so their coefficients stay the injected priors.
    cheap = StepTimeModel((0.010, 0.0004, 0.0, 0.0))  # a verified token costs nothing
    costly = StepTimeModel((0.001, 0.0004, 0.010, 0.0))  # a verified token costs 10x the base
    out, asked_cheap, ex = run(SPEC, cheap)
    assert out == WANT and max(asked_cheap.asked) == 3 and ex.stats.num_accepted_tokens > 0
    assert ex.stats.num_length_choices > 0 and ex.stats.mean_chosen_length > 0
    out, asked_costly, ex = run(SPEC, costly)
    # Only the first decision drafts (an unmeasured request is taken to accept every draft, and then
    # the first draft pays); once a draft was rejected, none are worth a verified token's cost.
    assert out == WANT and ex.stats.num_drafts <= len(PROMPTS) and ex.stats.mean_chosen_length < 0.5
    assert sum(asked_costly.asked[-len(PROMPTS) * 10 :]) == 0
    # The same step model under a tight ITL target: fewer drafts than without it.
    mid = StepTimeModel((0.010, 0.0004, 0.0005, 0.0))
    out, free, _ = run(SPEC, mid)
    out_tight, tight, _ = run(SPEC, mid, itl=0.0125)  # 3 decodes: 11.5 ms, room for 2 drafts in all
    assert out == out_tight == WANT
    assert sum(tight.asked) < sum(free.asked) and max(n for n in tight.asked) <= 2


def test_acceptance_rule_and_fixed_length_stay_reachable() -> None:
    costly = StepTimeModel((0.001, 0.0004, 0.010, 0.0))
    out, acceptance_only, ex = run(SpeculativeConfig(**{**_fields(SPEC), "length_rule": "acceptance"}), costly)
    assert out == WANT and ex.stats.num_drafts > 0  # the step model is not consulted
    _, no_model, _ = run(SPEC, None)  # slack rule without a step model: the acceptance rule
    assert acceptance_only.asked == no_model.asked
    out, fixed, _ = run(SpeculativeConfig(**{**_fields(SPEC), "adaptive": False}), costly)
    assert out == WANT and set(fixed.asked) == {3}


def test_a_request_behind_its_tpot_target_gets_no_drafts() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.050  # every read 50 ms later: each request falls behind a 10 ms TPOT at once
        return now[0]

    cheap = StepTimeModel((0.010, 0.0004, 0.0, 0.0))
    behind = SpeculativeConfig(**{**_fields(SPEC), "slo_tpot_ms": 10.0})
    ahead = SpeculativeConfig(**{**_fields(SPEC), "slo_tpot_ms": 1000.0})
    out, asked, _ = run(behind, cheap, clock=clock)
    assert out == WANT and sum(asked.asked[len(PROMPTS):]) == 0  # after the first tokens: none
    now[0] = 0.0
    out, asked, _ = run(ahead, cheap, clock=clock)
    assert out == WANT and max(asked.asked) == 3


def _fields(c: SpeculativeConfig) -> dict[str, object]:
    return {f: getattr(c, f) for f in c.__dataclass_fields__}


def test_config_validates_the_new_fields() -> None:
    with pytest.raises(ValueError, match="length_rule"):
        SpeculativeConfig(length_rule="fast")
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        SpeculativeConfig(slo_tpot_ms=0.0)
    assert SpeculativeConfig.from_dict('{"length_rule": "acceptance", "slo_tpot_ms": 40}').slo_tpot_ms == 40
