"""All configuration, as frozen keyword-only dataclasses validated once at construction. Components
receive only the piece they need. Each default is written once, here: the CLI (`cli.py`, `bench/commands.py`)
and `LLM(...)` read theirs with `field_default`. This module and `cli.py` are the only places that read
the environment.

The names of what registries further up provide (policies, backends, transports) are spelled here as
tuples, so this module imports nothing above it; `tests/unit/test_layering.py` holds each tuple equal to
its registry's keys."""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its factory called), for the CLI and `LLM(...)`, so
    a default is written only in its dataclass. KeyError for a field without a default."""
    f = next((f for f in fields(cls) if f.name == name), None)
    if f is None:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def add_config_argument(
    parser: argparse._ActionsContainer, flag: str, cls: type, name: str, *, help: str | None = None, **kwargs: Any
) -> None:
    """`parser.add_argument(flag, ...)` with `default=` read from dataclass field `cls.name` (so the CLI
    never spells a default again), `type=` that of the default unless given (or `choices` are), and the
    default appended to the help text when there is one to show."""
    default = field_default(cls, name)
    if "type" not in kwargs and "choices" not in kwargs and not isinstance(default, (str, bool, type(None))):
        kwargs["type"] = type(default)
    if default is not None and "default" not in (help or ""):
        help = f"{help} (default: %(default)s)" if help else "default: %(default)s"
    parser.add_argument(flag, default=default, help=help, **kwargs)


def default_model_cache_dir() -> str:
    """Where models assembled from PyPI part packages are kept (`model/registry.py`):
    $PDSERVE_MODEL_CACHE, else $XDG_CACHE_HOME/pdserve/models, else ~/.cache/pdserve/models."""
    explicit = os.environ.get("PDSERVE_MODEL_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "pdserve", "models")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2), as read from a GGUF file or a Hugging
    Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"  # "llama" | "qwen2": the same block, told apart by the flags below
    attention_bias: bool = False  # q, k and v projections have biases (Qwen2); o never has one

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bytes at 2 bytes per element (bf16/fp16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3", "int4")
# int8 / fp8 caches: per-channel powers of two for the keys, folded into the q/k projections
# (model/key_scales.py). auto: the layers where a calibration shows they help; on: every layer; off: none.
KV_KEY_SCALING = ("auto", "on", "off")


def default_block_size(device_type: str, kv_cache_dtype: str = "auto") -> int:
    """Tokens per KV block when none is asked for: 128 on a CPU, 16 elsewhere. A CPU's decode attention
    reads every sequence's blocks scattered over gigabytes of cache; a 16-token block of one kv head is
    2 KiB (head_dim 64, bf16), too short for the hardware prefetchers, and 128-token blocks (16 KiB) ran
    the 200-request ShareGPT benchmark 6.5% faster (README, "Performance"). vLLM's CPU backend defaults
    to 128 too; GPUs keep vLLM's 16 (finer prefix sharing, less padding). An int4 cache keeps 16: each
    running sequence holds up to two unquantized open blocks (docs/kv_quantization.md), and at 128
    tokens that pool would outweigh what int4 saves."""
    return 128 if device_type == "cpu" and kv_cache_dtype != "int4" else 16


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    block_size: int | None = None  # None: default_block_size(the engine's device)
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    swap_space_gb: float = 4.0  # host-memory tier for swapped-out KV (only with preemption_mode "swap")
    # How K/V are stored (kv/quant.py): "auto" is the model's dtype; int8 and fp8_e4m3 keep one float32
    # scale per token and kv head; int4 (kv/int4.py, KIVI: keys per channel within a block, values per
    # token, the newest tokens kept unquantized until their block fills; not with disaggregation yet).
    kv_cache_dtype: str = "auto"
    kv_key_scaling: str = "auto"  # int8 / fp8 only: KV_KEY_SCALING

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.swap_space_gb < 0:
            raise ValueError("swap_space_gb must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from {list(KV_CACHE_DTYPES)}")
        if self.kv_key_scaling not in KV_KEY_SCALING:
            raise ValueError(f"unknown kv_key_scaling {self.kv_key_scaling!r}; choose from {list(KV_KEY_SCALING)}")


PREEMPTION_MODES = ("recompute", "swap")
# The names config accepts for the registries that live further up: scheduler/policies.py's POLICIES,
# transfer/registry.py's TRANSPORTS, attention/base.py's ATTENTION_BACKENDS, router/policies.py's POLICIES
# and model/linear.py's LINEAR_KINDS (tests/unit/test_layering.py holds them equal).
SCHEDULER_POLICIES = ("prefill-first", "chunked", "decode-priority", "slo")
KV_TRANSFER_BACKENDS = ("inproc", "shm", "tcp", "torch.distributed")
ATTENTION_BACKENDS = ("torch", "torch-compiled", "cpu-paged")  # and "auto": see LLMEngine
LINEAR_KERNELS = ("auto", "pdserve", "amx", "onednn", "fp32", "torch")
ROUTER_POLICIES = ("round-robin", "least-outstanding-tokens", "least-kv-usage")
WEIGHT_DTYPES = ("auto", "bfloat16", "int8", "w8a8")  # auto: the model dtype; int8, w8a8: model/linear.py
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 (engine/llm_engine.py resolve_dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    policy: str = "chunked"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    chunk_size: int | None = None  # largest prompt chunk per request per step (None: the budget)
    # When KV blocks run out, the most recently admitted running request gives its blocks up and is
    # recomputed later ("recompute"), or its KV is copied to the host tier and back ("swap"; it falls
    # back to recompute when the host tier is full).
    preemption_mode: str = "recompute"
    # decode-priority: prefills pause while this many decodes run, or while the oldest decode has gone
    # more than max_wait_steps steps without a token; at most max_decode_steps such steps in a row.
    decode_priority_max_decodes: int = 64
    decode_priority_max_wait_steps: int = 1
    decode_priority_max_decode_steps: int = 8
    # slo: prompt tokens per step are sized by a step-time model fitted online so a step stays under
    # slo_itl_ms beside the running decodes (but at least slo_min_chunk), prompts go earliest deadline
    # (arrival + slo_ttft_ms) first; slo_reject refuses requests predicted to miss their TTFT or to push
    # decode steps past slo_itl_ms. slo_step_model_prior: the model's starting coefficients in seconds
    # (base, per prefill token, per decode sequence, per context token); None: its defaults.
    # slo_ttft_ms / slo_itl_ms are the defaults of requests that carry no targets of their own
    # (SamplingParams.slo_ttft_ms / slo_itl_ms; docs/scheduling.md).
    slo_ttft_ms: float = 500.0
    slo_itl_ms: float = 50.0
    slo_min_chunk: int = 32
    slo_reject: bool = False
    slo_step_model_prior: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; choose from {list(PREEMPTION_MODES)}")
        if self.decode_priority_max_decodes < 1 or self.decode_priority_max_decode_steps < 1:
            raise ValueError("decode_priority_max_decodes and decode_priority_max_decode_steps must be >= 1")
        if self.decode_priority_max_wait_steps < 0:
            raise ValueError("decode_priority_max_wait_steps must be >= 0")
        if not (self.slo_ttft_ms > 0 and self.slo_itl_ms > 0):
            raise ValueError("slo_ttft_ms and slo_itl_ms must be > 0")
        if self.slo_min_chunk < 1:
            raise ValueError("slo_min_chunk must be >= 1")
        prior = self.slo_step_model_prior
        if prior is not None and (len(prior) != 4 or any(not v >= 0 for v in prior)):
            raise ValueError(f"slo_step_model_prior must be 4 non-negative numbers, got {prior!r}")
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"unknown scheduler policy {self.policy!r}; choose from {sorted(SCHEDULER_POLICIES)}")


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    """Prefill/decode disaggregation: this instance's role and how its KV moves (docs/disaggregation.md).
    `both` serves ordinary requests and may also send or receive KV; `prefill` only computes prompts for
    decode instances (and ordinary requests); `decode` only receives prompts' KV (and ordinary requests)."""

    role: str = "both"
    backend: str | None = None  # inproc | shm | tcp | torch.distributed; None: no transfers
    host: str = "127.0.0.1"  # tcp: interface to listen on for KV (and the address peers are given)
    port: int = 0  # tcp: 0 picks a free port
    ack_timeout_s: float = 10.0  # prefill side: how long after the first token the decode side may take to ack
    lease_s: float = 120.0  # decode side: how long reserved blocks wait for the prompt's KV
    verify: bool = False  # checksum every chunk on every backend (tcp always does)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose from {list(ROLES)}")
        if self.role != "both" and self.backend is None:
            raise ValueError(f"role {self.role!r} needs a KV transfer backend")
        if self.ack_timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("ack_timeout_s and lease_s must be > 0")
        if self.backend is not None and self.backend not in KV_TRANSFER_BACKENDS:
            raise ValueError(f"unknown KV transfer backend {self.backend!r}; choose from {sorted(KV_TRANSFER_BACKENDS)}")


SPEC_METHODS = ("ngram", "draft")  # draft: a smaller model of the same tokenizer (spec/draft.py)
SPEC_LENGTH_RULES = ("slack", "acceptance")  # spec/length.py


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` convention (docs/speculative.md).

    `ngram`: prompt lookup, the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
    matched against the request's earlier tokens, the tokens that followed proposed as drafts.
    Each request's speculation length adapts (0..num_speculative_tokens) to its measured acceptance and,
    with the `slo` policy's step-time model (`length_rule` "slack"), to what a verified draft costs the
    step and to the requests' latency targets; steps past `disable_by_batch_size` requests or
    `disable_by_num_tokens` tokens propose none (verification is no longer nearly free once the step is
    compute-bound).

    `draft`: the model `model` (a registered name or a path; same tokenizer as the target) proposes
    greedily from its own KV cache of `draft_kv_cache_memory_gb`, on the target's device and dtype."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model ("draft" method)
    # Compute-bound guard: steps of more requests or more tokens (prompt chunks, decodes and drafts)
    # propose none. None: 32 and 512 under the acceptance rule, no cap where the slack rule runs (the
    # step-time model decides); a number caps either rule.
    disable_by_batch_size: int | None = None
    disable_by_num_tokens: int | None = None
    # Adaptivity: a request's acceptance rate a (EMA over its verified drafts, weight `acceptance_ema`)
    # sets its length to the largest k with a**k >= min_draft_acceptance (the k-th draft is accepted
    # with probability about a**k); at least 1 while it is worth probing.
    acceptance_ema: float = 0.3
    min_draft_acceptance: float = 0.25
    adaptive: bool = True
    # The draft model ("draft" method): its KV cache's memory, and a draft step's time as a fraction of a
    # target step's (None: the ratio of the models' weight bytes, decode being memory-bound); the length
    # rule then wants a**k >= max(min_draft_acceptance, draft_cost) (docs/speculative.md).
    draft_kv_cache_memory_gb: float = 0.25
    draft_cost: float | None = None
    # length_rule "slack": the acceptance rule's length is an upper bound, and each step's lengths
    # maximize expected tokens per second under the `slo` policy's step-time model, keeping the step
    # within every request's ITL target (its own or the policy's slo_itl_ms) and, with a TPOT target,
    # each request's own drafts within what keeps its TPOT so far within it (docs/speculative.md).
    # Without a step-time model (any other policy) it is the "acceptance" rule: lengths from acceptance
    # alone, the fixed caps above. slo_tpot_ms is the default of requests without their own
    # SamplingParams.slo_tpot_ms.
    length_rule: str = "slack"
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose from {list(SPEC_METHODS)}")
        if self.method == "draft" and not self.model:
            raise ValueError('speculative method "draft" needs "model": the draft model\'s name or path')
        if not self.draft_kv_cache_memory_gb > 0:
            raise ValueError("draft_kv_cache_memory_gb must be > 0")
        if self.draft_cost is not None and not 0.0 <= self.draft_cost < 1.0:
            raise ValueError("draft_cost must be in [0, 1): a draft step is cheaper than a target step")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be an integer >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if any(v is not None and v < 1 for v in (self.disable_by_batch_size, self.disable_by_num_tokens)):
            raise ValueError("disable_by_batch_size and disable_by_num_tokens must be >= 1")
        if self.length_rule not in SPEC_LENGTH_RULES:
            rules = list(SPEC_LENGTH_RULES)
            raise ValueError(f"unknown length_rule {self.length_rule!r}; choose from {rules}")
        if self.slo_tpot_ms is not None and not self.slo_tpot_ms > 0:
            raise ValueError("slo_tpot_ms must be > 0")
        if not (0.0 < self.acceptance_ema <= 1.0 and 0.0 < self.min_draft_acceptance < 1.0):
            raise ValueError("acceptance_ema must be in (0, 1] and min_draft_acceptance in (0, 1)")

    @classmethod
    def from_dict(cls, d: dict[str, object] | str) -> SpeculativeConfig:
        """From the CLI's JSON or `LLM(speculative_config=...)`; unknown keys are an error."""
        import json

        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("the speculative config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        return cls(**d)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: str | None = None  # path to a .gguf file or a Hugging Face directory; None: bundled SmolLM2
    dtype: str = "auto"  # auto | float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None
    attention_backend: str = "auto"  # auto | torch | torch-compiled | cpu-paged (auto: see LLMEngine)
    fused_cpu_ops: bool = True  # bf16 on CPU: the layer's elementwise steps as fused C++ calls (model/ops.py)
    linear_kernel: str = "auto"  # bf16 on CPU: auto | pdserve | amx | onednn | fp32 | torch (model/linear.py)
    # auto picks the fastest kernel per row count, so a row's rounding can change with the batch around
    # it; batch_invariant pins one row-independent kernel instead (slower for prompts and big batches).
    batch_invariant: bool = False
    kernel_cache_dir: str | None = None  # measured kernel choices (model/autotune.py); None: the default, "": none
    # auto | bfloat16 | int8: the projections' and output head's weights; int8 = per output channel,
    # symmetric, bf16 activations, CPU only (model/linear.py); auto = the model dtype.
    weight_dtype: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    seed: int = 0
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {list(DTYPES)}")
        if self.attention_backend != "auto" and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; choose from {['auto', *ATTENTION_BACKENDS]}"
            )
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"unknown linear kernel {self.linear_kernel!r}; choose from {list(LINEAR_KERNELS)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight dtype {self.weight_dtype!r}; choose from {list(WEIGHT_DTYPES)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    @property
    def autotune_dir(self) -> str | None:
        """The directory for measured kernel choices, or None to measure at every start."""
        if self.kernel_cache_dir is None:
            return os.path.join(default_cache_dir(), "autotune")
        return self.kernel_cache_dir or None


def default_cache_dir() -> str:
    """Where pdserve keeps what it measured about this host (kernel choices): $PDSERVE_CACHE_DIR, else
    $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return os.environ["PDSERVE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve")

# The server's own settings (the HTTP front and the engine core process it supervises).

# Seconds an idle HTTP keep-alive connection stays open (uvicorn's default is 5): longer than clients'
# pool timeouts (aiohttp 15 s, httpx 5 s), so a client never sends on a connection being closed.
KEEP_ALIVE_S = 75


@dataclass(frozen=True, slots=True, kw_only=True)
class RandomModelSpec:
    """Serve a randomly initialised model with the tokenizer of `EngineConfig.model` (tests: a tiny model
    whose vocabulary matches the real tokenizer's, so the whole HTTP path runs in milliseconds per step)."""

    model_config: ModelConfig
    seed: int = 0
    std: float = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model file's or directory's name
    # At most this many requests may wait for their first token (in flight to the engine or in its waiting
    # queue); beyond it the server answers 503 at once instead of queueing without bound.
    max_waiting: int = 512
    stats_interval_s: float = 10.0  # period of the one-line stats log; 0 turns it off
    startup_timeout_s: float = 600.0
    shutdown_timeout_s: float = 5.0  # how long open streams may run on after SIGINT/SIGTERM
    access_log: bool = False
    log_level: str = "info"  # of the engine core process's own log lines
    # Append one JSON row per engine step to this file: seconds, forward seconds, prompt tokens, decode
    # tokens, sequences, context tokens (the offline benchmark's `steps` rows): a served run's own step
    # times, for `benchmarks/simulate.py --calibrate`. None: not written.
    step_log: str | None = None
    random_model: RandomModelSpec | None = None
    # Supervision of the engine core process: restart it when it dies, after restart_backoff_s doubled for
    # every other death within restart_window_s (at most restart_backoff_max_s); /health is unhealthy
    # while the core's loop has not been heard from for heartbeat_timeout_s.
    restart_engine: bool = True
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    restart_window_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    # Bounds on what one client may cost: body size (413 beyond), the time its body may take to arrive
    # (408), an optional limit on a whole generation request (504 / an error event; None: no limit), the
    # Host names served (None: any), and concurrent connections (503 beyond).
    max_body_bytes: int = 4 * 2**20
    header_timeout_s: float = 10.0  # a connection whose request head has not arrived by then is closed
    body_timeout_s: float = 30.0
    request_timeout_s: float | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_connections: int = 2048
    # Authentication: clients send `Authorization: Bearer <api_key>` (None: no key needed); the router of
    # a disaggregated cluster sends the cluster secret, which alone unlocks kv_transfer_params and /load.
    api_key: str | None = None
    cluster_secret: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.stats_interval_s < 0:
            raise ValueError("stats_interval_s must be >= 0")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "restart_window_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.body_timeout_s > 0 or not self.header_timeout_s > 0 or (self.request_timeout_s is not None and not self.request_timeout_s > 0):
            raise ValueError("header_timeout_s, body_timeout_s and request_timeout_s must be > 0")
        for name in ("api_key", "cluster_secret"):
            if getattr(self, name) is not None and len(getattr(self, name)) < 8:
                raise ValueError(f"{name} must have at least 8 characters")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """The prefill/decode router's settings (`router/app.py`). URLs are normalised (no trailing slash)
    and lists become tuples."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_policy: str = "least-outstanding-tokens"  # router/policies.py
    decode_policy: str = "least-kv-usage"
    max_retries: int = 1  # further attempts on another pair, only while nothing was sent to the client
    request_timeout_s: float = 600.0  # longest wait for an upstream answer or for the next bytes of one
    connect_timeout_s: float = 5.0
    load_interval_s: float = 0.5  # polling of /health and /load
    health_timeout_s: float = 2.0
    max_connections: int = 1024  # to all instances together; each request holds two while it runs
    access_log: bool = False
    api_key: str | None = None  # clients must send `Authorization: Bearer <api_key>` (None: no key)
    cluster_secret: str | None = None  # sent to the instances with every request (they require it)
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    allowed_hosts: tuple[str, ...] | None = None
    max_client_connections: int = 2048

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = tuple(u.strip().rstrip("/") for u in getattr(self, name))
            role = name.split("_")[0]
            if not urls:
                raise ValueError(f"the router needs at least one {role} instance URL")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"{role} instance URL {u!r} must start with http:// or https://")
            if len(set(urls)) != len(urls):
                raise ValueError(f"{role} instance URLs must not repeat: {', '.join(urls)}")
            object.__setattr__(self, name, urls)
        for policy in (self.prefill_policy, self.decode_policy):
            if policy not in ROUTER_POLICIES:
                raise ValueError(f"unknown instance policy {policy!r}; choose from {', '.join(ROUTER_POLICIES)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("request_timeout_s", "connect_timeout_s", "load_interval_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 2:
            raise ValueError(f"max_connections must be >= 2, got {self.max_connections}")


# The benchmark client's settings (`pdserve bench`, pdserve/bench/).

BENCH_DATASETS = ("sharegpt", "random", "long-prompt", "code-edit")
BENCH_ENDPOINTS = ("completions", "chat")  # bench/client.py's ENDPOINTS maps them to paths


@dataclass(frozen=True, slots=True, kw_only=True)
class LongPromptMix:
    """Shape of the long-prompt workload. The defaults fit a 2,048-token context: 5% of the requests carry
    a 1,500-1,900-token prompt and ask for 128 tokens."""

    fraction: float = 0.05  # of the requests that are long
    min_len: int = 1500  # long prompt length range, tokens (inclusive)
    max_len: int = 1900
    output_len: int = 128  # tokens each long request asks for
    short_input_len: int = 256  # random short chats (without ShareGPT): mean prompt length, +-50%
    short_output_len: int = 128  # random short chats: mean output length, +-50%
    max_total_len: int = 2048  # prompt + output of any request, long or short

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"long-prompt fraction must be in [0, 1], got {self.fraction}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"long-prompt lengths need 1 <= min <= max, got {self.min_len}, {self.max_len}")
        if min(self.output_len, self.short_input_len, self.short_output_len) < 1:
            raise ValueError("long-prompt output and short lengths must be >= 1")
        if self.max_len + self.output_len > self.max_total_len:
            raise ValueError(
                f"long prompts of up to {self.max_len} tokens plus {self.output_len} output tokens do not "
                f"fit max_total_len={self.max_total_len}"
            )

    def check_random_shorts(self) -> None:
        short_total = math.ceil(1.5 * self.short_input_len) + math.ceil(1.5 * self.short_output_len)
        if short_total > self.max_total_len:
            raise ValueError(
                f"random short chats of up to {short_total} tokens exceed max_total_len={self.max_total_len}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class CodeEditMix:
    """Shape of the code-editing workload (`bench/code_edit.py`): each prompt asks to rename, fix or
    annotate one function taken from the Python standard library, so the answer repeats it."""

    min_len: int = 64  # tokens of the function quoted in the prompt (inclusive range)
    max_len: int = 512
    output_len: int | None = None  # tokens to ask for; None: the function's length plus 32 (its rewrite)
    max_total_len: int = 2048  # prompt + output of any request

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"code-edit lengths need 1 <= min <= max, got {self.min_len}, {self.max_len}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"code-edit output_len must be >= 1, got {self.output_len}")
        if self.max_len >= self.max_total_len:
            raise ValueError(
                f"code-edit max_len={self.max_len} leaves no room in max_total_len={self.max_total_len}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What to send: the dataset and its knobs. The same workload is replayed by every run of a sweep or
    comparison (`bench/serve_bench.py` `workload_samples` turns it into requests)."""

    dataset: str = "sharegpt"
    num_prompts: int = 200
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    long_prompt: LongPromptMix = field(default_factory=LongPromptMix)
    code_edit: CodeEditMix = field(default_factory=CodeEditMix)

    def __post_init__(self) -> None:
        if self.dataset not in BENCH_DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}: expected one of {', '.join(BENCH_DATASETS)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConfig:
    """How the benchmark client sends a workload (`bench/client.py`)."""

    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    endpoint: str = "completions"  # "completions" | "chat"
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape; 1 is Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 6 * 3600.0

    def __post_init__(self) -> None:
        if self.endpoint not in BENCH_ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(BENCH_ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
