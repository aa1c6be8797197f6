"""KVLayout: bytes per block (scales included), the transfer payload's shape, the handshake key."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.kv.cache import KVLayout, storage_dtype

SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
    eos_token_ids=(2,),
)


def test_quantized_blocks_are_about_half_the_bytes():
    """int8/fp8 rows are head_dim bytes plus a float32 scale: 68 vs bf16's 128 bytes at head_dim 64."""
    bf16 = KVLayout.for_model(SMOLLM2, 16, "auto", torch.bfloat16)
    assert bf16.kv_dtype == "bfloat16" and not bf16.quantized and bf16.scales == "none"
    assert bf16.block_bytes == 2 * 30 * 16 * 3 * 64 * 2
    for name in ("int8", "fp8_e4m3"):
        q = KVLayout.for_model(SMOLLM2, 16, name, torch.bfloat16)
        assert q.kv_dtype == name and q.quantized and q.scales == "per-token-head"
        assert q.block_bytes == 2 * 30 * 16 * 3 * (64 + 4)
        assert 1.85 < bf16.block_bytes / q.block_bytes < 1.9


@pytest.mark.parametrize(
    "name,want", [("auto", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8),
                  ("fp8_e4m3", torch.float8_e4m3fn)],
)
def test_storage_dtype(name, want):
    assert storage_dtype(name, torch.float32) == want


def test_payload_shape_carries_scales_as_bytes():
    plain = KVLayout(2, 3, 8, torch.bfloat16, 4)
    assert plain.chunk_shape(5) == (2, 3, 5, 8) and plain.chunk_dtype == torch.bfloat16
    q = KVLayout(2, 3, 8, torch.int8, 4)
    assert q.chunk_shape(5) == (2, 3, 5, 8 + 4) and q.chunk_dtype == torch.uint8
    assert q.bytes_per_token == 2 * 2 * 3 * 12


def test_layout_key_tells_every_difference():
    base = KVLayout(2, 3, 8, torch.int8, 16)
    others = [
        KVLayout(2, 3, 8, torch.float8_e4m3fn, 16),  # same payload shape and dtype as int8: only the key tells
        KVLayout(2, 3, 8, torch.int8, 32),
        KVLayout(2, 1, 8, torch.int8, 16),
        KVLayout(2, 3, 16, torch.int8, 16),
        KVLayout(4, 3, 8, torch.int8, 16),
    ]
    assert len({base.key(), *(o.key() for o in others)}) == 1 + len(others)
    assert base.key() == KVLayout(2, 3, 8, torch.int8, 16).key()
