"""Helpers for tests that start real server processes: the tiny random model with SmolLM2's vocabulary
(so the real tokenizer fits it), its command line, a quiet environment, /metrics scraping and polling."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import ModelConfig
from tests.support.tiny import TINY

# The tests' tiny Llama with SmolLM2's vocabulary, so the real tokenizer fits it.
TINY_VOCAB = dataclasses.replace(TINY, vocab_size=49152, eos_token_ids=(2,))
SEED, STD = 1234, 0.08
MODEL = "tiny"
MAX_MODEL_LEN = 512


def random_weights_arg(cfg: ModelConfig = TINY_VOCAB, seed: int = SEED, std: float = STD) -> str:
    spec = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    spec["eos_token_ids"] = list(cfg.eos_token_ids)
    return json.dumps({**spec, "seed": seed, "std": std})


def tiny_server_args(*extra: str) -> list[str]:
    return [
        "--random-weights",
        random_weights_arg(),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-gb",
        "0.02",
        *extra,
    ]


def quiet_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, summed over labels: {sample name: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
