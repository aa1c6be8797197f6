"""All configuration, as frozen dataclasses validated once at construction. Components receive only the
piece they need. This module and `cli.py` are the only places that read the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def default_model_cache_dir() -> str:
    """Where models assembled from PyPI part packages are kept (`model/registry.py`):
    $PDSERVE_MODEL_CACHE, else $XDG_CACHE_HOME/pdserve/models, else ~/.cache/pdserve/models."""
    explicit = os.environ.get("PDSERVE_MODEL_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "pdserve", "models")


@dataclass(frozen=True, slots=True)
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


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    swap_space_gb: float = 4.0  # host-memory tier for swapped-out KV (only with preemption_mode "swap")
    # How K/V are stored (kv/quant.py): "auto" is the model's dtype; int8 and fp8_e4m3 keep one float32
    # scale per token and kv head; int4 (keys per channel, values per token, the newest tokens kept
    # unquantized until their block fills) is not implemented yet.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.swap_space_gb < 0:
            raise ValueError("swap_space_gb must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from {list(KV_CACHE_DTYPES)}")


PREEMPTION_MODES = ("recompute", "swap")
# The names config accepts for the registries that live further up (scheduler/policies.py's POLICIES,
# transfer/registry.py's TRANSPORTS): spelled here so config imports nothing above it; a unit test
# (tests/unit/test_layering.py) holds each registry's keys equal to these.
SCHEDULER_POLICIES = ("prefill-first", "chunked", "decode-priority", "slo")
KV_TRANSFER_BACKENDS = ("inproc", "shm", "tcp", "torch.distributed")


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


SPEC_METHODS = ("ngram",)  # "draft" (a smaller model of the same tokenizer) comes next


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` convention (docs/speculative.md).

    `ngram`: prompt lookup, the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
    matched against the request's earlier tokens, the tokens that followed proposed as drafts.
    Each request's speculation length adapts (0..num_speculative_tokens) to its measured acceptance;
    steps of more than `disable_by_batch_size` requests or `disable_by_num_tokens` tokens propose none (verification is no longer nearly
    free once the step is compute-bound)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model ("draft" method; not implemented yet)
    disable_by_batch_size: int = 32
    disable_by_num_tokens: int = 512  # ... or steps of more tokens (prompt chunks, decodes and drafts)
    # Adaptivity: a request's acceptance rate a (EMA over its verified drafts, weight `acceptance_ema`)
    # sets its length to the largest k with a**k >= min_draft_acceptance (the k-th draft is accepted
    # with probability about a**k); at least 1 while it is worth probing.
    acceptance_ema: float = 0.3
    min_draft_acceptance: float = 0.25
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose from {list(SPEC_METHODS)}"
                + (" (the draft-model proposer is not implemented yet)" if self.method == "draft" else "")
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be an integer >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1 or self.disable_by_num_tokens < 1:
            raise ValueError("disable_by_batch_size and disable_by_num_tokens must be >= 1")
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


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # path to a .gguf file or a Hugging Face directory; None: bundled SmolLM2
    dtype: str = "auto"  # auto | float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None
    attention_backend: str = "auto"  # auto | torch | torch-compiled | cpu-paged (auto: see LLMEngine)
    fused_cpu_ops: bool = True  # bf16 on CPU: the layer's elementwise steps as fused C++ calls (model/ops.py)
    linear_kernel: str = "auto"  # bf16 on CPU: auto | pdserve | onednn | torch (model/linear.py)
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


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    """Serve a randomly initialised model with the tokenizer of `EngineConfig.model` (tests: a tiny model
    whose vocabulary matches the real tokenizer's, so the whole HTTP path runs in milliseconds per step)."""

    model_config: ModelConfig
    seed: int = 0
    std: float = 0.02


@dataclass(frozen=True, slots=True)
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
