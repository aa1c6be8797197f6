"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) in plain torch. Qwen2 is the same
block with biases on the q/k/v projection (`ModelConfig.attention_bias`), so one class serves both.

Everything a forward needs arrives as arguments: token ids, positions, the per-layer paged KV cache and
the step's attention metadata. Projections are fused (one QKV matmul, one gate/up matmul) and the
elementwise steps go through `ops` (`ops.py`: plain torch, or fused C++ calls on CPU) to keep the number
of ops per layer small; at 135M parameters and 30 layers, per-op overhead is a large share of a decode
step. The residual stream travels as (x, delta) so that each add is fused with the norm after it.
Logits are computed only for the rows that sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.config import ModelConfig
from pdserve.kv.cache import LayerCache
from pdserve.model.linear import (
    LINEAR_KINDS,
    Int8Weight,
    LinearPlan,
    PackedLinear,
    pack_cpu_linears,
    quantize_int8,
    resident_bytes,
)
from pdserve.model.ops import FusedCpuOps, MeasuredOps, TorchOps, choose_ops, fused_cpu_ops, rms_norm

logger = logging.getLogger(__name__)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for the step's positions, [T, 1, head_dim], computed once per step for all layers."""
    freqs = positions.to(torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaLayer(nn.Module):
    PROJECTIONS = ("qkv", "o", "gate_up", "down")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.eps = cfg.rms_norm_eps
        self.scale = hd**-0.5
        self.input_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(d), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, d), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size), requires_grad=False) if cfg.attention_bias else None
        )
        self.o = nn.Parameter(torch.empty(d, self.q_size), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, d), requires_grad=False)
        self.down = nn.Parameter(torch.empty(d, cfg.intermediate_size), requires_grad=False)
        self.packed: dict[str, PackedLinear] = {}  # packed copies of the projections (CPU, bf16: linear.py)

    def linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed.get(name)
        if packed is None:
            return F.linear(x, getattr(self, name), bias)
        y = packed(x)
        return y if bias is None else y.add_(bias)  # y is the kernel's fresh output

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        meta: AttentionMetadata,
        attn: AttentionBackend,
        ops: TorchOps | FusedCpuOps | MeasuredOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, what the previous layer adds to it) -> the same pair after this layer."""
        t = x.shape[0]
        x, h = ops.add_rms_norm(x, delta, self.input_norm, self.eps)
        q, k, v = ops.rope_qkv(self.linear(h, "qkv", self.qkv_bias), cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        a = attn.forward(q, k, v, cache, meta, self.scale)
        x, h = ops.add_rms_norm(x, self.linear(a.reshape(t, self.q_size), "o"), self.post_norm, self.eps)
        return x, self.linear(ops.silu_mul(self.linear(h, "gate_up")), "down")


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False
        )
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.ops: TorchOps | FusedCpuOps | MeasuredOps = TorchOps()
        self.packed_lm_head: PackedLinear | None = None  # packed copy (CPU, bf16)
        self.linear_plan: LinearPlan | None = None  # which kernels prepack_for_cpu chose, and why
        self.int8_weights: dict[str, list[Int8Weight]] | None = None  # quantize_linears -> prepack_for_cpu
        self.quantized_dtype: str | None = None  # "int8" (weight-only) or "w8a8": which kernels may serve them
        self.num_params = sum(p.numel() for p in self.parameters())  # as built (packing may free originals)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerCache],  # per layer (kv/cache.py)
        meta: AttentionMetadata,
        attn: AttentionBackend,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`after_layer(i)` runs once layer i has written its K/V (disaggregation sends them from there)."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        delta = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x, delta = layer(x, delta, cos, sin, cache, meta, attn, self.ops)
            if after_layer is not None:
                after_layer(i)
        return x + delta

    def prepack_for_cpu(
        self, kind: str = "auto", batch_invariant: bool = False, cache_dir: str | None = None
    ) -> bool:
        """Pack the projections and the output head for CPU matmul kernels with bf16 activations
        (`linear.py`; `kind` names one, "auto" measures which is fastest per row count here, cached in
        `cache_dir`); returns whether it did. After `quantize_linears` it packs the int8 weights (and
        must: the float ones are gone). The decision is kept in `self.linear_plan`. The layers' own
        weights that no chosen kernel runs from are freed (`_drop_linear_weights`): pack once."""
        if kind not in LINEAR_KINDS:
            raise ValueError(f"unknown linear kernel {kind!r}; choose from {LINEAR_KINDS}")
        if self.linear_plan is not None:
            raise RuntimeError("the linears are packed already (packing freed the weights it would repack)")
        int8 = self.int8_weights is not None
        if self.embed.device.type != "cpu" or self.embed.dtype != torch.bfloat16:
            if int8:
                raise ValueError("int8 weights need bf16 activations on the CPU")
            return False
        if kind == "torch" and not int8:
            return False
        weights = self.int8_weights if self.int8_weights is not None else self.linear_weights()
        self.linear_plan = pack_cpu_linears(weights, kind, batch_invariant=batch_invariant, cache_dir=cache_dir,
                                            weight_dtype=self.quantized_dtype if int8 else None)
        self.int8_weights = None  # what the kernels did not keep goes now
        for i, layer in enumerate(self.layers):
            layer.packed = {name: self.linear_plan.packed[name][i] for name in LlamaLayer.PROJECTIONS}
        self.packed_lm_head = self.linear_plan.packed["lm_head"][0]
        self._drop_linear_weights(keep=self.linear_plan.weight_tensors())
        return True

    def _drop_linear_weights(self, keep: Sequence[torch.Tensor] = ()) -> None:
        """Free the projections' and the head's own weights except those whose storage a kernel in `keep`
        runs from (`TorchLinear` keeps the layer's tensor): after packing they are a dead copy (3.1 GB of a
        1.5B model). A tied head is the embedding, which the model still gathers from: it stays."""
        kept = {t.untyped_storage().data_ptr() for t in keep if not t.is_mkldnn}
        params = [getattr(layer, name) for layer in self.layers for name in LlamaLayer.PROJECTIONS]
        if self.lm_head is not self.embed:
            params.append(self.lm_head)
        for p in params:
            if p.numel() and p.untyped_storage().data_ptr() not in kept:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def scale_key_channels(self, powers: torch.Tensor) -> None:
        """Fold per-channel powers of two into the q/k projections (model/key_scales.py): `powers`
        [layers, kv heads, head_dim], channel c and c + head_dim / 2 equal (what rotate-half RoPE mixes).
        The k rows of each layer's fused weight and bias are divided by its kv head's powers and the q
        rows of every query head in that head's group multiplied by them, so q.k is unchanged (exactly:
        powers of two) and the cache stores K / a. Call it on the loaded weights, before packing."""
        if self.linear_plan is not None or self.int8_weights is not None:
            raise RuntimeError("fold the key scales before the linears are quantized or packed")
        c = self.cfg
        if tuple(powers.shape) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(f"key powers {tuple(powers.shape)} do not fit the model "
                             f"({c.num_layers}, {c.num_kv_heads}, {c.head_dim})")
        half = c.head_dim // 2
        if not torch.equal(powers[..., :half], powers[..., half:]):
            raise ValueError("key powers must be equal for channels c and c + head_dim / 2 (RoPE mixes them)")
        if not torch.equal(powers, torch.exp2(torch.log2(powers).round())):
            raise ValueError("key scales must be powers of two (only those fold exactly)")
        group = c.num_heads // c.num_kv_heads
        for layer, a in zip(self.layers, powers.to(self.embed.device)):
            q_mul = a.repeat_interleave(group, dim=0).reshape(-1)  # [heads * D]: query head h reads kv head h // group
            k_div = a.reshape(-1)
            mul = torch.cat([q_mul, 1.0 / k_div, torch.ones(layer.kv_size, device=a.device)]).to(layer.qkv.dtype)
            layer.qkv.mul_(mul.unsqueeze(1))
            if layer.qkv_bias is not None:
                layer.qkv_bias.mul_(mul)

    @torch.no_grad()
    def quantize_linears(self, weight_dtype: str = "int8") -> None:
        """Quantize every projection and the output head to int8 per output channel (`quantize_int8`),
        from the float32 weights as loaded (before the cast to bf16: one rounding, not two), and free the
        float copies: a decode step then streams half the bytes, and only the int8 ones stay resident.
        The embedding stays float (it is gathered a few rows a step, not streamed; with tied embeddings
        the head gets its own int8 copy). `prepack_for_cpu` then packs the int8 weights with the kernels
        `weight_dtype` allows: "int8" bf16 activations only, "w8a8" also int8 x int8 (`linear.py`)."""
        assert weight_dtype in ("int8", "w8a8"), weight_dtype
        self.quantized_dtype = weight_dtype
        weights = self.linear_weights()
        self.int8_weights = {op: [quantize_int8(w) for w in ws] for op, ws in weights.items()}
        self._drop_linear_weights()

    def weight_bytes(self) -> dict[str, int]:
        """Resident bytes of the weights (each storage once): `linears`, what the projections and head
        run from (the packed kernels' copies, else the parameters), and `other`, everything else
        (embedding, norms, biases; packing freed the projections' own copies)."""
        packed = self.linear_plan.weight_tensors() if self.linear_plan is not None else []
        params = list(self.parameters())
        total = resident_bytes([*packed, *params])
        linears = resident_bytes(packed) if packed else resident_bytes(
            [t for ws in self.linear_weights().values() for t in ws]
        )
        return {"total": total, "linears": linears, "other": total - linears}

    def linear_weights(self) -> dict[str, list[torch.Tensor]]:
        """Every projection's weight by op, one per layer, and the output head: what a kernel packs."""
        weights = {name: [getattr(layer, name) for layer in self.layers] for name in LlamaLayer.PROJECTIONS}
        weights["lm_head"] = [self.lm_head]
        return weights

    def use_fused_cpu_ops(self, measure: bool = False, batch_invariant: bool = False, cache_dir: str | None = None) -> bool:
        """Switch the elementwise steps to the fused C++ ops when that is the fast path (CPU, 16-bit) and
        the extension builds; returns whether it did. `measure`: time them against the torch ops on this
        model's shapes and use the faster per row bucket (`ops.choose_ops`; cached in `cache_dir`)."""
        if self.embed.device.type != "cpu" or self.embed.dtype != torch.bfloat16:
            return False
        ops = fused_cpu_ops()
        if ops is None:
            return False
        logger.info("fused CPU ops: add+RMSNorm, RoPE (rotate-half), %s", ops.silu_mul_path)
        self.ops = ops
        if measure:
            c = self.cfg
            shapes = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.num_layers)
            self.ops = choose_ops(ops, shapes, batch_invariant=batch_invariant, cache_dir=cache_dir)
        return True

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits for the given rows of hidden states (only the rows that sample): float32, or in the
        model's dtype with `upcast=False` (for the sampler, which widens them only where it computes on
        them: a fresh [rows, vocab] float32 tensor is page-faulted in at every step, 39 ms for 162 rows of
        Qwen2.5's 151,936 on an EPYC host, 3x the greedy argmax itself)."""
        h = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        logits = self.packed_lm_head(h) if self.packed_lm_head is not None else F.linear(h, self.lm_head)
        return logits.float() if upcast else logits

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor], consume: bool = False) -> None:
        """Copy Hugging Face-named Llama/Qwen2 weights in, fusing q/k/v (and their biases) and gate/up.
        `consume`: remove each tensor from `weights` once copied, so that a checkpoint and the model are
        never both resident in full (the loader's float32 dict: 6 GB for a 1.5B model)."""
        def take(name: str) -> torch.Tensor:
            try:
                return weights.pop(name) if consume else weights[name]
            except KeyError:
                raise KeyError(f"checkpoint lacks tensor {name!r}") from None

        self.embed.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if not self.cfg.tie_word_embeddings:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            layer.qkv.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            layer.o.copy_(take(p + "self_attn.o_proj.weight"))
            layer.gate_up.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.down.copy_(take(p + "mlp.down_proj.weight"))


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Hugging Face-named random weights for a config: tiny models for fast tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_w() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(cfg.hidden_size, generator=g)

    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, d), "model.norm.weight": norm_w()}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rnd(cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w()
        w[p + "post_attention_layernorm.weight"] = norm_w()
        w[p + "self_attn.q_proj.weight"] = rnd(cfg.num_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = rnd(cfg.num_kv_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = rnd(cfg.num_kv_heads * hd, d)
        if cfg.attention_bias:  # Qwen2's biases are large next to its weights: make them matter here too
            w[p + "self_attn.q_proj.bias"] = rnd(cfg.num_heads * hd) * 10
            w[p + "self_attn.k_proj.bias"] = rnd(cfg.num_kv_heads * hd) * 10
            w[p + "self_attn.v_proj.bias"] = rnd(cfg.num_kv_heads * hd) * 10
        w[p + "self_attn.o_proj.weight"] = rnd(d, cfg.num_heads * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(f, d)
        w[p + "mlp.up_proj.weight"] = rnd(f, d)
        w[p + "mlp.down_proj.weight"] = rnd(d, f)
    return w
