"""KVLayout: bytes per block (scales included), the transfer payload's shape, the handshake key."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.kv.cache import KVLayout, storage_dtype
from pdserve.transfer.base import layout_mismatch

SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
    eos_token_ids=(2,),
)


def test_quantized_blocks_are_about_half_the_bytes():
    """int8/fp8 rows are head_dim bytes plus 4 bytes of parameters (fp8: a float32 scale; int8: a float16
    scale and zero): 68 vs bf16's 128 bytes at head_dim 64."""
    bf16 = KVLayout.for_model(SMOLLM2, 16, "auto", torch.bfloat16)
    assert bf16.kv_dtype == "bfloat16" and not bf16.quantized and bf16.scales == "none"
    assert bf16.block_bytes == 2 * 30 * 16 * 3 * 64 * 2
    for name, scales in (("int8", "per-token-head-zero"), ("fp8_e4m3", "per-token-head")):
        q = KVLayout.for_model(SMOLLM2, 16, name, torch.bfloat16)
        assert q.kv_dtype == name and q.quantized and q.scales == scales
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


def test_int8_key_names_the_asymmetric_format():
    """int8 rows are asymmetric (a float16 scale and zero): a peer of the older symmetric int8 format,
    whose key began `int8/`, has the same payload shape and must not pair."""
    key = KVLayout(2, 3, 8, torch.int8, 16).key()
    assert key == "int8-asym/L2/H3/D8/B16"
    assert layout_mismatch("int8/L2/H3/D8/B16", key) is not None
    assert KVLayout(2, 3, 8, torch.float8_e4m3fn, 16).key() == "fp8_e4m3/L2/H3/D8/B16"


def test_int4_payload_is_sealed_blocks_then_the_open_block():
    """int4 moves what it stores: per K/V and kv head, each whole block as its packed values plus the
    block's scales or zeros (keys per channel, values per token, float16), then the open last block's
    tokens unquantized. On SmolLM2 a sealed token costs 42 bytes per row against int8's 68 and bf16's 128;
    an open one the residual's 128."""
    int4 = KVLayout.for_model(SMOLLM2, 16, "int4", torch.bfloat16)
    assert int4.chunk_dtype == torch.uint8
    assert int4.int4_block_row_bytes == 16 * 64 // 2 + (64 + 16) * 2 == 672
    assert int4.chunk_len(32) == 2 * 672 and int4.chunk_len(35) == 2 * 672 + 3 * 64 * 2
    assert int4.chunk_shape(35) == (2, 3, 2 * 672 + 3 * 128)
    assert 2 * 30 * 3 * int4.chunk_len(16) == int4.block_bytes  # a sealed block moves as stored
    int8 = KVLayout.for_model(SMOLLM2, 16, "int8", torch.bfloat16)
    bf16 = KVLayout.for_model(SMOLLM2, 16, "auto", torch.bfloat16)
    assert int4.chunk_len(16) / 16 == 42 < int8.token_row_bytes == 68 < 2 * bf16.head_dim == 128


def test_int4_chunk_token_counts_follow_from_the_payload_length():
    """A transport counts a chunk's tokens from its length and how many tokens its transfer has left: a
    chunk is whole blocks unless it ends the transfer (the lengths can coincide only for that one)."""
    lay = KVLayout(2, 3, 64, torch.uint8, 32, torch.bfloat16)  # 2 sealed blocks = 0 blocks + 19 open tokens
    assert lay.chunk_len(64) == lay.chunk_len(19)
    assert lay.chunk_num_tokens(lay.chunk_len(64), 70) == 64
    assert lay.chunk_num_tokens(lay.chunk_len(19), 19) == 19
    assert lay.chunk_num_tokens(lay.chunk_len(32), 32) == 32
    for n, left in [(64, 64), (64, 95), (96, 100), (100, 100), (7, 7)]:
        assert lay.chunk_num_tokens(lay.chunk_len(n), left) == n
    with pytest.raises(ValueError):
        lay.chunk_num_tokens(lay.chunk_len(64) + 1, 100)  # no chunk is this long
    with pytest.raises(ValueError):
        lay.chunk_num_tokens(lay.chunk_len(64), 40)  # more whole blocks than the transfer has left
    plain = KVLayout(2, 3, 64, torch.bfloat16, 32)
    assert plain.chunk_len(19) == plain.chunk_num_tokens(19, 100) == 19


def test_int4_key_names_the_residual_dtype():
    """Open blocks travel unquantized: int4 caches of a bf16 and a float32 model must not pair."""
    a = KVLayout(2, 3, 64, torch.uint8, 16, torch.bfloat16)
    b = KVLayout(2, 3, 64, torch.uint8, 16, torch.float32)
    assert a.key() == "int4+bfloat16/L2/H3/D64/B16" and b.key() != a.key()
    assert KVLayout(2, 3, 64, torch.int8, 16, torch.float32).key() == KVLayout(2, 3, 64, torch.int8, 16).key()
