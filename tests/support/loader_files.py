"""Tiny Llama checkpoints written to disk (HF names, GGUF names, safetensors directories) for the loader
tests of both model families."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

# A tiny Llama: hidden 256 so every quantized type's block size divides the rows.
TINY = dict(vocab=96, hidden=256, inter=512, layers=2, heads=4, kv_heads=2)
TINY_HEAD_DIM = TINY["hidden"] // TINY["heads"]


def tiny_hf_weights(seed: int = 0, untied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, i, hd = TINY["hidden"], TINY["inter"], TINY_HEAD_DIM

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(TINY["vocab"], h), "model.norm.weight": rand(h)}
    if untied:
        w["lm_head.weight"] = rand(TINY["vocab"], h)
    for n in range(TINY["layers"]):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = rand(TINY["heads"] * hd, h)
        w[p + "self_attn.k_proj.weight"] = rand(TINY["kv_heads"] * hd, h)
        w[p + "self_attn.v_proj.weight"] = rand(TINY["kv_heads"] * hd, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, TINY["heads"] * hd)
        w[p + "mlp.gate_proj.weight"] = rand(i, h)
        w[p + "mlp.up_proj.weight"] = rand(i, h)
        w[p + "mlp.down_proj.weight"] = rand(h, i)
        w[p + "input_layernorm.weight"] = rand(h)
        w[p + "post_attention_layernorm.weight"] = rand(h)
    return w


HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.weight"


def write_hf_dir(path, weights: dict[str, np.ndarray], **overrides) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY["vocab"],
        "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["inter"],
        "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": 5,
        "eos_token_id": [6, 7],
        **overrides,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in weights.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
