"""The online step-time model: it recovers known coefficients from noisy synthetic steps, keeps them
non-negative (an exact non-negative least squares, checked against its optimality conditions), keeps the
prior where the data says nothing, and follows a machine that changes speed. Pure Python + numpy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.scheduler.step_model import DEFAULT_PRIOR, StepTimeModel, _nonnegative_quadratic_min

TRUE = (0.004, 0.0003, 0.0006, 0.0000015)  # seconds: base, per prompt token, per decode, per context token


def step_time(coef: tuple[float, ...], p: int, d: int, ctx: int) -> float:
    return coef[0] + coef[1] * p + coef[2] * d + coef[3] * ctx


def random_step(rng: random.Random) -> tuple[int, int, int]:
    """A step shape like a serving engine's: often decode-only, sometimes a prompt chunk, contexts that
    vary independently of the decode count."""
    d = rng.randint(0, 64)
    p = rng.randint(1, 512) if rng.random() < 0.4 or d == 0 else 0
    ctx = d * rng.randint(16, 1500) + p + rng.randint(0, 2000) * (p > 0)
    return p, d, ctx


def feed(model: StepTimeModel, coef: tuple[float, ...], n: int, rng: random.Random, noise: float) -> None:
    for _ in range(n):
        p, d, ctx = random_step(rng)
        model.observe(step_time(coef, p, d, ctx) * (1 + rng.gauss(0, noise)), p, d, ctx)


def assert_close(got: tuple[float, ...], want: tuple[float, ...], rel: float, base_rel: float) -> None:
    """The base (a few ms under steps of ~100 ms) is the least determined term: noise of a few percent
    of a step is as large as the base itself, so it gets its own tolerance."""
    for term, g, w, r in zip(("base", "prefill", "decode", "context"), got, want, (base_rel, rel, rel, rel)):
        assert abs(g - w) <= r * w, f"{term}: {g:.3g} vs {w:.3g} (rel {abs(g - w) / w:.3f})"


def test_prior_until_observed() -> None:
    m = StepTimeModel()
    assert m.coefficients == DEFAULT_PRIOR and m.num_observations == 0
    assert m.predict(100, 10, 1000) == pytest.approx(step_time(DEFAULT_PRIOR, 100, 10, 1000))
    m.refit()  # nothing observed: still the prior
    assert m.coefficients == DEFAULT_PRIOR


@pytest.mark.parametrize("seed", range(5))
def test_recovers_known_coefficients_from_noisy_steps(seed: int) -> None:
    rng = random.Random(seed)
    m = StepTimeModel(forgetting=0.999)  # a long memory: ~1000 steps average the noise out
    feed(m, TRUE, 4_000, rng, noise=0.05)
    assert_close(m.coefficients, TRUE, rel=0.05, base_rel=0.15)
    for _ in range(20):
        p, d, ctx = random_step(rng)
        assert m.predict(p, d, ctx) == pytest.approx(step_time(TRUE, p, d, ctx), rel=0.05)  # = one step's noise


def test_default_memory_is_accurate_on_clean_steps() -> None:
    """The default (~100 steps of memory, prior worth 1 step) lands within a few percent of the truth;
    the prior is 1.5-2.5x off, so a prior that dominated would fail this."""
    m = StepTimeModel()
    feed(m, TRUE, 500, random.Random(1), noise=0.0)
    assert_close(m.coefficients, TRUE, rel=0.05, base_rel=0.05)
    p, d, ctx = 300, 20, 9_000
    assert m.predict(p, d, ctx) == pytest.approx(step_time(TRUE, p, d, ctx), rel=0.02)


def test_coefficients_never_negative() -> None:
    rng = random.Random(3)
    # Time that falls with context is not physical; unconstrained least squares would fit a negative
    # context coefficient (and so would a zero true coefficient under noise).
    wrong = (0.004, 0.0003, 0.0009, -0.0000004)
    m = StepTimeModel(forgetting=0.999)
    xs, ys = [], []
    for _ in range(2_000):
        p, d, ctx = random_step(rng)
        y = max(1e-4, step_time(wrong, p, d, ctx)) * (1 + rng.gauss(0, 0.02))
        m.observe(y, p, d, ctx)
        xs.append((1.0, p, d, ctx))
        ys.append(y)
    unconstrained = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0]
    assert unconstrained[3] < 0  # the data does pull that way
    assert all(c >= 0 for c in m.coefficients)
    assert m.coefficients[3] == 0.0

    zero_context = (0.004, 0.0003, 0.0006, 0.0)
    m = StepTimeModel()
    feed(m, zero_context, 1_000, rng, noise=0.1)
    assert all(c >= 0 for c in m.coefficients)


@pytest.mark.parametrize("seed", range(50))
def test_nonnegative_solver_meets_optimality_conditions(seed: int) -> None:
    """KKT for min theta^T h theta - 2 g^T theta, theta >= 0: gradient 0 on the support, >= 0 off it."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(8, 4)) * rng.choice([1e-3, 1.0, 1e3], size=4)
    h = a.T @ a + np.eye(4) * 1e-6
    g = rng.normal(size=4) * np.sqrt(np.diag(h))
    theta = _nonnegative_quadratic_min(h, g)
    assert (theta >= 0).all()
    grad = (h @ theta - g) / np.sqrt(np.diag(h))  # scaled so one tolerance fits every column
    tol = 1e-7 * (1 + np.abs(g / np.sqrt(np.diag(h))).max())
    for j in range(4):
        if theta[j] > 0:
            assert abs(grad[j]) <= tol, (j, grad)
        else:
            assert grad[j] >= -tol, (j, grad)


def test_term_never_seen_keeps_its_prior() -> None:
    """Decode-only traffic says nothing about prompt tokens: that coefficient stays the prior's."""
    m = StepTimeModel()
    rng = random.Random(4)
    for _ in range(300):
        d = rng.randint(1, 64)
        ctx = d * rng.randint(16, 1500)
        m.observe(step_time(TRUE, 0, d, ctx), 0, d, ctx)
    assert m.coefficients[1] == pytest.approx(DEFAULT_PRIOR[1], rel=1e-9)
    assert m.coefficients[2] == pytest.approx(TRUE[2], rel=0.05)


def test_forgetting_follows_a_slowdown() -> None:
    """The machine becomes 2x slower (another tenant): the default memory follows within a few hundred
    steps; a model that never forgets would sit near the average of the two (1.5x)."""
    rng = random.Random(5)
    slow = tuple(2 * c for c in TRUE)
    m, never = StepTimeModel(), StepTimeModel(forgetting=1.0)
    for model in (m, never):
        feed(model, TRUE, 1_000, random.Random(6), noise=0.02)
        feed(model, slow, 1_000, rng, noise=0.02)
    assert_close(m.coefficients, slow, rel=0.1, base_rel=0.3)
    p, d, ctx = 200, 32, 12_000
    assert m.predict(p, d, ctx) == pytest.approx(step_time(slow, p, d, ctx), rel=0.05)
    assert never.predict(p, d, ctx) < 0.8 * step_time(slow, p, d, ctx)


def test_refits_every_interval_and_reports_prediction_before_learning() -> None:
    m = StepTimeModel(refit_interval=4)
    shapes = [(10, 2, 50), (0, 8, 800), (64, 0, 64), (0, 3, 90)]
    for i, (p, d, ctx) in enumerate(shapes):
        before = m.predict(p, d, ctx)
        m.observe(10 * step_time(TRUE, p, d, ctx), p, d, ctx)
        assert m.last_predicted == before and m.last_measured == 10 * step_time(TRUE, p, d, ctx)
        if i < 3:
            assert m.coefficients == DEFAULT_PRIOR  # not refitted yet
    assert m.coefficients != DEFAULT_PRIOR and m.num_observations == 4
    m.observe(float("nan"), 1, 1, 1)
    m.observe(0.01, 0, 0, 0)  # no work: ignored
    assert m.num_observations == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prior=(0.01, 0.001, 0.001)),
        dict(prior=(0.01, -0.001, 0.001, 0.0)),
        dict(prior_weight=0.0),
        dict(forgetting=0.0),
        dict(forgetting=1.5),
        dict(refit_interval=0),
    ],
)
def test_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StepTimeModel(**kwargs)
