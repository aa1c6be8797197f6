"""Model loading: the bundled SmolLM2 GGUF against transformers' own GGUF loader, and small fabricated
GGUF / safetensors checkpoints for the formats, names, quantization types and errors."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pdserve.config import ModelConfig
from pdserve.errors import ModelLoadError
from pdserve.model.loader import default_model_path, load_model_config, load_weights, resolve_model_path
from tests.support.loader_files import TINY, TINY_HEAD_DIM, gguf_name, tiny_hf_weights, write_hf_dir

Q = gguf.GGMLQuantizationType

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: per head, interleave the two rotary halves."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_gguf(
    path: str,
    weights: dict[str, np.ndarray],
    qtypes: dict[str, Q] | None = None,
    arch: str = "llama",
    raw_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
) -> None:
    """Write `weights` (HF names, HF order) as llama.cpp would: GGUF names, permuted Q/K, chosen types."""
    qtypes = qtypes or {}
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(TINY_HEAD_DIM)
    writer.add_vocab_size(TINY["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    for name, (data, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    for name, w in weights.items():
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, TINY["kv_heads"])
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(gguf_name(name), w)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name), w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------- fabricated GGUF


def test_gguf_names_shapes_and_unpermuted_qk(tmp_path):
    weights = tiny_hf_weights()
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, weights)

    config, loaded = load_weights(path, torch.float32)
    assert set(loaded) == set(weights)
    for name, expected in weights.items():
        # F32 everywhere: Q/K must come back in exactly the HF row order.
        assert torch.equal(loaded[name], torch.from_numpy(expected)), name
    assert config == ModelConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=64, rms_norm_eps=pytest.approx(1e-6), rope_theta=50000.0, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2, 3), architecture="llama",
    )
    assert load_model_config(path) == config


def test_gguf_quantized_types_and_untied_head(tmp_path):
    weights = tiny_hf_weights(seed=1, untied=True)
    qtypes = {
        "model.embed_tokens.weight": Q.Q8_0,
        "lm_head.weight": Q.Q8_0,
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
        "model.layers.0.self_attn.v_proj.weight": Q.F16,
        "model.layers.0.mlp.up_proj.weight": Q.BF16,
        "model.layers.1.mlp.down_proj.weight": Q.Q4_1,
    }
    path = str(tmp_path / "quant.gguf")
    write_tiny_gguf(path, weights, qtypes)

    config, loaded = load_weights(path, torch.bfloat16)
    assert not config.tie_word_embeddings
    assert set(loaded) == set(weights)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    for name, qtype in qtypes.items():
        w = weights[name]
        heads = {"q_proj": TINY["heads"], "k_proj": TINY["kv_heads"]}.get(name.split(".")[-2])
        stored = llama_cpp_permute(w, heads) if heads else w
        # What the file holds after quantization, back in HF row order.
        expected = dequantize(quantize(stored, qtype), qtype).reshape(w.shape)
        if heads:
            expected = llama_cpp_permute_inverse(expected, heads)
        expected_t = torch.from_numpy(np.ascontiguousarray(expected)).to(torch.bfloat16)
        assert torch.equal(loaded[name], expected_t), name
        # ... and it is a (coarse) approximation of the original, so rows did not get shuffled.
        assert np.abs(expected - w).max() < 0.6, name


def llama_cpp_permute_inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_gguf_unsupported_tensor_type(tmp_path):
    path = str(tmp_path / "iq2.gguf")
    # 1 x 256 elements of IQ2_XXS is one 66-byte block; its contents do not matter.
    raw = {"blk.0.ffn_extra.weight": (np.zeros((1, 66), dtype=np.uint8), Q.IQ2_XXS)}
    write_tiny_gguf(path, tiny_hf_weights(), raw_tensors=raw)
    with pytest.raises(ModelLoadError, match="ffn_extra"):
        load_weights(path, torch.float32)

    path = str(tmp_path / "iq2_known_name.gguf")
    weights = tiny_hf_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    raw = {"blk.1.ffn_up.weight": (np.zeros((TINY["inter"], 66), dtype=np.uint8), Q.IQ2_XXS)}
    write_tiny_gguf(path, weights, raw_tensors=raw)
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight.*IQ2_XXS"):
        load_weights(path, torch.float32)


def test_gguf_wrong_architecture(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, arch="gpt2")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model_config(path)
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_weights(path, torch.float32)


def test_gguf_missing_tensor(tmp_path):
    weights = tiny_hf_weights()
    del weights["model.layers.1.mlp.gate_proj.weight"]
    path = str(tmp_path / "missing.gguf")
    write_tiny_gguf(path, weights)
    with pytest.raises(ModelLoadError, match="gate_proj"):
        load_weights(path, torch.float32)


# ---------------------------------------------------------------------------------- paths


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path(str(tmp_path))  # a directory without config.json / safetensors
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path(str(tmp_path / "model.bin"))
    with pytest.raises(ModelLoadError):
        load_weights(str(tmp_path / "nope.gguf"), torch.float32)


def test_default_model_path():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path(None) == path
    assert resolve_model_path(path) == path


# --------------------------------------------------------------------------- HF safetensors




@pytest.mark.parametrize("untied", [False, True])
def test_hf_safetensors_round_trip(tmp_path, untied):
    weights = tiny_hf_weights(seed=2, untied=untied)
    path = str(tmp_path / "hf")
    write_hf_dir(path, weights)
    assert resolve_model_path(path) == path

    config, loaded = load_weights(path, torch.float32)
    assert config == ModelConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=1024,
        tie_word_embeddings=not untied, bos_token_id=5, eos_token_ids=(6, 7), architecture="llama",
    )
    assert load_model_config(path) == config
    assert set(loaded) == set(weights)
    assert ("lm_head.weight" in loaded) == untied
    for name, w in weights.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], torch.from_numpy(w).to(torch.bfloat16).float()), name


def test_hf_transformers5_rope_parameters_and_scalar_eos(tmp_path):
    path = str(tmp_path / "hf")
    write_hf_dir(path, tiny_hf_weights(), rope_theta=None, eos_token_id=2,
                 rope_parameters={"rope_theta": 123.0, "rope_type": "default"})
    config = load_model_config(path)
    assert config.rope_theta == 123.0 and config.eos_token_ids == (2,)


def test_hf_unsupported(tmp_path):
    path = str(tmp_path / "gpt2")
    write_hf_dir(path, tiny_hf_weights(), architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_weights(path, torch.float32)
    path = str(tmp_path / "yarn")
    write_hf_dir(path, tiny_hf_weights(), rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model_config(path)


# ------------------------------------------------------------------ the real model vs transformers


@pytest.fixture(scope="module")
def real_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(real_path):
    return load_weights(real_path, torch.float32)


@pytest.fixture(scope="module")
def hf_state_dict(real_path):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(real_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.real_model
def test_real_config_matches_transformers(real_path, ours):
    from transformers import AutoConfig

    directory, name = os.path.split(real_path)
    hf = AutoConfig.from_pretrained(directory, gguf_file=name)
    config, _ = ours
    assert load_model_config(real_path) == config
    assert config.vocab_size == hf.vocab_size == 49152
    assert config.hidden_size == hf.hidden_size == 576
    assert config.intermediate_size == hf.intermediate_size
    assert config.num_layers == hf.num_hidden_layers == 30
    assert config.num_heads == hf.num_attention_heads == 9
    assert config.num_kv_heads == hf.num_key_value_heads == 3
    assert config.head_dim == hf.head_dim == 64
    assert config.rms_norm_eps == hf.rms_norm_eps
    rope_theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert config.rope_theta == rope_theta
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.tie_word_embeddings == hf.tie_word_embeddings is True
    assert config.bos_token_id == hf.bos_token_id
    assert config.eos_token_ids == (hf.eos_token_id,)


@pytest.mark.real_model
def test_real_weights_match_transformers(ours, hf_state_dict):
    config, weights = ours
    expected_names = set(hf_state_dict) - {"lm_head.weight"}  # transformers lists the tied head too
    assert set(weights) == expected_names
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in (0, 13, 29):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            names.append(f"model.layers.{layer}.{module}.weight")
    for name in names:
        ours_w, hf_w = weights[name], hf_state_dict[name]
        assert ours_w.dtype == torch.float32 and ours_w.shape == hf_w.shape, name
        torch.testing.assert_close(ours_w, hf_w, rtol=0, atol=1e-6, msg=name)

