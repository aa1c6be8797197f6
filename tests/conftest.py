"""Shared fixtures: a tiny random Llama (fast tests) and helpers to build engines around it."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.config import ModelConfig
from pdserve.model.llama import random_weights

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


@pytest.fixture(scope="session")
def tiny_weights() -> dict[str, torch.Tensor]:
    return random_weights(TINY, seed=1234, std=0.08)


@pytest.fixture
def make_tiny_llm(tiny_weights):
    def make(**kw) -> LLM:
        kw.setdefault("num_blocks", 256)
        kw.setdefault("block_size", 4)
        return LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, **kw)

    return make


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = TINY.vocab_size) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lens]
