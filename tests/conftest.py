"""Shared fixtures: a tiny random Llama (fast tests) and helpers to build engines around it."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from pdserve import LLM
from pdserve.model.llama import random_weights
from tests.support.tiny import TINY


def pytest_configure(config: pytest.Config) -> None:
    # Kernel choices measured by the tests' engines go to a per-run directory (inherited by the server
    # processes they start), not the user's cache: each run measures once and leaves nothing behind.
    if "PDSERVE_CACHE_DIR" not in os.environ:
        os.environ["PDSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="pdserve-test-cache-")


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
