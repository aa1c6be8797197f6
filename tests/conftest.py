"""Shared fixtures: a tiny random Llama (fast tests) and helpers to build engines around it."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.model.llama import random_weights
from tests.support.tiny import TINY


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
