"""Per-channel powers of two for quantized keys (model/key_scales.py): exact when folded, chosen where
they cut the keys' error, carried by the KV layout's key."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve import LLM
from pdserve.config import CacheConfig
from pdserve.kv.cache import KVLayout
from pdserve.model import key_scales as ks
from pdserve.model.llama import LlamaModel, random_weights
from pdserve.transfer.base import layout_mismatch
from tests.support.teacher_forced import kl_and_top1, teacher_forced_logprobs
from tests.support.tiny import TINY, random_prompts

QWEN_TINY = replace(TINY, attention_bias=True)
OUTLIER = 3  # the key channel (and its rotate-half partner OUTLIER + head_dim / 2) given a large bias


def outlier_weights(bias: float = 40.0) -> dict[str, torch.Tensor]:
    """Tiny qwen2 weights whose layer 0 keys of kv head 0 carry a large constant in one RoPE pair, as
    Qwen2.5's k_proj biases put a few channels tens of times above the rest."""
    w = random_weights(QWEN_TINY, seed=7, std=0.08)
    d = QWEN_TINY.head_dim
    b = w["model.layers.0.self_attn.k_proj.bias"]
    b[OUTLIER] = bias
    b[OUTLIER + d // 2] = -bias
    return w


def build(weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> LlamaModel:
    m = LlamaModel(QWEN_TINY)
    m.load_hf_weights(weights)
    return m.to(dtype).eval()


def random_powers(cfg=QWEN_TINY, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    half = torch.exp2(torch.randint(-3, 4, (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim // 2), generator=g).float())
    return torch.cat([half, half], -1)


def test_channel_powers_bring_channels_near_the_median_and_pairs_share_one():
    k = torch.ones(10, 2, 16)
    k[:, 0, 2] = 32.0  # 2^5 the median: divided by 32
    k[:, 0, 2 + 8] = 0.5  # its partner: shares the larger one's power
    k[:, 1, 5] = k[:, 1, 5 + 8] = 1.0 / 9  # 2^-3.17 the median: multiplied by 8
    k[:, 1, 6] = 1e6  # beyond MAX_LOG2: clamped
    a = ks.channel_powers(k)
    assert a[0, 2] == a[0, 10] == 32.0
    assert a[1, 5] == a[1, 13] == 0.125
    assert a[1, 6] == 2.0**ks.MAX_LOG2
    assert int((a != 1).sum()) == 6
    assert torch.equal(a, torch.exp2(torch.log2(a).round()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folding_scales_q_and_k_exactly_and_changes_no_output_bit(dtype):
    """q comes out times a, k divided by a, bit for bit (RoPE included), and every layer's attention
    output, hence the model's hidden states, is unchanged bit for bit (float32 and bf16 weights)."""
    w = outlier_weights()
    ids = torch.tensor(random_prompts(1, 40, 40, seed=3)[0])
    plain = build(w, dtype)
    folded = build(w, dtype)
    powers = random_powers()
    folded.scale_key_channels(powers)
    before, after = ks.record_qk(plain, ids), ks.record_qk(folded, ids)
    group = QWEN_TINY.num_heads // QWEN_TINY.num_kv_heads
    for (q0, k0), (q1, k1), a in zip(before, after, powers):
        assert torch.equal(q1, q0 * a.repeat_interleave(group, 0).to(dtype))
        assert torch.equal(k1, k0 / a.to(dtype))
    assert not torch.equal(before[0][1], after[0][1])
    # each layer's attention output and the hidden states at the end: the same bits
    h0, h1 = (_outputs(m, ids) for m in (plain, folded))
    assert len(h0) == QWEN_TINY.num_layers + 1 and all(torch.equal(a, b) for a, b in zip(h0, h1))


def _outputs(model: LlamaModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention output, then the model's final hidden states."""
    hidden: list[torch.Tensor] = []
    rec = ks._Recorder()
    forward = rec.forward
    rec.forward = lambda *a: hidden.append(forward(*a)) or hidden[-1]  # type: ignore[method-assign]
    cfg = model.cfg
    scratch = ks.LayerCache(torch.zeros(cfg.num_kv_heads, 4, 16, cfg.head_dim, dtype=model.embed.dtype),
                            torch.zeros(cfg.num_kv_heads, 4, 16, cfg.head_dim, dtype=model.embed.dtype))
    meta = ks.AttentionMetadata(torch.arange(ids.numel()), 0, [], [ks.PrefillSeq(0, ids.numel(), ids.numel(), None, None)])
    with torch.no_grad():
        out = model(ids, torch.arange(ids.numel()), [scratch] * cfg.num_layers, meta, rec)
    return [*hidden, out]


def test_folding_refuses_what_would_not_be_exact():
    m = build(outlier_weights())
    good = random_powers()
    with pytest.raises(ValueError, match="do not fit"):
        m.scale_key_channels(good[:, :, :8])
    unpaired = good.clone()
    unpaired[0, 0, 0] *= 2
    unpaired[0, 0, 8] = unpaired[0, 0, 0] * 2
    with pytest.raises(ValueError, match="c \\+ head_dim / 2"):
        m.scale_key_channels(unpaired)
    with pytest.raises(ValueError, match="powers of two"):
        m.scale_key_channels(good * 3)
    m.quantize_linears("int8")
    with pytest.raises(RuntimeError, match="before the linears"):
        m.scale_key_channels(good)


def test_calibration_keeps_powers_where_they_cut_the_error():
    """The planted outlier makes layer 0's int8 score error large and its powers cut it by far more than
    MIN_GAIN; a layer keeps its powers exactly where they cut its error by MIN_GAIN (the tiny qwen2's
    random biases, x10, make layer 1 do so too), the others stay 1. Reproducible; "every_layer" scales
    them all; the tiny llama (no biases) keeps none."""
    m = build(outlier_weights())
    ids = ks.calibration_ids(None, QWEN_TINY.vocab_size)
    s = ks.calibrate(m, ids, "int8")
    assert 0 in s.scaled_layers and s.mse_plain[0] > 10 * s.mse_scaled[0]
    assert s.powers[0, 0, OUTLIER] == s.powers[0, 0, OUTLIER + 8] > 8
    for i, (plain, scaled) in enumerate(zip(s.mse_plain, s.mse_scaled)):
        assert (i in s.scaled_layers) == (plain >= ks.MIN_GAIN * scaled)
        if i not in s.scaled_layers:
            assert torch.equal(s.powers[i], torch.ones_like(s.powers[i]))
    assert len(s.scaled_layers) < QWEN_TINY.num_layers
    again = ks.calibrate(build(outlier_weights()), ids, "int8")
    assert again.digest() == s.digest() != ""
    everywhere = ks.calibrate(m, ids, "int8", every_layer=True)
    assert len(everywhere.scaled_layers) == QWEN_TINY.num_layers and everywhere.digest() != s.digest()
    no_outlier = ks.calibrate(build(random_weights(QWEN_TINY, seed=7, std=0.08)), ids, "int8")
    assert 0 not in no_outlier.scaled_layers
    llama = LlamaModel(TINY)
    llama.load_hf_weights(random_weights(TINY, seed=1234, std=0.08))
    none = ks.calibrate(llama.eval(), ids, "int8")
    assert none.scaled_layers == [] and none.digest() == "" and "none scaled" in none.describe()
    with pytest.raises(ValueError, match="int8 or fp8"):
        ks.calibrate(m, ids, "int4")


def test_calibration_reads_the_tokenizers_text():
    class Tok:
        def encode(self, text: str) -> list[int]:
            return [ord(c) % 500 for c in text]

    ids = ks.calibration_ids(Tok(), 512)
    assert ids.numel() == ks.MAX_CALIBRATION_TOKENS and ids[0] == ord("T")


def _engine(kv_dtype: str, scaling: str = "auto", weights=None) -> LLM:
    return LLM(dtype="float32", device="cpu", model_config=QWEN_TINY, weights=weights or outlier_weights(),
               num_blocks=128, block_size=4, kv_cache_dtype=kv_dtype, kv_key_scaling=scaling)


def test_engine_with_outlier_keys_gets_closer_to_the_unquantized_cache():
    """Teacher-forced next-token distributions of the tiny qwen2 with the planted outlier: the int8 cache
    with scaled keys is much closer to the float32 cache than without (measured 1.5e-6 vs 1.8e-5, 12x less)."""
    ref = _engine("auto").engine
    off = _engine("int8", "off").engine
    auto = _engine("int8", "auto").engine
    assert ref.key_scales is None and off.key_scales is None
    assert auto.key_scales is not None and 0 in auto.key_scales.scaled_layers
    kl_off, kl_auto = [], []
    for ids in random_prompts(4, 48, 48, seed=5, vocab=QWEN_TINY.vocab_size):
        want = teacher_forced_logprobs(ref, ids)
        kl_off.append(kl_and_top1(want, teacher_forced_logprobs(off, ids))[0])
        kl_auto.append(kl_and_top1(want, teacher_forced_logprobs(auto, ids))[0])
    off_kl, auto_kl = torch.cat(kl_off).mean().item(), torch.cat(kl_auto).mean().item()
    assert 0 < auto_kl * 5 < off_kl, (auto_kl, off_kl)


def test_scaled_keys_are_part_of_the_layout_key_and_pairing_checks_it():
    """The digest goes into the layout: an instance whose keys are scaled refuses chunks from one whose
    keys are not (and from one scaled otherwise); equal digests pair."""
    auto = _engine("int8", "auto").engine.kv_layout
    off = _engine("int8", "off").engine.kv_layout
    on = _engine("int8", "on").engine.kv_layout
    assert auto.key().endswith("/K" + auto.key_scales) and off.key_scales == ""
    assert "powers of two" in auto.describe()
    assert layout_mismatch(off.key(), auto.key()) is not None
    assert layout_mismatch(on.key(), auto.key()) is not None
    assert layout_mismatch(_engine("int8", "auto").engine.kv_layout.key(), auto.key()) is None
    bf16 = _engine("auto", "on").engine  # an unquantized cache: nothing to scale, "on" or not
    assert bf16.key_scales is None and "/K" not in bf16.kv_layout.key()
    assert KVLayout.for_model(QWEN_TINY, 4, "int8", torch.float32, "abc").key().endswith("/Kabc")


def test_unknown_key_scaling_is_refused():
    with pytest.raises(ValueError, match="kv_key_scaling"):
        CacheConfig(kv_key_scaling="maybe")


# ---- disaggregation: both ends must have scaled their keys alike ---------------------------------------

def _disagg_engine(role: str, transport, scaling: str = "auto"):  # type: ignore[no-untyped-def]
    from pdserve.config import EngineConfig, KVTransferConfig
    from pdserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        dtype="float32", device="cpu",
        cache=CacheConfig(num_blocks=128, block_size=4, kv_cache_dtype="int8", kv_key_scaling=scaling),
        kv_transfer=KVTransferConfig(role=role, backend=None if role == "both" else "inproc"),
    )
    return LLMEngine(cfg, model_config=QWEN_TINY, weights=outlier_weights(), kv_transport=transport)


def test_disaggregated_scaled_keys_equal_colocated_and_unscaled_peer_is_refused():
    """Prefill and decode instances that both scaled their keys (the same digest) serve what one
    colocated instance does; a decode instance with `--kv-key-scaling off` holds other values for the same
    tokens, and the prefill side refuses to send to it."""
    from pdserve import SamplingParams
    from pdserve.engine.disagg import generate_disaggregated
    from pdserve.errors import InvalidRequestError
    from pdserve.transfer.connector import RemoteDecode, RemotePrefill
    from pdserve.transfer.inproc import InprocHub, InprocTransport

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(4, 5, 30, seed=9, vocab=QWEN_TINY.vocab_size)
    colocated = _disagg_engine("both", None)
    layout = colocated.kv_layout
    assert layout.key_scales != ""
    want: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        colocated.add_request(ids, greedy, req_id=str(i))
    while colocated.has_unfinished_requests():
        for o in colocated.step():
            if o.finished:
                want[int(o.request_id)] = o.outputs[0].token_ids
    hub = InprocHub()
    p = _disagg_engine("prefill", InprocTransport(layout, hub))
    d = _disagg_engine("decode", InprocTransport(layout, hub))
    outs = generate_disaggregated(p, d, prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == want and all(o.error is None for o in outs)
    assert all(len(w) == 10 for w in want)

    hub = InprocHub()
    unscaled = KVLayout.for_model(QWEN_TINY, 4, "int8", torch.float32)
    p = _disagg_engine("prefill", InprocTransport(layout, hub))
    d = _disagg_engine("decode", InprocTransport(unscaled, hub), scaling="off")
    d.add_request(prompts[0], greedy, req_id="d0", kv_transfer=RemotePrefill("t0"))
    d.step()
    ((rid, skip),) = d.take_kv_reservations()
    with pytest.raises(InvalidRequestError, match=f"mismatch: the sender's cache is .*/K{layout.key_scales}"):
        p.add_request(prompts[0], greedy, kv_transfer=RemoteDecode("t0", d.connector.address, skip))  # type: ignore[union-attr]
    d.abort_request(rid)
    d.step()
    assert d.block_manager.num_free_blocks == d.block_manager.num_blocks
