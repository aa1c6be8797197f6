"""Serving-benchmark metrics from per-request traces, computed the way vLLM's `bench serve` and DistServe do.

The client fills one `RequestRecord` per request: when it was due, when it was sent, the time of every
streamed chunk that carried a token, when the stream ended, and the server's token counts. Times are
seconds on one monotonic clock (the client's). `compute_metrics` turns a run's records into the summary
table: TTFT, TPOT, ITL and E2E latency distributions, throughputs, and goodput against an `SLO`.

Pure Python and numpy: no torch, no network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    req_id: int
    prompt_len: int  # tokens: the server's usage.prompt_tokens when it sent usage, else the dataset's count
    requested_output_len: int  # max_tokens asked for
    arrival_time: float  # when the arrival process made the request due
    send_time: float = 0.0  # when the HTTP request went out (later than arrival under --max-concurrency)
    # One per streamed chunk that carried choices. Usually one per token, but a server that holds back text
    # (a partial UTF-8 character, a possible stop string) sends several tokens in one chunk, so
    # len(token_times) <= output_len. ITL is therefore per chunk, as in vLLM's benchmark; TPOT uses output_len.
    token_times: list[float] = field(default_factory=list)
    end_time: float = 0.0  # when the stream ended ([DONE] or connection closed)
    output_len: int = 0  # tokens: usage.completion_tokens, or the number of chunks without usage
    usage_reported: bool = False  # whether output_len came from the server's usage chunk
    output_text: str = ""  # the streamed text, concatenated
    # output_text re-encoded by the served model's tokenizer when the benchmark has it (None otherwise):
    # a check on the server's count. Re-encoding can merge or split tokens, so a few mismatches are normal.
    tokenizer_output_len: int | None = None
    success: bool = False
    error: str = ""
    # The latency targets this request carried to the server (`--slo-classes`), which it is judged by;
    # None: the run's `--slo`.
    slo: SLO | None = None

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first streamed token."""
        return self.token_times[0] - self.send_time

    @property
    def latency(self) -> float:
        """Seconds from sending to the end of the stream (E2E latency)."""
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None for requests with a single output token."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed tokens, in seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets in milliseconds; None means no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None

    def is_met_by(self, rec: RequestRecord) -> bool:
        """Whether a request meets every target given.

        - TTFT: `ttft <= ttft_ms`.
        - TPOT: the request's mean TPOT (see `RequestRecord.tpot`) `<= tpot_ms`; a request with one output
          token has no TPOT and passes.
        - ITL: *every* gap between the request's consecutive tokens `<= itl_ms`, i.e. its worst stall;
          stricter than TPOT, which averages stalls away. A request with one token passes.

        A failed request meets no SLO.
        """
        if not rec.success or not rec.token_times:
            return False
        if self.ttft_ms is not None and rec.ttft * 1000.0 > self.ttft_ms:
            return False
        tpot = rec.tpot
        if self.tpot_ms is not None and tpot is not None and tpot * 1000.0 > self.tpot_ms:
            return False
        itls = rec.itls
        if self.itl_ms is not None and itls and max(itls) * 1000.0 > self.itl_ms:
            return False
        return True


def parse_slo(text: str) -> SLO:
    """Parse `ttft=MS,tpot=MS,itl=MS` (any subset, any order) into an `SLO`."""
    values: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "itl"):
            raise ValueError(f"bad SLO item {part!r}: expected ttft=MS, tpot=MS or itl=MS")
        if key in values:
            raise ValueError(f"SLO item {key!r} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO value in {part!r}: expected milliseconds") from None
        if not ms > 0:
            raise ValueError(f"SLO target must be > 0 ms, got {part!r}")
        values[key] = ms
    if not values:
        raise ValueError("empty SLO: give at least one of ttft=MS, tpot=MS, itl=MS")
    return SLO(values.get("ttft"), values.get("tpot"), values.get("itl"))


def parse_slo_classes(text: str) -> list[tuple[SLO, float]]:
    """Parse request classes `SLO[@weight];SLO[@weight]...` (weights default to 1), e.g.
    `ttft=300,itl=50@1;ttft=5000,tpot=200@3`: a quarter interactive, three quarters batch."""
    classes: list[tuple[SLO, float]] = []
    for part in text.split(";"):
        if not part.strip():
            continue
        spec, sep, weight = part.partition("@")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"bad SLO class weight in {part!r}: expected a number") from None
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"SLO class weight must be > 0, got {part!r}")
        classes.append((parse_slo(spec), w))
    if not classes:
        raise ValueError("no SLO classes: give SLO[@weight];SLO[@weight]...")
    return classes


def assign_slo_classes(classes: list[tuple[SLO, float]], num_requests: int, seed: int) -> list[SLO]:
    """Each request's class, drawn with the classes' weights (seeded: the same run sends the same mix)."""
    rng = np.random.default_rng(seed)
    weights = np.array([w for _, w in classes])
    picks = rng.choice(len(classes), size=num_requests, p=weights / weights.sum())
    return [classes[i][0] for i in picks]


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of a latency sample, in milliseconds (all zero for an empty sample)."""

    mean: float
    median: float
    p90: float
    p99: float
    count: int
    # The tail that p99 hides: a prompt that stalls every running stream for one long step is a handful
    # of gaps among tens of thousands (see docs/scheduling.md).
    p999: float = 0.0
    max: float = 0.0

    @staticmethod
    def of_seconds(values: list[float]) -> Distribution:
        if not values:
            return Distribution(0.0, 0.0, 0.0, 0.0, 0)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        # Linear interpolation between order statistics: numpy's default, as vLLM's benchmark uses.
        p50, p90, p99, p999 = np.percentile(ms, (*PERCENTILES, 99.9))
        return Distribution(
            float(ms.mean()), float(p50), float(p90), float(p99), len(values), float(p999), float(ms.max())
        )


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int  # over completed requests
    total_output_tokens: int  # over completed requests
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    slo: SLO | None
    num_good: int | None  # requests meeting every SLO target (None without an SLO)
    goodput: float | None  # good requests / s
    slo_attainment: float | None  # percent of all requests (failures count as misses)
    # completed requests whose output_len differs from the tokenizer's count (None: not counted)
    output_len_mismatches: int | None = None


def compute_metrics(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> BenchMetrics:
    """Summarize a run. `duration_s` is its wall time, from the start to the end of the last stream.

    TTFT, TPOT, ITL and E2E come from completed requests only. TPOT is per request and only for requests
    with more than one output token; ITL pools every gap of every request. Goodput is the number of
    completed requests that meet every target of `slo` (see `SLO.is_met_by`) divided by `duration_s`;
    SLO attainment is that number over all requests sent, in percent. A record that carries its own
    `slo` (sent with per-request targets) is judged by it instead of `slo`. Output-length mismatches are
    counted over the completed requests that carry a `tokenizer_output_len`.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itls]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    num_good = goodput = attainment = None
    if slo is not None or any(r.slo is not None for r in records):
        num_good = sum(_slo_of(r, slo).is_met_by(r) for r in done)
        goodput = num_good / duration_s
        attainment = 100.0 * num_good / len(records) if records else 0.0
    counted = [r for r in done if r.tokenizer_output_len is not None]
    mismatches = sum(r.tokenizer_output_len != r.output_len for r in counted) if counted else None
    return BenchMetrics(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=Distribution.of_seconds([r.ttft for r in done]),
        tpot=Distribution.of_seconds(tpots),
        itl=Distribution.of_seconds(itls),
        e2el=Distribution.of_seconds([r.latency for r in done]),
        slo=slo,
        num_good=num_good,
        goodput=goodput,
        slo_attainment=attainment,
        output_len_mismatches=mismatches,
    )


@dataclass(frozen=True, slots=True)
class SpecDecodeCounters:
    """A server's cumulative speculative-decoding counters at one scrape of `/metrics` (pdserve's
    `pdserve:spec_decode_*`, vLLM's `vllm:spec_decode_*`): verification steps that ran drafts, draft
    tokens verified, drafts accepted, and drafts accepted at each position of a draft."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...] = ()

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        """The counts of the interval since `before` (a position absent from `before` counted 0 then)."""
        pos = [
            n - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
            for i, n in enumerate(self.accepted_per_pos)
        ]
        return SpecDecodeCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(pos),
        )


@dataclass(frozen=True, slots=True)
class SpecDecodeMetrics:
    """Acceptance over one run, as vLLM defines it: acceptance rate = accepted / draft tokens; mean
    acceptance length = 1 + accepted / drafts (tokens each verification step yields, its own token
    included); per-position acceptance [i] = drafts accepted at position i / drafts."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    per_position_acceptance: list[float]


def spec_decode_metrics(delta: SpecDecodeCounters) -> SpecDecodeMetrics | None:
    """The acceptance of a run whose counters moved by `delta`; None when it ran no drafts (speculation
    off, or no draft ever proposed), so a report says nothing rather than a rate of 0/0."""
    if delta.num_drafts <= 0 or delta.num_draft_tokens <= 0:
        return None
    return SpecDecodeMetrics(
        num_drafts=delta.num_drafts,
        num_draft_tokens=delta.num_draft_tokens,
        num_accepted_tokens=delta.num_accepted_tokens,
        acceptance_rate=delta.num_accepted_tokens / delta.num_draft_tokens,
        mean_acceptance_length=1.0 + delta.num_accepted_tokens / delta.num_drafts,
        per_position_acceptance=[n / delta.num_drafts for n in delta.accepted_per_pos],
    )


def _slo_of(rec: RequestRecord, slo: SLO | None) -> SLO:
    """The targets `rec` is judged by: its own, else the run's (no targets: every request is good)."""
    return rec.slo if rec.slo is not None else (slo if slo is not None else SLO())
