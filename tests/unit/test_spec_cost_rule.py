"""The cost rule (`choose_lengths_by_cost`): speculation lengths priced by the models' measured kernel
tables. The curve interpolates the table; flat (memory-bound) curves give everyone its acceptance length,
curves that rise with rows cut the lengths to 0, a draft model's forwards count, the choice is the
exhaustive optimum on small cases, and the executor uses the rule and learns the unmodelled time.
Torch-free."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import pytest

from pdserve.config import SpeculativeConfig
from pdserve.spec import DraftRequest, SpeculativeExecutor
from pdserve.spec.length import ResidualFit, RowCurve, choose_lengths_by_cost, expected_tokens
from pdserve.sim.fake_executor import expected_output
from tests.unit.test_spec_executor import FixedProposer, make_loop
from tests.support.loop import generate

FLAT = RowCurve((1, 8, 64, 512), (0.010, 0.010, 0.011, 0.020))  # weight streaming: rows nearly free
STEEP = RowCurve((1, 8, 64, 512), (0.010, 0.012, 0.060, 0.480))  # compute-bound from ~8 rows


def test_curve_interpolates_and_extends_the_table() -> None:
    c = RowCurve((1, 4, 8), (1.0, 2.0, 4.0))
    assert c(0) == 0.0 and c(1) == 1.0 and c(0.5) == 1.0
    assert c(2) == pytest.approx(4 / 3) and c(4) == 2.0 and c(6) == 3.0 and c(8) == 4.0
    assert c(12) == 6.0  # along the last segment's slope
    assert RowCurve.from_table([1, 4], [1.0, math.inf]) is None
    for rows, secs in [((1,), (1.0,)), ((4, 1), (1.0, 2.0)), ((1, 4), (1.0, -1.0)), ((0, 4), (1.0, 2.0))]:
        with pytest.raises(ValueError):
            RowCurve(rows, secs)


def test_residual_fit_learns_the_per_row_cost_and_forgets() -> None:
    fit = ResidualFit(forgetting=1.0)
    assert fit.coefficients == (0.0, 0.0) and fit(10) == 0.0
    for rows in (4, 4, 4):
        fit.observe(rows, 0.010)
    assert fit.coefficients == pytest.approx((0.010, 0.0))  # rows never varied: the mean, b = 0
    fit = ResidualFit(forgetting=1.0)
    for rows in (4, 20, 64, 100, 8):
        fit.observe(rows, 0.005 + 0.001 * rows)
    assert fit.coefficients == pytest.approx((0.005, 0.001)) and fit(50) == pytest.approx(0.055)
    fit.observe(0, 1.0)  # no rows, or a time that is not finite: ignored
    fit.observe(5, math.inf)
    assert fit.num_observations == 5
    fit = ResidualFit(forgetting=1.0)
    for rows, t in ((10, 0.010), (20, 0.005)):  # falling with rows: b clipped at 0
        fit.observe(rows, t)
    a, b = fit.coefficients
    assert b == 0.0 and a >= 0.0
    fit = ResidualFit(forgetting=0.5)
    for _ in range(40):
        fit.observe(10, 0.001)
    for _ in range(40):
        fit.observe(10, 0.050)
    assert fit(10) == pytest.approx(0.050, rel=1e-6)  # old steps forgotten
    with pytest.raises(ValueError):
        ResidualFit(forgetting=0.0)


def test_per_row_rest_cuts_drafts_the_curve_alone_would_allow() -> None:
    n, caps, acc = 64, [4] * 64, [0.7] * 64
    assert sum(choose_lengths_by_cost(caps, acc, rows=n, target=FLAT, overhead=0.02)) > 0
    assert choose_lengths_by_cost(caps, acc, rows=n, target=FLAT, overhead=0.02, per_row=0.002) == [0] * n


def test_flat_curve_gives_every_request_its_cap() -> None:
    caps, acc = [4, 4, 2], [0.8, 0.6, 0.9]
    assert choose_lengths_by_cost(caps, acc, rows=3, target=FLAT, overhead=0.005) == caps


def test_steep_curve_at_a_large_batch_gives_no_drafts() -> None:
    n = 64
    assert choose_lengths_by_cost([4] * n, [0.7] * n, rows=n, target=STEEP, overhead=0.02) == [0] * n
    # the same curve, one request: its extra rows are in the flat part
    assert choose_lengths_by_cost([4], [0.7], rows=1, target=STEEP, overhead=0.02) == [4]


def test_a_costly_draft_model_cuts_the_lengths() -> None:
    caps, acc = [4] * 4, [0.6] * 4
    free = choose_lengths_by_cost(caps, acc, rows=4, target=FLAT, overhead=0.0)
    draft = RowCurve((1, 64), (0.004, 0.005))  # each draft forward costs ~40% of a target step
    priced = choose_lengths_by_cost(caps, acc, rows=4, target=FLAT, overhead=0.0, draft=draft)
    assert free == caps and sum(priced) < sum(free)
    dear = RowCurve((1, 64), (0.012, 0.013))  # a draft forward dearer than the target's: never worth it
    assert choose_lengths_by_cost(caps, acc, rows=4, target=FLAT, overhead=0.0, draft=dear) == [0] * 4
    # per-forward overhead counts like the curve
    assert choose_lengths_by_cost(caps, acc, rows=4, target=FLAT, overhead=0.0, draft=draft,
                                  draft_overhead=0.02) == [0] * 4


def test_finished_requests_count_no_tokens_and_get_no_drafts() -> None:
    assert choose_lengths_by_cost([0, 3], [0.9, 0.9], rows=1, target=FLAT, overhead=0.0) == [0, 3]


def _rate(ks: Sequence[int], acc: Sequence[float], caps: Sequence[int], rows: int, target: RowCurve,
          overhead: float, draft: RowCurve | None, draft_overhead: float, per_row: float = 0.0) -> float:
    tokens = sum(expected_tokens(a, k) for a, k, c in zip(acc, ks, caps) if c > 0)
    t = overhead + per_row * (rows + sum(ks)) + target(rows + sum(ks))
    if draft is not None and sum(ks):
        t += sum(draft_overhead + draft(sum(1 for k in ks if k >= j)) for j in range(1, max(ks) + 1))
    return tokens / t


@pytest.mark.parametrize("seed", range(40))
def test_no_other_allocation_of_the_chosen_total_is_better_without_a_draft(seed: int) -> None:
    """Without a draft model the prefix search is exact: no allocation beats it (checked exhaustively)."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    caps = [rng.randint(0, 3) for _ in range(n)]
    acc = [rng.choice([rng.random(), 1.0]) for _ in range(n)]
    rows = sum(1 for c in caps if c) + rng.choice([0, 0, 30])
    pts = sorted(rng.sample(range(2, 60), 3))
    secs = sorted(rng.uniform(0.001, 0.05) for _ in range(4))
    target = RowCurve((1, *pts), tuple(secs))  # increasing, convex or not
    overhead, per_row = rng.uniform(0.0, 0.02), rng.choice([0.0, rng.uniform(0.0, 0.002)])
    got = choose_lengths_by_cost(caps, acc, rows=rows, target=target, overhead=overhead, per_row=per_row)
    best = max(_rate(ks, acc, caps, rows, target, overhead, None, 0.0, per_row)
               for ks in itertools.product(*[range(c + 1) for c in caps]))
    assert _rate(got, acc, caps, rows, target, overhead, None, 0.0, per_row) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_with_a_draft_model_the_choice_is_never_worse_than_no_drafts(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    caps = [rng.randint(1, 3) for _ in range(n)]
    acc = [rng.random() for _ in range(n)]
    target = RowCurve((1, 16, 64), (0.01, 0.012 + rng.random() * 0.02, 0.05 + rng.random() * 0.1))
    draft = RowCurve((1, 64), (rng.uniform(0.0005, 0.01), 0.012))
    got = choose_lengths_by_cost(caps, acc, rows=n, target=target, overhead=0.003, draft=draft, draft_overhead=0.001)
    args = (acc, caps, n, target, 0.003, draft, 0.001)
    assert _rate(got, *args) >= _rate([0] * n, *args) - 1e-12


class CountingProposer(FixedProposer):
    """FixedProposer that reports its forwards' rows as a draft model does (`last_rows`)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        ks = [r.num_tokens for r in requests if r.num_tokens > 0]
        self.last_rows = [sum(1 for k in ks if k > j) for j in range(max(ks, default=0))]
        return super().propose(requests)


def test_executor_uses_the_cost_rule_and_learns_the_rest_of_the_step() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=3)
    prompts = [[1, 2, 3, i] for i in range(6)]
    # a flat curve: verification is free, drafts flow, output unchanged
    loop, fake, _ = make_loop("chunked", None)
    spec = SpeculativeExecutor(fake, cfg, FixedProposer(1), target_curve=FLAT)
    loop.executor = spec
    assert spec.length_rule == "cost" and spec.max_batch_size is None
    assert generate(loop, prompts, 8) == [expected_output(p, 8) for p in prompts]
    assert spec.stats.num_drafts > 0 and spec.residual.num_observations > 0
    # a curve where every extra row costs a second: six decodes, never a draft
    loop, fake, _ = make_loop("chunked", None)
    dear = RowCurve((1, 2), (0.001, 1.0))
    spec = SpeculativeExecutor(fake, cfg, FixedProposer(1), target_curve=dear)
    loop.executor = spec
    assert generate(loop, prompts, 8) == [expected_output(p, 8) for p in prompts]
    assert spec.stats.num_drafts == 0


def test_executor_prices_the_draft_forwards_and_learns_their_overhead() -> None:
    cfg = SpeculativeConfig(method="draft", model="x", num_speculative_tokens=3)
    loop, fake, _ = make_loop("chunked", None)
    proposer = CountingProposer(1)
    spec = SpeculativeExecutor(fake, cfg, proposer, target_curve=FLAT, draft_curve=RowCurve((1, 8), (1e-6, 2e-6)))
    loop.executor = spec
    assert generate(loop, [[1, 2, 3]], 10) == [expected_output([1, 2, 3], 10)]
    assert spec.stats.num_drafts > 0 and spec.draft_overhead is not None
    loop, fake, _ = make_loop("chunked", None)
    spec = SpeculativeExecutor(fake, cfg, CountingProposer(1), target_curve=FLAT,
                               draft_curve=RowCurve((1, 8), (0.05, 0.06)))  # a draft forward: 5x a step
    loop.executor = spec
    assert generate(loop, [[1, 2, 3]], 10) == [expected_output([1, 2, 3], 10)]
    assert spec.stats.num_drafts == 0


def test_fixed_caps_in_the_config_keep_the_acceptance_rule() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=3)
    loop, fake, _ = make_loop("chunked", None)
    spec = SpeculativeExecutor(fake, cfg, FixedProposer(1), target_curve=FLAT)
    assert spec.length_rule == "acceptance" and spec.max_batch_size == 3
    assert SpeculativeExecutor(fake, SpeculativeConfig(), FixedProposer(1)).length_rule == "acceptance"
    assert SpeculativeExecutor(fake, SpeculativeConfig(adaptive=False), FixedProposer(1),
                               target_curve=FLAT).length_rule == "acceptance"


def test_a_dear_catch_up_keeps_that_request_from_drafting() -> None:
    caps, acc = [3, 3], [0.9, 0.9]
    assert choose_lengths_by_cost(caps, acc, rows=2, target=FLAT, overhead=0.0) == [3, 3]
    got = choose_lengths_by_cost(caps, acc, rows=2, target=FLAT, overhead=0.0, first_costs=[0.0, 1.0])
    assert got == [3, 0]  # the second one's draft would first have to run a second's worth of tokens


def test_executor_spreads_the_draft_catch_up_over_the_request_s_remaining_tokens() -> None:
    """A draft forward costs 1 ms per row on top of the target's flat 10 ms step: catching up a 180-token
    sequence is 0.18 s, worth it with ~50 tokens to go (spread: ~15 ms a step), not with 4."""
    cfg = SpeculativeConfig(method="draft", model="x", num_speculative_tokens=3)

    class Lagging(CountingProposer):
        def lag(self, req_id: str, seq_len: int) -> int:
            return seq_len  # never caught up: every proposal would rerun the whole sequence

    def drafts(max_tokens: int) -> int:
        loop, fake, _ = make_loop("chunked", None, num_blocks=512)
        spec = SpeculativeExecutor(fake, cfg, Lagging(1), target_curve=FLAT,
                                   draft_curve=RowCurve((1, 1001), (0.001, 1.001)))
        loop.executor = spec
        prompt = [1, 2, 3] * 60
        assert generate(loop, [prompt], max_tokens) == [expected_output(prompt, max_tokens)]
        return spec.stats.num_drafts

    assert drafts(4) == 0 and drafts(50) > 0
