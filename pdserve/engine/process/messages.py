"""What the HTTP front and the engine core process say to each other over ZMQ, as msgpack-encoded
msgspec structs. Front -> core: `AddRequest`, `AbortRequests`, `Shutdown`. Core -> front: `Ready` once,
then `EngineOutputs` after every step (and after aborts, so freed blocks show up in the stats at once).

Timestamps are `time.monotonic()`, which is one clock for all processes of a host (CLOCK_MONOTONIC).
"""

from __future__ import annotations

import msgspec

from pdserve.request import SamplingParams


class KVTransferParams(msgspec.Struct, array_like=True):
    """Disaggregation: send this prompt's KV to `address` (remote_decode, on a prefill instance) or
    reserve blocks and receive it (on a decode instance)."""

    transfer_id: str
    remote_decode: bool
    address: str = ""
    skip_tokens: int = 0


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    kv_transfer: KVTransferParams | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    max_model_len: int
    vocab_size: int
    num_kv_tokens: int  # num_blocks * block_size: no request may need more
    block_size: int
    num_threads: int
    role: str = "both"
    kv_backend: str | None = None
    kv_address: str | None = None  # where this instance receives KV


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one request: the tokens and text it added, and how it ended if it did."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None  # one entry per new token, when asked for
    error: str | None = None
    invalid: bool = False  # the engine refused the request (a 400 for its client), nothing ran
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (final delta)
    rejected: bool = False  # the `slo` policy refused the request (a 503 for its client), nothing ran
    kv_skip_tokens: int | None = None  # blocks reserved for a remote prefill: prompt tokens held already
    # With prompt_logprobs, on the request's first delta with tokens: RequestOutput.prompt_logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None


class StepStats(msgspec.Struct, array_like=True):
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    predicted_duration: float | None = None  # the policy's step-time model's prediction for this step, if any


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative, like the counters below
    num_prefix_hit_tokens: int
    num_prefix_queried_tokens: int
    # The scheduling policy's own numbers (`Policy.stats()`: series name -> value, counters cumulative),
    # exported by the front without knowing which policy sent them.
    policy_stats: dict[str, float] = {}
    # Swap preemption: requests whose KV waits in the host tier now, and cumulative blocks copied.
    num_swapped: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    # Messages dropped because they did not decode (cumulative): on the KV transport's sockets, and
    # from the front.
    num_dropped_kv_messages: int = 0
    num_dropped_front_messages: int = 0
    # Speculative decoding (cumulative; pdserve.spec.SpecDecodeStats): verification steps with drafts,
    # draft tokens run, drafts accepted, and accepted drafts by position.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # The length rule's choices (requests that could get drafts) and the draft tokens it asked for.
    num_spec_length_choices: int = 0
    num_spec_chosen_tokens: int = 0


class TransferStats(msgspec.Struct, array_like=True):
    direction: str  # "send" | "receive"
    ok: bool
    num_tokens: int
    num_bytes: int
    duration: float


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    deltas: list[RequestDelta]
    stats: EngineStats
    step: StepStats | None = None  # the step that produced these deltas, if one ran
    transfers: list[TransferStats] = []  # KV transfers that ended since the last message


FrontMessage = AddRequest | AbortRequests | Shutdown
CoreMessage = Ready | EngineOutputs
