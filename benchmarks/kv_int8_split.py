"""Where int8 KV's error comes from: keys or values, and how the int8 row format compares with others of
the same bytes (docs/accuracy.md, "Where int8 KV's KL comes from").

    .venv/bin/python benchmarks/kv_int8_split.py [--model qwen2.5-coder-0.5b-instruct] [--num-prompts 10]
        [--options k-int8,v-int8,kv-int8-asym,kv-int8-sym,kv-int8-g32,kv-int8-k-channel]

Every engine runs the torch reference attention in bf16. `kv-int8` stores an int8 cache (kv/quant.py:
asymmetric, a float16 scale and zero per token and kv head) of unscaled keys (`--kv-key-scaling off`:
the engine's own key scaling, model/key_scales.py, is what `kv-int8-k-channel` measured before it). The
others keep a bf16 cache and round K and/or V on their way into attention (`RoundedKV`, an attention
backend of this script's own, so the prompt's fresh K/V and every later read see the rounded values, as
with an int8 cache):

- `k-int8` / `v-int8`: only K / only V through kv/quant.py's int8 (the rows `kv-int8` stores);
- `kv-int8-asym`: this script's own asymmetric int8, the measurement the cache's format was adopted from:
  q = round((x - min) / scale) in [0, 255], with a float16 scale and a float16 zero (the same 4 bytes per
  row as a float32 scale, 255 steps over [min, max] instead of [-max|x|, max|x|]). Bit for bit
  `kv-int8`, which checks both the emulation and the cache: the script says whether every position's KL
  is equal;
- `kv-int8-sym`: the symmetric int8 the cache stored before (one float32 scale = max|x| / 127 per row);
- `kv-int8-g32`: symmetric with a float16 scale per 32 channels;
- `kv-int8-k-channel`: the cache's int8 rows, K first divided by a power of two per channel (the pair a
  rotate-half RoPE mixes sharing one) that brings each channel's largest |k| in the layer's first call
  near its head's median channel, and multiplied back: what storing K / a and multiplying the queries
  by a would compute (exactly, powers of two), a per-channel treatment of keys in int8's own bytes.

The figures are teacher-forced as in benchmarks/accuracy.py (same conversations, same chunking):
mean and p99 KL(bf16 || option), top-1 agreement, and the mean KL by context length.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from pdserve.attention.torch_ref import TorchAttention
from pdserve.bench.accuracy import (
    base_config,
    bootstrap_ratio_ci,
    build_engines,
    sample_conversations,
    score_teacher_forced,
)
from pdserve.kv.quant import dequantize, quantize
from pdserve.model.key_scales import channel_powers

Rounding = Callable[[torch.Tensor], torch.Tensor]


def int8_symmetric(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] through symmetric int8 with a float32 scale per row (max|x| / 127, round to nearest), the
    int8 cache's format before the asymmetric one, in x's dtype."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return ((xf * inv).round_().clamp_(-127, 127) * scale).to(x.dtype)


def int8_cache(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as the int8 cache stores and reads it (kv/quant.py), in x's dtype."""
    return dequantize(*quantize(x, "int8"), x.dtype)


def int8_asymmetric(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] through asymmetric int8 with a float16 scale and zero per row, in x's dtype."""
    xf = x.float()
    zero = xf.amin(-1, keepdim=True).half().float()
    scale = ((xf.amax(-1, keepdim=True) - zero) / 255.0).half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = ((xf - zero) * inv).round_().clamp_(0, 255)
    return (q * scale + zero).to(x.dtype)


def int8_group32(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] through symmetric int8 with a float16 scale per 32 channels (llama.cpp q8_0's blocks):
    at head_dim 64 two scales, the same 4 bytes per row as one float32 scale."""
    xf = x.float().unflatten(-1, (-1, 32))
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return ((xf * inv).round_().clamp_(-127, 127) * scale).flatten(-2).to(x.dtype)


class RoundedKV(TorchAttention):
    """The reference attention over K and/or V rounded by a quantizer before they are written or read."""

    def __init__(self, k_fn: Rounding | None, v_fn: Rounding | None) -> None:
        self.k_fn, self.v_fn = k_fn, v_fn

    def forward(self, q, k, v, cache, meta, scale):  # type: ignore[no-untyped-def]
        k = self.k_fn(k) if self.k_fn is not None else k
        v = self.v_fn(v) if self.v_fn is not None else v
        return super().forward(q, k, v, cache, meta, scale)


class PerChannelKV(TorchAttention):
    """int8 K and V as the cache stores them, K first divided per channel by `channel_powers` (the
    engine's, model/key_scales.py: here without its per-layer choice) of the layer's first call (the first
    prompt chunks: a calibration of 256 rows) and multiplied back after, which is what storing K / a and multiplying the queries by a computes (exactly: powers of two)."""

    def __init__(self) -> None:
        self.powers: dict[int, torch.Tensor] = {}

    def forward(self, q, k, v, cache, meta, scale):  # type: ignore[no-untyped-def]
        a = self.powers.setdefault(cache.k.data_ptr(), channel_powers(k)).to(k.dtype)
        return super().forward(q, int8_cache(k / a) * a, int8_cache(v), cache, meta, scale)


ROUNDED: dict[str, tuple[Rounding | None, Rounding | None]] = {
    "k-int8": (int8_cache, None),
    "v-int8": (None, int8_cache),
    "kv-int8-asym": (int8_asymmetric, int8_asymmetric),
    "kv-int8-sym": (int8_symmetric, int8_symmetric),
    "kv-int8-g32": (int8_group32, int8_group32),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--options", default=None,
                    help="comma list of the options to run beside bf16 and kv-int8 (default: all)")
    args = ap.parse_args(argv)
    base = base_config(args.model, max_total_len=args.max_total_len, max_tokens=0,
                       max_num_seqs=args.batch_size, seed=args.seed)
    ref = {"dtype": "bfloat16", "attention_backend": "torch"}
    emulated = [*ROUNDED, "kv-int8-k-channel"]
    chosen = emulated if args.options is None else args.options.split(",")
    if unknown := set(chosen) - set(emulated):
        ap.error(f"unknown options {sorted(unknown)}; choose from {emulated}")
    int8 = {**ref, "kv_cache_dtype": "int8", "kv_key_scaling": "off"}
    options = {"bf16": ref, "kv-int8": int8, **{n: ref for n in chosen}}
    engines = build_engines(base, options)
    for name in chosen:
        engines[name].runner.attn = PerChannelKV() if name == "kv-int8-k-channel" else RoundedKV(*ROUNDED[name])
    convs = sample_conversations(engines["bf16"].tokenizer, args.num_prompts, args.seed,  # type: ignore[arg-type]
                                 max_total_len=args.max_total_len)
    stats = score_teacher_forced(engines, "bf16", convs, args.chunk, args.batch_size)
    base_sums = stats["kv-int8"].per_conversation()
    print(f"{engines['bf16'].model_name}: {len(convs)} conversations, "
          f"{sum(len(c.reply_ids) for c in convs)} reply positions, torch reference attention, bf16")
    print("CI: bootstrap over conversations; minus kv-int8: paired, the same resampled conversations")
    print(f"{'option':<16} {'mean KL':>9} {'95% CI':>20} {'minus kv-int8 95% CI':>22} {'p99 KL':>9} {'top-1':>7}"
          "  mean KL by context")
    for name, s in stats.items():
        t = s.summary()
        kl_sum, count, _ = s.per_conversation()
        diff = bootstrap_ratio_ci(kl_sum - base_sums[0], count)
        by_ctx = "  ".join(f"{k}: {v:.2e}" for k, v in t["mean_kl_by_context"].items())  # type: ignore[union-attr]
        lo, hi = t["mean_kl_ci95"]  # type: ignore[misc]
        print(f"{name:<16} {t['mean_kl']:>9.2e} [{lo:.2e}, {hi:.2e}] [{diff[0]:+.2e}, {diff[1]:+.2e}] "
              f"{t['p99_kl']:>9.2e} {t['top1_agreement']:>7.2%}  {by_ctx}")
    if "kv-int8-asym" not in stats:
        return 0
    cache_kl, asym_kl = (torch.cat(stats[n].kl) for n in ("kv-int8", "kv-int8-asym"))
    same = torch.equal(cache_kl, asym_kl)
    print(f"kv-int8-asym == kv-int8 at every position (bit for bit): {'yes' if same else 'NO'}"
          + ("" if same else f" (max |KL difference| {(cache_kl - asym_kl).abs().max().item():.2e})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
