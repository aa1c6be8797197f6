"""Per-channel powers of two for quantized keys, folded into the q/k projections.

An int8 or fp8 KV cache quantizes each token's key row (one kv head, `head_dim` values) with its own
scale, so a row's step is set by its largest channel. In some models a few key channels are tens of
times larger than the rest for every token (Qwen2.5's k_proj biases put them there), and those few
spend the row's 256 levels: on Qwen2.5-Coder-0.5B all of int8 KV's KL divergence comes from the keys
(docs/accuracy.md). Dividing each key channel c by a power of two a_c (the largest |k_c| brought near
its head's median channel) and multiplying the queries' channel c by the same a_c leaves every q.k
unchanged, and the rows the cache quantizes even.

Nothing at run time does this: `LlamaModel.scale_key_channels` multiplies the q rows of the fused
q/k/v weight and bias by a and divides the k rows by a, once, before the weights are cast or
quantized. Powers of two are exact in floating point (barring overflow), RoPE mixes channel c with
c + head_dim/2 only (rotate-half: the pair shares its power, so the rotation commutes with the
scaling), so q and k come out scaled exactly and q.k is bit for bit what it was: a bf16 cache's output
does not change, only a quantized cache's rounding does. The cache stores K/a; a disaggregation peer
must have folded the same powers (`KeyScales.digest` is part of the KV layout's key).

Which powers: the model runs `CALIBRATION_TEXT` once at start in float32 (`record_qk`), each layer's
keys give the powers (`channel_powers`), and a layer keeps them only where they cut the mean squared
error that the cache's quantizer puts into the causal scores q.k / sqrt(head_dim) on that text by at
least `MIN_GAIN` (`calibrate`); elsewhere its powers are 1. So a model without outlier key channels
(SmolLM2: the scaling cost it a little KL) is left as it is. A model with a norm on q or k (not the
llama/qwen2 blocks here) could not fold this into its projections.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionMetadata, PrefillSeq
from pdserve.attention.torch_ref import TorchAttention
from pdserve.kv.cache import LayerCache
from pdserve.kv.quant import QUANT_DTYPES, dequantize, quantize

# A layer keeps its powers where they divide the calibration's score error by at least this much.
MIN_GAIN = 2.0
MAX_LOG2 = 8  # powers within 2^-8 .. 2^8

# Prose, a dialogue and code: the kinds of text a serving engine sees (tokenized with the model's own
# tokenizer; a model without one, a random test model, reads pseudo-random token ids instead).
CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a \
screw press with movable metal type and an oil-based ink. Books became cheaper, literacy spread, and \
scholars across Europe could compare the same text page by page.

User: Can you explain what a hash map is and when I should use one?
Assistant: A hash map stores key-value pairs. It computes a hash of each key to find a bucket, so \
lookups, inserts and deletes take constant time on average. Use one when you need fast access by key \
and do not care about order; use a sorted tree when you need the keys in order.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id \
GROUP BY name ORDER BY orders DESC LIMIT 10;

1. Preheat the oven to 200 degrees. 2. Mix 300 g of flour with 2 eggs and 250 ml of milk. 3. Bake for \
25 minutes, until golden. Les fleurs du jardin sont belles au printemps; der Zug fährt um acht Uhr ab.
"""
MAX_CALIBRATION_TOKENS = 384


def channel_powers(k: torch.Tensor) -> torch.Tensor:
    """[kv heads, head_dim] powers of two that bring each channel's largest |k| over the rows of `k`
    ([tokens, kv heads, head_dim]) near its head's median channel: 2^round(log2(max / median)), within
    2^+-MAX_LOG2, the two channels a rotate-half RoPE mixes (c and c + head_dim / 2) sharing one."""
    amax = k.float().abs().amax(0)  # [kv heads, D]
    half = amax.shape[-1] // 2
    pair = torch.maximum(amax[:, :half], amax[:, half:]).clamp_min(1e-30)
    ref = pair.median(-1, keepdim=True).values
    log2 = torch.round(torch.log2(pair / ref)).clamp_(-MAX_LOG2, MAX_LOG2)
    power = torch.exp2(log2)
    return torch.cat([power, power], -1)


def score_mse(q: torch.Tensor, k: torch.Tensor, powers: torch.Tensor, kv_dtype: str) -> float:
    """The mean squared error that storing K / `powers` as `kv_dtype` (kv/quant.py) puts into the causal
    scores q.k / sqrt(head_dim) of q [T, heads, D] against k [T, kv heads, D]."""
    t, h, d = q.shape
    kvh = k.shape[1]
    a = powers.to(torch.float32)
    stored = dequantize(*quantize(k.float() / a, kv_dtype), torch.float32) * a
    err = (stored - k.float()).transpose(0, 1)  # [KVH, T, D]
    qg = q.float().view(t, kvh, h // kvh, d).permute(1, 2, 0, 3).reshape(kvh, -1, d)  # [KVH, G*T, D]
    e = torch.bmm(qg, err.transpose(1, 2)).view(kvh, h // kvh, t, t) * d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril_()
    return float(e.square().masked_select(causal).mean())


class _Recorder(TorchAttention):
    """The reference attention that keeps each call's (q, k): one per layer, in order."""

    def __init__(self) -> None:
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q, k, v, cache, meta, scale):  # type: ignore[no-untyped-def]
        self.qk.append((q.detach().clone(), k.detach().clone()))
        return super().forward(q, k, v, cache, meta, scale)


@torch.no_grad()
def record_qk(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (q [T, heads, D], k [T, kv heads, D]) after RoPE, for one prompt of token `ids` run
    through `model` (a `LlamaModel`) with the reference attention over a scratch cache."""
    cfg = model.cfg
    t = ids.numel()
    bs = 16
    dtype = model.embed.dtype
    shape = (cfg.num_kv_heads, -(-t // bs), bs, cfg.head_dim)
    scratch = LayerCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t), num_decode_tokens=0, decode_groups=[],
        prefills=[PrefillSeq(query_start=0, query_len=t, context_len=t, context_blocks=None, mask=None)],
    )
    rec = _Recorder()
    model(ids, torch.arange(t), [scratch] * cfg.num_layers, meta, rec)
    return rec.qk


def calibration_ids(tokenizer: object | None, vocab_size: int) -> torch.Tensor:
    """`CALIBRATION_TEXT`'s token ids (at most MAX_CALIBRATION_TOKENS), or pseudo-random ids without a
    tokenizer (a fixed seed: every instance of a model gets the same powers)."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT))[:MAX_CALIBRATION_TOKENS]  # type: ignore[attr-defined]
        return torch.tensor(ids, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (256,), generator=g)


@dataclass(frozen=True)
class KeyScales:
    """What `calibrate` chose: `powers` [layers, kv heads, head_dim] float32 (1 in layers left as they
    are) and each layer's calibration score MSE without / with its powers."""

    kv_dtype: str
    powers: torch.Tensor
    mse_plain: tuple[float, ...]
    mse_scaled: tuple[float, ...]

    @property
    def scaled_layers(self) -> list[int]:
        return [i for i, p in enumerate(self.powers) if bool((p != 1).any())]

    def digest(self) -> str:
        """A short fingerprint of the powers ("" where none differs from 1): the KV layout's key carries
        it, so that two instances pair only if their caches hold keys scaled alike."""
        if not self.scaled_layers:
            return ""
        log2 = torch.log2(self.powers).round().to(torch.int8)
        return hashlib.sha256(log2.numpy().tobytes()).hexdigest()[:12]

    def describe(self) -> str:
        n = len(self.powers)
        layers = self.scaled_layers
        if not layers:
            return f"key channel scaling for {self.kv_dtype} KV: no layer gains {MIN_GAIN:g}x (none scaled)"
        plain = sum(self.mse_plain) / n
        kept = sum(self.mse_scaled[i] if i in layers else self.mse_plain[i] for i in range(n)) / n
        top = int(torch.log2(self.powers).abs().max())
        return (f"key channel scaling for {self.kv_dtype} KV: {len(layers)} of {n} layers scaled (powers of two "
                f"up to 2^{top}), calibration score MSE {plain:.3g} -> {kept:.3g}, digest {self.digest()}")


def calibrate(model: torch.nn.Module, ids: torch.Tensor, kv_dtype: str, every_layer: bool = False) -> KeyScales:
    """Run `ids` through `model` and choose each layer's key powers for a `kv_dtype` cache: a layer's
    `channel_powers` where they cut its score MSE by MIN_GAIN (`every_layer`: wherever), else ones."""
    if kv_dtype not in QUANT_DTYPES:
        raise ValueError(f"key channel scaling is for an int8 or fp8 KV cache, not {kv_dtype!r}")
    powers, plain, scaled = [], [], []
    for q, k in record_qk(model, ids):
        a = channel_powers(k)
        ones = torch.ones_like(a)
        p, s = score_mse(q, k, ones, kv_dtype), score_mse(q, k, a, kv_dtype)
        plain.append(p)
        scaled.append(s)
        powers.append(a if every_layer or s * MIN_GAIN <= p else ones)
    return KeyScales(kv_dtype, torch.stack(powers), tuple(plain), tuple(scaled))
