"""Qwen2 checkpoints: fabricated GGUF files (arch `qwen2`: q/k/v biases, NEOX-order Q/K rows that must
not be un-permuted, k-quant types) and Hugging Face directories, against what was written."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pdserve.config import ModelConfig
from pdserve.errors import ModelLoadError
from pdserve.model.loader import load_model_config, load_weights
from tests.support.loader_files import TINY, TINY_HEAD_DIM, gguf_name, tiny_hf_weights, write_hf_dir

Q = gguf.GGMLQuantizationType
BIAS_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v"}


def tiny_qwen2_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 100)
    w = tiny_hf_weights(seed, untied=True)  # Qwen's GGUFs carry output.weight even where HF ties it
    for n in range(TINY["layers"]):
        for proj, rows in (("q_proj", TINY["heads"]), ("k_proj", TINY["kv_heads"]), ("v_proj", TINY["kv_heads"])):
            w[f"model.layers.{n}.self_attn.{proj}.bias"] = rng.standard_normal(rows * TINY_HEAD_DIM).astype(np.float32)
    return w


def qwen2_gguf_name(hf_name: str) -> str:
    if hf_name.endswith(".bias"):
        _, _, layer, rest = hf_name.split(".", 3)
        return f"blk.{layer}.{BIAS_TO_GGUF[rest.split('.')[1]]}.bias"
    return gguf_name(hf_name)


def write_qwen2_gguf(
    path: str,
    weights: dict[str, np.ndarray],
    qtypes: dict[str, Q],
    raw_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> None:
    """As llama.cpp's converter writes qwen2: rows in HF order (NEOX RoPE), biases as F32."""
    writer = gguf.GGUFWriter(path, arch="qwen2")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(32768)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(11)
    writer.add_eos_token_id(12)
    for name, (data, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    for name, w in weights.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(qwen2_gguf_name(name), w)
        else:
            writer.add_tensor(qwen2_gguf_name(name), quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


EXPECTED = ModelConfig(
    vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
    rms_norm_eps=pytest.approx(1e-6), rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False,
    bos_token_id=11, eos_token_ids=(12,), architecture="qwen2", attention_bias=True,
)


def test_qwen2_gguf_rows_stay_in_order_and_biases_load(tmp_path):
    weights = tiny_qwen2_weights()
    path = str(tmp_path / "qwen2.gguf")
    write_qwen2_gguf(path, weights, {})
    config, loaded = load_weights(path, torch.float32)
    assert config == EXPECTED and load_model_config(path) == config
    assert set(loaded) == set(weights)
    for name, expected in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(expected)), name  # q/k not un-permuted


# gguf's Python side can dequantize k-quants but not quantize them: fabricate blocks of random bits with
# sane float16 scales at these byte offsets of each block (llama.cpp's block_qN_K layouts).
K_QUANT_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_k_quant(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[qtype]:
        raw[:, :, offset : offset + 2] = scale
    return raw.reshape(rows, -1)


def test_qwen2_gguf_k_quants(tmp_path):
    rng = np.random.default_rng(7)
    weights = tiny_qwen2_weights(seed=3)
    # Qwen's Q4_K_M files use Q4_K, Q5_0, Q6_K, Q8_0 and F32; the other k-quants come along.
    quantized = {"model.embed_tokens.weight": Q.Q5_0, "lm_head.weight": Q.Q8_0,
                 "model.layers.1.self_attn.v_proj.weight": Q.Q5_1}
    k_quants = {
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
        "model.layers.0.mlp.down_proj.weight": Q.Q6_K,
        "model.layers.1.mlp.gate_proj.weight": Q.Q5_K,
        "model.layers.1.mlp.up_proj.weight": Q.Q3_K,
        "model.layers.1.self_attn.o_proj.weight": Q.Q2_K,
    }
    raw = {name: random_k_quant(weights[name].shape, qtype, rng) for name, qtype in k_quants.items()}
    path = str(tmp_path / "kquant.gguf")
    write_qwen2_gguf(path, {k: v for k, v in weights.items() if k not in raw}, quantized,
                     {qwen2_gguf_name(name): (data, k_quants[name]) for name, data in raw.items()})
    config, loaded = load_weights(path, torch.float32)
    assert config == EXPECTED and set(loaded) == set(weights)
    for name, qtype in quantized.items():
        w = weights[name]
        expected = torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, qtype), qtype).reshape(w.shape)))
        assert torch.equal(loaded[name], expected), name
        assert np.abs(expected.numpy() - w).max() < 0.6, name  # a coarse copy of the original, same row order
    for name, qtype in k_quants.items():
        expected = torch.from_numpy(np.ascontiguousarray(dequantize(raw[name], qtype)))
        assert expected.shape == weights[name].shape and torch.isfinite(expected).all()
        assert torch.equal(loaded[name], expected), name


def test_qwen2_gguf_missing_bias(tmp_path):
    weights = tiny_qwen2_weights()
    del weights["model.layers.1.self_attn.k_proj.bias"]
    path = str(tmp_path / "nobias.gguf")
    write_qwen2_gguf(path, weights, {})
    with pytest.raises(ModelLoadError, match="k_proj.bias"):
        load_weights(path, torch.float32)


def test_qwen2_hf_directory(tmp_path):
    weights = tiny_qwen2_weights(seed=5)
    path = str(tmp_path / "hf")
    write_hf_dir(path, weights, architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1e6,
                 use_sliding_window=False, sliding_window=32768)
    config, loaded = load_weights(path, torch.float32)
    assert config.architecture == "qwen2" and config.attention_bias and config.rope_theta == 1e6
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(w).to(torch.bfloat16).float()), name

    bad = str(tmp_path / "swa")
    write_hf_dir(bad, weights, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True)
    with pytest.raises(ModelLoadError, match="sliding"):
        load_model_config(bad)
    # A Llama checkpoint with biases is still refused (Llama's attention_bias covers o_proj too).
    llama = str(tmp_path / "llama_bias")
    write_hf_dir(llama, tiny_hf_weights(), attention_bias=True)
    with pytest.raises(ModelLoadError, match="biases"):
        load_model_config(llama)
