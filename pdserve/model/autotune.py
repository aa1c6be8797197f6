"""Kernel choice by measurement: time named candidates on the model's own ops at a few row counts, pick
the fastest per row bucket, and keep the decision on disk so the next start on the same host is instant.

Pure Python (no torch) so the selection logic tests in milliseconds with a fake clock. The caller
(`linear.py`) knows how to build a candidate; this module only sees, per candidate and row count, one
"pass": the op calls of a whole forward in order, `[(op name, call), ...]`. Timing a whole pass rather
than one op in a loop matters on CPU: in a real step each layer's weights arrive cold from DRAM (the
model's weights are far larger than L2), and a kernel that wins with a hot weight can lose with a cold one.

A bucket `b` covers the row counts above the previous bucket up to `b`; rows beyond the last bucket use
the last. At run time the choice is one `bisect` on the row count, never a timing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROW_BUCKETS: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256, 512)
NOISY = 2.0  # a table measured with a larger spread is used but not cached (the next start measures again)
DECODE_ROWS = 64  # buckets up to this many rows count as decode-sized (the batch-invariant pick)
# Another kernel takes a bucket from the incumbent (the batch-invariant pick) only by more than this: each
# kernel chosen somewhere keeps its own copy of the weights (fp32 sgemm: twice bf16's bytes), which a
# per-op timing does not see, and near-ties are the host's noise. So the default is never more than this
# behind the incumbent pinned, per bucket. On an AVX2-only EPYC a cached table gave fp32 the 64-row
# bucket (and some ops at 256-512 rows) by 1-3%, and the offline run went at 0.93-0.98x the speed of
# `--linear-kernel pdserve` (session 24).
WIN_MARGIN = 0.05
CACHE_VERSION = 2  # bump when the table's meaning or its measurement changes: old files then miss (2: two sweeps)

Pass = Sequence[tuple[str, Callable[[], object]]]  # one forward's op calls, in order
Timer = Callable[[], float]


def bucket_index(rows: int, buckets: Sequence[int]) -> int:
    """The bucket whose range holds `rows` (the first bucket >= rows, else the last)."""
    return min(bisect_left(buckets, rows), len(buckets) - 1)


@dataclass(slots=True)
class TuneTable:
    """Seconds per full model pass of each op, per candidate and row bucket (inf: not timed or not
    available), and the winner per op and bucket. `pinned` names one kernel for every bucket."""

    buckets: tuple[int, ...]
    seconds: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # op -> candidate -> per bucket
    order: tuple[str, ...] = ()  # candidates in preference order (ties go to the earlier one)
    pinned: str | None = None
    noise: float = 1.0  # worst median/best spread of a timed pass: > NOISY means the machine was busy

    def winners(self, op: str) -> list[str]:
        if self.pinned is not None:
            return [self.pinned] * len(self.buckets)
        incumbent = pick_one(self, self.order) if self.order else None
        return pick_per_bucket(self.seconds[op], self.order, len(self.buckets), incumbent)

    def total_seconds(self, candidate: str) -> list[float]:
        """One full pass over every op, per bucket."""
        return [sum(t[candidate][i] for t in self.seconds.values() if candidate in t) for i in range(len(self.buckets))]

    def chosen_seconds(self) -> list[float]:
        """One full pass with each op's chosen kernel, per bucket."""
        out = [0.0] * len(self.buckets)
        for op, times in self.seconds.items():
            for i, name in enumerate(self.winners(op)):
                out[i] += times.get(name, [math.inf] * len(self.buckets))[i]
        return out

    def to_json(self) -> dict:
        def enc(v: float) -> float | None:
            return None if math.isinf(v) else v

        return {
            "buckets": list(self.buckets),
            "order": list(self.order),
            "pinned": self.pinned,
            "noise": self.noise,
            "seconds": {op: {c: [enc(v) for v in ts] for c, ts in t.items()} for op, t in self.seconds.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping) -> TuneTable:
        def dec(v: float | None) -> float:
            return math.inf if v is None else float(v)

        return cls(
            buckets=tuple(int(b) for b in d["buckets"]),
            seconds={op: {c: [dec(v) for v in ts] for c, ts in t.items()} for op, t in d["seconds"].items()},
            order=tuple(d["order"]),
            pinned=d["pinned"],
            noise=float(d.get("noise", 1.0)),
        )


def pick_per_bucket(times: Mapping[str, Sequence[float]], order: Sequence[str], num_buckets: int,
                    incumbent: str | None = None, margin: float = WIN_MARGIN) -> list[str]:
    """The fastest candidate per bucket (a tie goes to the earlier one in `order`), except that the
    `incumbent`, where given, keeps every bucket in which it is within `margin` of the fastest."""
    names = [c for c in order if c in times] or list(times)
    picks = []
    for i in range(num_buckets):
        best = min(names, key=lambda c: (times[c][i], names.index(c)))
        if incumbent in times and times[incumbent][i] <= times[best][i] * (1 + margin):
            best = incumbent
        picks.append(best)
    return picks


def pick_one(table: TuneTable, allowed: Sequence[str], decode_rows: int = DECODE_ROWS) -> str:
    """The one candidate of `allowed` with the least time summed over all ops at decode-sized buckets
    (rows <= decode_rows): what `--batch-invariant` pins."""
    upto = [i for i, b in enumerate(table.buckets) if b <= decode_rows] or [0]
    names = [c for c in table.order if c in allowed]
    if not names:
        raise ValueError(f"none of {list(allowed)} was timed")

    def cost(c: str) -> float:
        return sum(t.get(c, [math.inf] * len(table.buckets))[i] for t in table.seconds.values() for i in upto)

    return min(names, key=lambda c: (cost(c), names.index(c)))


def time_calls(calls: Pass, repeats: int, timer: Timer) -> list[list[float]]:
    """Seconds of each call in each of `repeats` passes, after one untimed pass that warms the
    allocator, the thread pool and lazy initialisation (oneDNN builds a primitive per new shape)."""
    for _, call in calls:
        call()
    out = []
    for _ in range(repeats):
        times = []
        for _, call in calls:
            t0 = timer()
            call()
            times.append(timer() - t0)
        out.append(times)
    return out


def time_pass(calls: Pass, repeats: int, timer: Timer) -> dict[str, float]:
    """Seconds per op over one pass: the best of `repeats` passes taken per call, summed per op. The
    best per call, not per pass: on a shared machine a descheduled thread stalls one call of one pass
    by milliseconds, and a minimum over passes drops it while still seeing each weight as cold as a
    real step does."""
    return per_op(calls, time_calls(calls, repeats, timer))[0]


def per_op(calls: Sequence[tuple[str, object]], times: list[list[float]]) -> tuple[dict[str, float], float]:
    """(best seconds per op, how disturbed the passes were): the second is the pass's summed median per
    call over its summed best per call; near 1 on a quiet machine, several when other processes held
    the cores through most passes (then even the best is suspect)."""
    best: dict[str, float] = {}
    total_best = total_median = 0.0
    for j, (op, _) in enumerate(calls):
        ts = sorted(t[j] for t in times)
        best[op] = best.get(op, 0.0) + ts[0]
        total_best += ts[0]
        total_median += ts[len(ts) // 2]
    return best, (total_median / total_best if total_best > 0 else 1.0)


def drop_spikes(times: Sequence[float], ratio: float = 1.5) -> list[float]:
    """More rows never take a kernel less time, so a bucket measured `ratio` times slower than a larger
    bucket was disturbed (another process held a core for the whole window): it takes the larger
    bucket's time instead. Smaller differences stay (a kernel's small-row path may really be slower)."""
    out = list(times)
    floor = math.inf
    for i in range(len(out) - 1, -1, -1):
        if out[i] > ratio * floor:
            out[i] = floor
        floor = min(floor, out[i])
    return out


def tune(
    candidates: Sequence[str],
    prepare: Callable[[str], Callable[[int], Pass]],
    ops: Sequence[str],
    buckets: Sequence[int] = ROW_BUCKETS,
    repeats: int = 5,
    timer: Timer = time.perf_counter,
    give_up: float = 2.0,
    rounds: int = 2,
) -> TuneTable:
    """Time every candidate at every bucket. `prepare(name)` builds a candidate (packs its weights) and
    returns `pass_for(rows)`; the candidate is dropped before the next is built, so at most one extra
    copy of the weights exists at a time.

    A shared host's speed drifts: a neighbour takes memory bandwidth for tens of seconds, and a candidate
    timed only inside such a window loses to one timed outside it (host G, session 26: the same one-row
    pass over a 1.5B model's weights took 44-75 ms within minutes, and which of two kernels was faster
    depended on the stretch; docs/architecture.md, "How kernels are chosen"). So
    the candidates are timed in `rounds` sweeps, each in the reverse order of the one before (a, b, c,
    then c, b, a: the candidate at the turn is not rebuilt), `ceil(repeats / rounds)` passes per sweep,
    and a cell keeps each call's best over all sweeps.

    A candidate that is `give_up` times slower than the best already timed on every op at two buckets in
    a row (in the first sweep) is not timed at larger ones (its time only grows relative to a
    compute-bound kernel's), which keeps a first start short. An op missing from a candidate's pass (it
    cannot run that shape) counts as inf. The table's `noise` is the worst median-over-best spread of any
    sweep's passes (`per_op`)."""
    n = len(buckets)
    per_round = max(1, math.ceil(repeats / max(1, rounds)))
    first: dict[str, dict[str, list[float]]] = {op: {} for op in ops}  # the first sweep's times (give_up)
    timed: dict[str, int] = {}  # buckets the first sweep timed per candidate
    passes: dict[tuple[str, int], list[list[float]]] = {}  # (candidate, bucket) -> every pass's call times
    names: dict[tuple[str, int], list[tuple[str, None]]] = {}  # (candidate, bucket) -> the pass's ops
    noise = 1.0
    current: tuple[str, Callable[[int], Pass]] | None = None
    for r in range(max(1, rounds)):
        for name in candidates if r % 2 == 0 else candidates[::-1]:
            if current is None or current[0] != name:
                current = None  # the previous candidate's packed weights go before the next is built
                current = (name, prepare(name))
            pass_for = current[1]
            row = {op: [math.inf] * n for op in ops}  # the first sweep's, for give_up
            behind = 0
            for i in range(n if r == 0 else timed[name]):
                calls = pass_for(buckets[i])
                times = time_calls(calls, per_round, timer)
                best, spread = per_op(calls, times)
                noise = max(noise, spread)
                passes.setdefault((name, i), []).extend(times)
                names[(name, i)] = [(op, None) for op, _ in calls]
                del calls
                if r > 0:
                    continue
                timed[name] = i + 1
                for op, sec in best.items():
                    row[op][i] = sec
                best_other = {op: min((t[i] for t in first[op].values()), default=math.inf) for op in ops}
                slow = all(row[op][i] >= give_up * best_other[op] for op in ops)
                behind = behind + 1 if slow else 0
                if behind >= 2:
                    break
            if r == 0:
                for op in ops:
                    first[op][name] = row[op]
    current = None
    seconds: dict[str, dict[str, list[float]]] = {op: {} for op in ops}
    for name in candidates:
        row = {op: [math.inf] * n for op in ops}
        for i in range(timed[name]):
            for op, sec in per_op(names[(name, i)], passes[(name, i)])[0].items():
                row[op][i] = sec
        for op in ops:
            seconds[op][name] = drop_spikes(row[op])
    return TuneTable(tuple(buckets), seconds, tuple(candidates), noise=noise)


# --- the on-disk cache ----------------------------------------------------------------------------


def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(model name, sorted flags) of this CPU, from /proc/cpuinfo where there is one."""
    name, flags = "", ()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not name and line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif not flags and line.startswith(("flags", "Features")):
                    flags = tuple(sorted(line.split(":", 1)[1].split()))
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def cache_path(cache_dir: str, kind: str, key: Mapping) -> str:
    """`<cache_dir>/<kind>-<digest of the key>.json`: a different host, torch, thread count or model
    shape is a different file."""
    digest = hashlib.sha256(json.dumps({"v": CACHE_VERSION, **key}, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{kind}-{digest}.json")


def load_cached(path: str, key: Mapping) -> TuneTable | None:
    """The cached table at `path` if it was written for exactly `key`; None when absent, unreadable or
    for another key (a digest collision or an edited file never passes for a hit)."""
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("version") != CACHE_VERSION or d.get("key") != json.loads(json.dumps(key)):
            return None
        return TuneTable.from_json(d["table"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable kernel autotune cache %s (%s)", path, e)
        return None


def save_cached(path: str, key: Mapping, table: TuneTable) -> None:
    """Write atomically (temp file + rename) so a concurrent start never reads half a file; a read-only
    cache directory only costs the next start a re-measurement."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": CACHE_VERSION, "key": key, "table": table.to_json()}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write the kernel autotune cache %s (%s)", path, e)


def format_table(table: TuneTable, label: str = "rows") -> str:
    """Rows: buckets (`label` names what a bucket counts). Columns: ms per full pass for each candidate,
    then the kernel chosen per op."""
    ops = list(table.seconds)
    cands = list(table.order)
    head = f"{label:>5} " + " ".join(f"{c + ' ms':>11}" for c in cands) + f" {'chosen ms':>10}  " + " ".join(
        f"{op:>8}" for op in ops
    )
    lines = [head]
    totals = {c: table.total_seconds(c) for c in cands}
    chosen = table.chosen_seconds()
    winners = {op: table.winners(op) for op in ops}

    def ms(v: float) -> str:
        return f"{'-':>11}" if math.isinf(v) else f"{1e3 * v:>11.2f}"

    for i, b in enumerate(table.buckets):
        cells = " ".join(ms(totals[c][i]) for c in cands)
        picks = " ".join(f"{winners[op][i]:>8}" for op in ops)
        lines.append(f"{b:>5} {cells} {ms(chosen[i]):>10}  {picks}")
    return "\n".join(lines)
