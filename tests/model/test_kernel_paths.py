"""The engine's start log names the kernels in use, and a model shape without a fast attention kernel
says so with a WARNING naming why (no silent fall back to the slow path)."""

from __future__ import annotations

import logging

import pytest

from pdserve import LLM
from pdserve.config import ModelConfig
from pdserve.model.llama import random_weights


def qwen_like(head_dim: int) -> ModelConfig:
    # The 0.5B's head layout (14 / 2) at a toy width.
    return ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=14,
                       num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=256, tie_word_embeddings=False, architecture="qwen2",
                       attention_bias=True)


@pytest.fixture(scope="module")
def cpu_paged():
    from pdserve.attention import get_attention_backend

    try:
        backend = get_attention_backend("cpu-paged")
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")
    if fast_isa(backend) is None:
        pytest.skip("neither AVX-512 BF16 nor AVX2 + FMA kernels in this build")
    return backend


def fast_isa(backend) -> str | None:  # type: ignore[no-untyped-def]
    """How the start log names the fast kernels this build has (AVX-512 BF16 first, else AVX2 + FMA)."""
    k = backend._kernel
    if k.decode_fast_path(True, 9, 3, 64):
        return "AVX-512 BF16"
    return "AVX2 + FMA" if k.decode_avx2_path(9, 3, 64) else None


def start_log(caplog, cfg: ModelConfig, **kw) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdserve"):
        llm = LLM(dtype="bfloat16", device="cpu", model_config=cfg, weights=random_weights(cfg), num_blocks=16,
                  attention_backend="cpu-paged", **kw)
        llm.generate([[1, 2, 3]], use_tqdm=False)
    return [r for r in caplog.records if r.name.startswith("pdserve")]


def test_start_log_names_the_fast_kernels(caplog, cpu_paged):
    """The start log names the kernels this CPU runs (AVX-512 BF16, or AVX2 + FMA on AMD EPYC Zen 3 hosts)
    for decode and prefill, with no WARNING."""
    isa = fast_isa(cpu_paged)
    records = start_log(caplog, qwen_like(64))
    text = "\n".join(r.getMessage() for r in records)
    assert f"attention cpu-paged: decode C++ {isa} (head_dim 64, 7 query heads per kv head)" in text
    assert f"prefill C++ {isa} flash (head_dim 64, 7 query heads per kv head)" in text
    assert "bf16 linear kernels by row count" in text and "fused CPU ops:" in text
    assert not [r for r in records if r.levelno >= logging.WARNING and "attention" in r.getMessage()]


@pytest.mark.parametrize(
    "head_dim,block_size,why",
    [(16, 16, "outside the fast kernels"), (64, 8, "block size 8 is not a multiple of 16")],
)
def test_unsupported_shape_warns_with_the_reason(caplog, cpu_paged, head_dim, block_size, why):
    records = start_log(caplog, qwen_like(head_dim), block_size=block_size)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("attention cpu-paged" in m and why in m for m in warnings), warnings


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fast_kernels_match_the_reference_on_qwen_shapes(cpu_paged, head_dim):
    """A bf16 Qwen2-shaped model (biases, 14 / 2 heads) on the C++ attention, fused ops and packed
    projections against the same model on torch attention and ops: same greedy tokens, logprobs to bf16
    precision, through prefill (prompts longer than a 16-row tile, one chunked) and decode."""
    from pdserve import SamplingParams

    cfg = qwen_like(head_dim)
    weights = random_weights(cfg, seed=7, std=0.05)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [[5, 17, 200, 42, 8, 99], list(range(1, 60)), list(range(100, 137))]
    outs = []
    for fast in (False, True):
        llm = LLM(dtype="bfloat16", device="cpu", model_config=cfg, weights=weights, num_blocks=64,
                  attention_backend="cpu-paged" if fast else "torch", fused_cpu_ops=fast,
                  linear_kernel="auto" if fast else "torch", max_num_batched_tokens=48)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
    for ref, got in zip(*outs):
        ref_ids, got_ids = ref.outputs[0].token_ids, got.outputs[0].token_ids
        for i, (lp_ref, lp_got) in enumerate(zip(ref.outputs[0].logprobs, got.outputs[0].logprobs)):
            for tok in lp_ref.keys() & lp_got.keys():
                assert lp_got[tok] == pytest.approx(lp_ref[tok], abs=0.05), (i, tok)
            if ref_ids[i] != got_ids[i]:
                # bf16 roundings differ between the paths: greedy may part only at a near-tie, after
                # which the two continuations are different sequences.
                assert got_ids[i] in lp_ref and lp_ref[got_ids[i]] == pytest.approx(lp_ref[ref_ids[i]], abs=0.05)
                break
