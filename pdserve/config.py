"""All configuration, as frozen dataclasses validated once at construction. Components receive only the
piece they need. This module and `cli.py` are the only places that read the environment."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, as read from a GGUF file or a Hugging Face config.json."""

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
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bytes at 2 bytes per element (bf16/fp16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = "prefill-first"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    chunk_size: int | None = None  # largest prompt chunk per request per step (None: the budget)
    # decode-priority: prefills pause while this many decodes run, or while the oldest decode has gone
    # more than max_wait_steps steps without a token; at most max_decode_steps such steps in a row.
    decode_priority_max_decodes: int = 64
    decode_priority_max_wait_steps: int = 1
    decode_priority_max_decode_steps: int = 8

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if self.decode_priority_max_decodes < 1 or self.decode_priority_max_decode_steps < 1:
            raise ValueError("decode_priority_max_decodes and decode_priority_max_decode_steps must be >= 1")
        if self.decode_priority_max_wait_steps < 0:
            raise ValueError("decode_priority_max_wait_steps must be >= 0")
        from pdserve.scheduler.policies import POLICIES  # pure Python, no cycle

        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {self.policy!r}; choose from {sorted(POLICIES)}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # path to a .gguf file or a Hugging Face directory; None: bundled SmolLM2
    dtype: str = "auto"  # auto | float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None
    attention_backend: str = "auto"  # auto | torch | torch-compiled | cpu-paged (auto: see LLMEngine)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
