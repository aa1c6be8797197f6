"""The tests' tiny random Llama (fast: steps take milliseconds) and random prompts for it."""

from __future__ import annotations

import torch

from pdserve.config import ModelConfig

TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_ids=(0,),
)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = TINY.vocab_size) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lens]


def first_layers(cfg: ModelConfig, weights: dict[str, torch.Tensor], n: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A draft model made of the target's first `n` layers (same embedding, final norm and head): it
    shares the vocabulary and agrees with the target often but not always (drafts get rejected)."""
    from dataclasses import replace

    keep = {f"model.layers.{i}." for i in range(n)}
    w = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
    return replace(cfg, num_layers=n), w
