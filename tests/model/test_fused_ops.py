"""The fused C++ ops give the reference torch ops' results: bit for bit where the reference rounds the
same way, within one bf16 ulp where a float32 sum is reduced in another order."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.ops import TorchOps, fused_cpu_ops
from tests.support.tiny import TINY

fused = fused_cpu_ops()
pytestmark = pytest.mark.skipif(fused is None, reason="no C++ compiler for the fused ops")


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place (bf16 as int16 bit patterns of same-signed values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("hidden", [576, 896, 1536])  # SmolLM2, Qwen2.5 0.5B, 1.5B
def test_add_rms_norm(dtype, rows, hidden):
    x, delta, w = rand(rows, hidden, dtype=dtype, seed=1), rand(rows, hidden, dtype=dtype, seed=2), rand(hidden, dtype=dtype, seed=3)
    ref_x, ref_h = TorchOps.add_rms_norm(x.clone(), delta, w, 1e-5)
    got_x, got_h = fused.add_rms_norm(x.clone(), delta, w, 1e-5)
    assert torch.equal(got_x, ref_x)  # the add rounds exactly as torch's
    if dtype == torch.bfloat16:
        assert ulp_diff(got_h, ref_h).max() <= 1
        assert (got_h == ref_h).float().mean() > 0.99
    else:
        torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
    # Without a delta: only the norm, and x is left alone.
    got_x, got_h = fused.add_rms_norm(x.clone(), None, w, 1e-5)
    ref_h = TorchOps.add_rms_norm(x, None, w, 1e-5)[1]
    assert torch.equal(got_x, x)
    if dtype == torch.bfloat16:
        assert ulp_diff(got_h, ref_h).max() <= 1
    else:
        torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(9, 3, 64), (14, 2, 64), (12, 2, 128)], ids=["smollm2", "qwen-0.5b", "qwen-1.5b"])
def test_rope_qkv_bit_identical(dtype, heads):
    """Rotate-half (NEOX) RoPE, the order Qwen2's GGUF keeps its rows in and llama's is restored to."""
    t, (h, kvh, d) = 9, heads
    qkv = rand(t, (h + 2 * kvh) * d, dtype=dtype, seed=4)
    angles = rand(t, 1, d, dtype=torch.float32, seed=5)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ref = TorchOps.rope_qkv(qkv.clone(), cos, sin, h, kvh, d)
    got = fused.rope_qkv(qkv.clone(), cos, sin, h, kvh, d)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        assert torch.equal(a, b)


def test_model_forward_matches_with_fused_ops(tiny_weights):
    """The whole tiny model in bf16: fused and reference ops give the same logits to bf16 precision."""
    from pdserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [[5, 17, 300, 42, 8, 99], list(range(1, 40))]
    outs = []
    for use_fused in (False, True):
        # batch_invariant: the fused ops at every row count (not the measured per-bucket choice)
        llm = LLM(dtype="bfloat16", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=64,
                  block_size=4, fused_cpu_ops=use_fused, batch_invariant=True)
        assert (llm.engine.model.ops.name == "fused-cpu") is use_fused
        outs.append(llm.generate(prompts, params, use_tqdm=False))
    for ref, got in zip(*outs):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for lp_ref, lp_got in zip(ref.outputs[0].logprobs, got.outputs[0].logprobs):
            for tok in lp_ref.keys() & lp_got.keys():
                assert lp_got[tok] == pytest.approx(lp_ref[tok], abs=0.05)


@pytest.mark.parametrize("rows", [1, 9, 40])
@pytest.mark.parametrize("ffn", [1536 + 5, 4864, 8960])  # off 16; Qwen2.5 0.5B; 1.5B
def test_silu_mul(rows, ffn):
    """F.silu(gate) * up with its two bf16 roundings: the fused op's own exp may differ from torch's in
    the last float32 bit, which changes a bf16 result only when it sits on a rounding boundary."""
    gate_up = (rand(rows, 2 * ffn, dtype=torch.float32, seed=6) * 4).bfloat16()
    ref = TorchOps.silu_mul(gate_up)
    got = fused.silu_mul(gate_up)
    assert got.shape == ref.shape
    assert ulp_diff(got, ref).max() <= 1
    assert (got == ref).float().mean() > 0.999
    # Large magnitudes: exp overflows to inf (silu -> -0) or underflows to 0 (silu -> x), as in torch.
    big = torch.tensor([[-200.0, -90.0, 90.0, 200.0, 3.0, 5.0, 7.0, 9.0]]).bfloat16()
    assert torch.equal(fused.silu_mul(big), TorchOps.silu_mul(big))


def injected_ops_table(fused_wins: list[bool]) -> "TuneTable":  # noqa: F821
    from pdserve.model.autotune import TuneTable
    from pdserve.model.ops import OP_NAMES, OPS_ROWS

    per = {"fused-cpu": [1.0 if w else 2.0 for w in fused_wins], "torch": [2.0 if w else 1.0 for w in fused_wins]}
    return TuneTable(OPS_ROWS, {op: dict(per) for op in OP_NAMES}, ("fused-cpu", "torch"))


def test_ops_choice_from_injected_timings(monkeypatch, tmp_path):
    """The faster implementation per row bucket: the fused ops alone, the torch ops alone, or a mix that
    dispatches by row count (and computes what both do); cached and reused without timing; pinned to the
    fused ops by batch_invariant."""
    from pdserve.model import ops as ops_mod
    from pdserve.model.ops import MeasuredOps, TorchOps, choose_ops

    fused = fused_cpu_ops()
    if fused is None:
        pytest.skip("fused ops do not build here")
    shapes = (64, 4, 2, 16, 96, 2)
    results = iter([injected_ops_table([True] * 4), injected_ops_table([False] * 4),
                    injected_ops_table([True, True, False, False])])
    calls = []
    monkeypatch.setattr(ops_mod, "measure_ops", lambda *a, **kw: calls.append(a) or next(results))
    assert choose_ops(fused, shapes) is fused
    assert isinstance(choose_ops(fused, shapes), TorchOps)
    mixed = choose_ops(fused, shapes, cache_dir=str(tmp_path))
    assert isinstance(mixed, MeasuredOps) and len(calls) == 3
    assert mixed._impl("silu_mul", 1) is fused and mixed._impl("silu_mul", 8) is fused
    assert isinstance(mixed._impl("silu_mul", 9), TorchOps) and isinstance(mixed._impl("rope_qkv", 4096), TorchOps)
    assert isinstance(choose_ops(fused, shapes, cache_dir=str(tmp_path)), MeasuredOps) and len(calls) == 3  # cached
    assert choose_ops(fused, shapes, batch_invariant=True) is fused and len(calls) == 3
    for rows in (3, 64):
        gate_up = rand(rows, 192, dtype=torch.bfloat16, seed=rows)
        assert torch.equal(mixed.silu_mul(gate_up), TorchOps.silu_mul(gate_up))  # within 1 ulp in general


def test_measure_ops_fills_the_table():
    """Smoke: the real timing runs both implementations at every row count."""
    from pdserve.model.ops import OP_NAMES, measure_ops

    fused = fused_cpu_ops()
    if fused is None:
        pytest.skip("fused ops do not build here")
    t = measure_ops(fused, 64, 4, 2, 16, 96, 2, rows=(1, 8), repeats=1)
    assert t.buckets == (1, 8) and set(t.seconds) == set(OP_NAMES)
    assert all(0 < v < float("inf") for ts in t.seconds.values() for row in ts.values() for v in row)
