"""Requests and their sampling parameters.

A request is counters, not phases: it is "in prefill" while `num_computed_tokens` trails the prompt and
"decoding" once only its latest sampled token is left to compute. With speculative decoding it also
carries draft tokens (`spec_token_ids`) proposed for its next step; the scheduler's catch-up target is
then `num_tokens_with_spec`, and a step accepts 1..k+1 tokens. The scheduler is the only component
that changes a request's status; the runner only reads requests through the `Batch` it is given.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError
from pdserve.structured import Grammar, StructuredOutputs


# Bounds on what one request may ask of the sampler (each entry of logit_bias is work on every step).
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed, waiting to be recomputed
    SWAPPED = "swapped"  # KV parked in the host tier, waiting to be copied back
    SENDING_KV = "sending_kv"
    WAITING_FOR_KV = "waiting_for_kv"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # failed inside the engine; its blocks were freed


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; the field names and defaults follow vLLM's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    # Penalties on tokens the sequence already holds (vLLM's semantics, applied before greedy and random
    # choice alike): presence and frequency subtract `presence` once and `frequency` per occurrence from
    # the logits of tokens in the output; repetition divides positive logits and multiplies negative ones
    # of tokens in the prompt or the output. `logit_bias` adds to the logits of the tokens given (OpenAI's).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # No EOS (unless ignore_eos) or stop_token_ids before this many output tokens (vLLM's): their logits are
    # -inf until then, and stop strings are looked for only from then on.
    min_tokens: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    # The prompt's own logprobs (vLLM's name): for each prompt token after the first, its logprob given
    # the tokens before it and this many top alternatives. Its prompt is computed whole (no prefix-cache
    # hits), as eval harnesses score continuations (`echo` in the OpenAI server).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output follows a JSON schema, a regex, a choice or a grammar (pdserve/structured.py).
    structured_outputs: StructuredOutputs | None = None
    # This request's latency targets in milliseconds; None: the engine's (SchedulerConfig.slo_ttft_ms /
    # slo_itl_ms, SpeculativeConfig.slo_tpot_ms). Only the `slo` policy (EDF deadline, rejection, the
    # step's ITL budget) and the slack speculation-length rule act on them; other policies ignore them.
    # Here rather than in a value of their own: SamplingParams already travels with the request through
    # every boundary (front -> core message, Batch), validated in one place, and vLLM's servers take
    # extra per-request fields the same way.
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed by the sequence's own tokens, a bias or min_tokens before
        choosing."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise bad(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0.0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        v = self.min_tokens
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= self.max_tokens:
            raise bad(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2.0 <= v <= 2.0):
                raise bad(f"{name} must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if not (_is_number(v) and v > 0.0):
            raise bad(f"repetition_penalty must be a positive number, got {v!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise bad(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, b in bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad(f"logit_bias keys must be non-negative token ids, got {t!r}")
                if not (_is_number(b) and -100.0 <= b <= 100.0):
                    raise bad(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise bad("structured_outputs must be a StructuredOutputs")
            self.structured_outputs.validate()
        for name in ("slo_ttft_ms", "slo_itl_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            if v is not None and not ok:
                raise bad(f"{name} must be a positive finite number of milliseconds, got {v!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError unless every token id the parameters name is in the vocabulary (the
        sampler indexes logits with `logit_bias`' keys)."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size})")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(slots=True)
class Request:
    """One sequence being served. `prompt_token_ids + output_token_ids` are all its tokens."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 0  # the sequence stops with LENGTH when it reaches this many tokens (0: no limit)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed for the next step (not part of the sequence until a step verifies them).
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at (last) admission
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)  # while swapped: where its KV waits on the host
    num_preemptions: int = 0
    # Disaggregation: this instance computes the prompt and the first token and the KV goes to a decode
    # instance (remote_decode), or the KV and first token come from a prefill instance (remote_prefill).
    remote_decode: bool = False
    remote_prefill: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    # Timestamps (time.monotonic) for metrics; filled by the scheduler and the engine.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Per-token logprobs, when params.logprobs is set: one dict {token_id: logprob} per output token.
    logprobs: list[dict[int, float]] | None = None
    # When params.prompt_logprobs is set: one dict per prompt token scored so far, from the second on.
    prompt_logprobs: list[dict[int, float]] | None = None
    # When params.structured_outputs is set: the constraint in progress (the engine loop compiles it).
    grammar: Grammar | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """What the next step may compute up to: the sequence plus its draft tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        """Past its prompt with only its latest sampled token left to compute."""
        return not self.is_prefill and self.num_tokens - self.num_computed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_id_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without copying the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True, slots=True)
class LatencyTargets:
    """A request's latency targets in seconds once resolved against the engine's defaults (None: no
    target on that metric), and how a finished request is judged against them. The judging follows the
    serving benchmark's `SLO.is_met_by` (`pdserve/bench/metrics.py`): TTFT from arrival, TPOT as the mean
    after the first token, ITL as the worst gap between two outputs (a step that delivers several
    speculated tokens at once is one output)."""

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None

    @classmethod
    def resolve(
        cls, params: SamplingParams, ttft: float | None, itl: float | None, tpot: float | None
    ) -> LatencyTargets:
        """`params`' own targets where set, else the given engine defaults (seconds or None)."""

        def pick(own_ms: float | None, default: float | None) -> float | None:
            return default if own_ms is None else own_ms / 1e3

        p = params
        return cls(pick(p.slo_ttft_ms, ttft), pick(p.slo_itl_ms, itl), pick(p.slo_tpot_ms, tpot))

    @property
    def is_empty(self) -> bool:
        return self.ttft is None and self.itl is None and self.tpot is None

    def results(self, ttft: float, max_itl: float | None, tpot: float | None) -> dict[str, bool]:
        """Per target the request had ("ttft", "itl", "tpot", and "all" when it had any): whether the
        measured figures (seconds; None: fewer than two outputs, which passes) met it."""
        out: dict[str, bool] = {}
        if self.ttft is not None:
            out["ttft"] = ttft <= self.ttft
        if self.itl is not None:
            out["itl"] = max_itl is None or max_itl <= self.itl
        if self.tpot is not None:
            out["tpot"] = tpot is None or tpot <= self.tpot
        if out:
            out["all"] = all(out.values())
        return out
