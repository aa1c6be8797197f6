"""Kernel choice by measurement (model/autotune.py), driven by a fake clock: which candidate wins each
row bucket, ties, the batch-invariant pick, early stop of hopeless candidates, stalls filtered per
call, the dispatch buckets, and the on-disk cache (hit, miss on any key change, unreadable files)."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.model import autotune
from pdserve.model.autotune import TuneTable, bucket_index, drop_spikes, pick_one, pick_per_bucket, time_pass, tune


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_prepare(clock: FakeClock, costs: dict[str, dict[str, callable]], layers: int = 3, log: list | None = None):
    """`costs[candidate][op](rows)`: seconds one call takes; calling it advances the fake clock."""

    def prepare(name: str):
        def pass_for(rows: int):
            calls = []
            for _ in range(layers):
                for op, cost in costs[name].items():
                    def call(cost=cost, op=op) -> None:
                        clock.now += cost(rows)
                        if log is not None:
                            log.append((name, op, rows))
                    calls.append((op, call))
            return calls

        return pass_for

    return prepare


def test_bucket_index():
    b = (1, 4, 8, 16)
    assert [bucket_index(r, b) for r in (0, 1, 2, 4, 5, 8, 9, 16, 17, 10_000)] == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]


def test_pick_per_bucket_and_ties():
    times = {"a": [1.0, 2.0, 3.0], "b": [2.0, 2.0, 1.0]}
    assert pick_per_bucket(times, ("a", "b"), 3) == ["a", "a", "b"]  # tie at bucket 1: the earlier one
    assert pick_per_bucket(times, ("b", "a"), 3) == ["a", "b", "b"]


def test_the_incumbent_keeps_near_ties():
    """Another kernel takes a bucket from the incumbent only by more than the margin (its own weight copy
    is a cost the timing does not see); a real win still goes to it."""
    times = {"a": [1.0, 1.0, 1.0, 1.0], "b": [0.97, 0.5, 1.2, 0.953]}
    assert pick_per_bucket(times, ("a", "b"), 4, incumbent="a") == ["a", "b", "a", "a"]  # 3% / 5%: ties
    assert pick_per_bucket(times, ("a", "b"), 4, incumbent="a", margin=0.0) == ["b", "b", "a", "b"]
    assert pick_per_bucket(times, ("b", "a"), 4, incumbent="b") == ["b", "b", "a", "b"]
    assert pick_per_bucket({"a": [math.inf], "b": [1.0]}, ("a", "b"), 1, incumbent="a") == ["b"]
    # In a table the incumbent is the batch-invariant pick (decode-sized buckets): "gemv" here, which
    # keeps the 64-row bucket that "gemm" wins by 2%, not the 512-row one it wins by 3x.
    table = TuneTable((1, 64, 512), {"op": {"gemm": [5.0, 1.96, 1.0], "gemv": [1.0, 2.0, 3.0]}}, ("gemm", "gemv"))
    assert pick_one(table, table.order) == "gemv"
    assert table.winners("op") == ["gemv", "gemv", "gemm"]


def test_tune_picks_the_fastest_per_bucket_and_op():
    clock = FakeClock()
    costs = {
        # small-row specialist: cheap with few rows, linear in rows
        "gemv": {"qkv": lambda r: 1e-3 * r, "head": lambda r: 5e-3 * r},
        # compute-bound kernel: a fixed cost, barely growing
        "gemm": {"qkv": lambda r: 8e-3 + 1e-5 * r, "head": lambda r: 2e-3 + 1e-5 * r},
    }
    table = tune(["gemm", "gemv"], fake_prepare(clock, costs), ["qkv", "head"], buckets=(1, 4, 16, 64), timer=clock)
    assert table.winners("qkv") == ["gemv", "gemv", "gemm", "gemm"]
    assert table.winners("head") == ["gemm"] * 4
    # seconds are per full pass: 3 layers of calls summed
    assert table.seconds["qkv"]["gemv"][0] == pytest.approx(3e-3)
    assert table.total_seconds("gemm")[0] == pytest.approx(3 * (8e-3 + 1e-5) + 3 * (2e-3 + 1e-5))
    chosen = table.chosen_seconds()
    assert chosen[0] == pytest.approx(3e-3 + 3 * (2e-3 + 1e-5))
    text = autotune.format_table(table)
    assert "gemv" in text.splitlines()[1] and text.splitlines()[0].split()[0] == "rows"


def test_tune_stops_timing_a_hopeless_candidate():
    clock = FakeClock()
    log: list = []
    costs = {"fast": {"op": lambda r: 1e-3}, "slow": {"op": lambda r: 1e-3 * r}}
    buckets = (1, 4, 8, 16, 32)
    table = tune(["fast", "slow"], fake_prepare(clock, costs, log=log), ["op"], buckets=buckets, timer=clock)
    timed_rows = sorted({rows for name, _, rows in log if name == "slow"})
    assert timed_rows == [1, 4, 8]  # 4x and 8x behind at two buckets in a row: 16 and 32 never run
    assert table.seconds["op"]["slow"][3:] == [math.inf, math.inf]
    assert table.winners("op") == ["fast"] * 5


def test_tune_sweeps_both_ways_so_a_slow_phase_does_not_pick_the_winner():
    """Two equal kernels on a host that runs at half speed for its first stretch (a neighbour on the memory
    bus). Timed one after the other, the first looks 2x slower; in two sweeps (a, b, then b, a) each gets
    a pass outside the slow stretch, the two tie and the earlier keeps the bucket."""
    clock = FakeClock()
    n = {"calls": 0}

    def cost(rows: int) -> float:
        n["calls"] += 1
        return 1e-3 * (2.0 if n["calls"] <= 40 else 1.0)

    costs = {"a": {"op": cost}, "b": {"op": cost}}
    log: list = []
    once = tune(["a", "b"], fake_prepare(clock, costs), ["op"], buckets=(1, 2), timer=clock, rounds=1, repeats=6)
    assert once.winners("op") == ["b", "b"]  # the drift decided
    n["calls"] = 0
    built: list[str] = []

    def counting_prepare(name: str):
        built.append(name)
        return fake_prepare(clock, costs, log=log)(name)

    both = tune(["a", "b"], counting_prepare, ["op"], buckets=(1, 2), timer=clock, rounds=2, repeats=6)
    assert both.winners("op") == ["a", "a"]
    assert both.seconds["op"]["a"] == both.seconds["op"]["b"] == [pytest.approx(3e-3)] * 2
    assert built == ["a", "b", "a"]  # b, at the turn, is timed twice on one build
    # 3 layers x (1 warm-up + 3 timed passes) per candidate, bucket and sweep
    assert sum(1 for name, _, rows in log if name == "a" and rows == 1) == 2 * 3 * 4


def test_an_op_a_candidate_cannot_run_never_goes_to_it():
    clock = FakeClock()
    costs = {"a": {"x": lambda r: 1.0, "y": lambda r: 1.0}, "b": {"x": lambda r: 0.1}}  # b cannot run y
    table = tune(["a", "b"], fake_prepare(clock, costs), ["x", "y"], buckets=(1, 2), timer=clock)
    assert table.winners("x") == ["b", "b"] and table.winners("y") == ["a", "a"]


def test_time_pass_drops_a_stall_per_call():
    clock = FakeClock()
    n = {"calls": 0}

    def call() -> None:
        n["calls"] += 1
        clock.now += 1.0 + (50.0 if n["calls"] in (3, 8) else 0.0)  # two different calls stalled once

    got = time_pass([("op", call), ("op", call), ("op", call)], repeats=3, timer=clock)
    assert got == {"op": 3.0}
    assert n["calls"] == 3 + 3 * 3  # one warm-up pass, then three timed


def test_drop_spikes():
    assert drop_spikes([1.0, 9.0, 2.0, 4.0]) == [1.0, 2.0, 2.0, 4.0]
    assert drop_spikes([1.2, 1.0, 3.0]) == [1.2, 1.0, 3.0]  # a small inversion is real, kept
    assert drop_spikes([1.0, math.inf, math.inf]) == [1.0, math.inf, math.inf]


def test_pick_one_uses_decode_sized_buckets_among_allowed():
    table = TuneTable(
        (1, 16, 64, 512),
        {"op": {"gemm": [2.0, 2.0, 2.0, 3.0], "gemv": [1.0, 1.5, 4.0, 100.0], "other": [0.1] * 4}},
        ("gemm", "gemv", "other"),
    )
    assert pick_one(table, ["gemm", "gemv"], decode_rows=16) == "gemv"  # 2.5 vs 4.0; 512 rows ignored
    assert pick_one(table, ["gemm", "gemv"], decode_rows=64) == "gemm"  # 6.5 vs 6.0
    assert pick_one(table, ["other", "gemv"]) == "other"
    table.pinned = "gemv"
    assert table.winners("op") == ["gemv"] * 4
    with pytest.raises(ValueError):
        pick_one(table, ["nope"])


def test_table_json_round_trip():
    table = TuneTable((1, 8), {"op": {"a": [1.0, math.inf], "b": [2.0, 0.5]}}, ("a", "b"), pinned=None)
    back = TuneTable.from_json(json.loads(json.dumps(table.to_json())))
    assert back == table and back.winners("op") == ["a", "b"]


def test_cache_hit_miss_and_key_change(tmp_path):
    key = {"cpu": "x", "flags": ["amx_bf16"], "torch": "2.13", "threads": 2, "ops": {"qkv": [960, 576, 30]}}
    path = autotune.cache_path(str(tmp_path / "sub"), "linear", key)
    assert autotune.load_cached(path, key) is None  # miss: nothing there yet
    table = TuneTable((1, 8), {"qkv": {"a": [1.0, 2.0], "b": [2.0, 1.0]}}, ("a", "b"))
    autotune.save_cached(path, key, table)
    assert autotune.load_cached(path, key) == table  # hit
    for change in ({"threads": 1}, {"flags": []}, {"torch": "2.14"}, {"ops": {"qkv": [960, 576, 24]}}):
        other = {**key, **change}
        other_path = autotune.cache_path(str(tmp_path / "sub"), "linear", other)
        assert other_path != path
        assert autotune.load_cached(path, other) is None  # a file for another key never passes for a hit
    assert not [p for p in (tmp_path / "sub").iterdir() if p.suffix == ".tmp"]


def test_unreadable_cache_is_a_miss(tmp_path):
    key = {"cpu": "x"}
    path = autotune.cache_path(str(tmp_path), "linear", key)
    with open(path, "w") as f:
        f.write("{not json")
    assert autotune.load_cached(path, key) is None
    with open(path, "w") as f:
        json.dump({"version": autotune.CACHE_VERSION + 1, "key": key, "table": {}}, f)
    assert autotune.load_cached(path, key) is None


def test_cpu_info():
    name, flags = autotune.cpu_info()
    assert name and list(flags) == sorted(flags)


def test_spread_flags_a_busy_machine():
    calls = [("a", lambda: None), ("b", lambda: None)]
    quiet = [[1.0, 2.0], [1.1, 2.0], [1.0, 2.2]]
    best, spread = autotune.per_op(calls, quiet)
    assert best == {"a": 1.0, "b": 2.0} and spread == pytest.approx(1.0)
    busy = [[1.0, 2.0], [5.0, 9.0], [6.0, 8.0]]  # most passes slowed
    assert autotune.per_op(calls, busy)[1] > autotune.NOISY


def test_tune_records_noise():
    clock = FakeClock()
    n = {"calls": 0}

    def cost(rows: int) -> float:
        n["calls"] += 1
        return 1e-3 * (1 if n["calls"] % 4 == 0 else 10)  # three calls of four stalled: the median is slow

    table = tune(["x"], fake_prepare(clock, {"x": {"op": cost}}), ["op"], buckets=(1, 2), timer=clock)
    assert table.noise > autotune.NOISY
    quiet = tune(["x"], fake_prepare(clock, {"x": {"op": lambda r: 1e-3}}), ["op"], buckets=(1, 2), timer=clock)
    assert quiet.noise == pytest.approx(1.0)
