"""8-bit weights (model/linear.py): per-channel symmetric quantization within half a step of every weight;
each int8 kernel equal to the dequantized reference at every row bucket and within the quantization
bound of the float32 one; the autotune dispatching int8 kernels by row count, keyed by the weight dtype,
and pinning the row-independent one for --batch-invariant; GGUF Q8_0 rows requantized losslessly; and
the engine with `weight_dtype="int8"`: float copies freed, greedy tokens close to bf16, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.model import autotune
from pdserve.model.autotune import ROW_BUCKETS
from pdserve.model.linear import (
    BucketedLinear,
    DequantOneDnnLinear,
    Int8AmxLinear,
    Int8DotLinear,
    Int8Weight,
    _pack_once,
    available_kernels,
    pack_cpu_linears,
    quantize_int8,
    tune_key,
)
from tests.support.fake_kernels import FakeClock, timed_kernels

KERNELS = available_kernels("int8")


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dequantized(w: Int8Weight) -> torch.Tensor:
    return w.scale[:, None] * w.q.float()


def test_quantization_is_within_half_a_step():
    w = rand(70, 576, seed=1) * torch.linspace(0.01, 3.0, 70)[:, None]  # rows of very different ranges
    w[5] = 0.0
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.dtype == torch.float32 and qw.q.abs().max() <= 127
    assert torch.allclose(qw.scale[6:], w[6:].abs().amax(1) / 127)
    assert qw.scale[5] == 1.0 and not qw.q[5].any()
    err = (dequantized(qw) - w).abs()
    assert (err <= qw.scale[:, None] / 2 * (1 + 1e-5)).all()
    # rounding, not truncation: the error is spread over the whole step (uniform: rms = step / sqrt(12))
    rms = (err[6:] / qw.scale[6:, None]).pow(2).mean().sqrt()
    assert 0.25 < rms < 0.33


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("n,k", [(96, 64), (70, 576), (5, 1536), (130, 578)])
def test_each_kernel_matches_the_reference_at_every_bucket(name, n, k):
    w = quantize_int8(rand(n, k, seed=2))
    from pdserve.model.linear import _can_pack

    if not _can_pack(name, w):
        pytest.skip(f"{name} cannot pack K={k}")
    lin = KERNELS[name](w)
    ref_w = dequantized(w)
    for m in sorted({*ROW_BUCKETS, 3, 13, 130, 600}):
        x = rand(m, k, seed=m).bfloat16()
        got = lin(x)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        ref = x.float() @ ref_w.T
        # q is exact in the kernels' arithmetic, and x too but in pdserve's AVX-512 kernel (int16 steps of
        # its row's largest value: below half an output ulp here); what remains is fp32 accumulation
        # order, the bf16 rounding of the output (2^-9 relative; the scaling may round once more, and
        # ATen's scales are bf16 themselves): well inside 2^-7 of the output plus a little absolute slack
        # near zero.
        scale = ref.abs().amax()
        torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=2e-3 * float(scale))
    wide = rand(5, 3 * k, seed=1).bfloat16()
    assert torch.equal(lin(wide[:, k : 2 * k]), lin(wide[:, k : 2 * k].contiguous()))  # rows 3k apart


@pytest.mark.parametrize("name", list(KERNELS))
def test_int8_linear_is_within_the_quantization_bound_of_float32(name):
    """|x.(w - w_q)| <= sum_k |x_k| * step/2 for every output, plus the output's bf16 rounding."""
    k = 576
    w = rand(200, k, seed=3) * 0.05
    lin = KERNELS[name](quantize_int8(w))
    x = rand(17, k, seed=4).bfloat16()
    ref = x.float() @ w.T
    bound = x.float().abs().sum(1, keepdim=True) * (w.abs().amax(1) / 127 / 2)[None, :]
    err = (lin(x).float() - ref).abs()
    assert (err <= bound + ref.abs() * 2**-7).all()
    # and typically far inside it (errors of independent weights cancel): a broken scale would not be
    assert err.mean() < 0.1 * bound.mean()


def test_pdserve_int8_rows_do_not_depend_on_the_batch():
    if "pdserve" not in KERNELS:
        pytest.skip("pdserve's int8 kernel does not build here")
    lin = Int8DotLinear(quantize_int8(rand(300, 1536, seed=5)))
    batch = rand(100, 1536, seed=6).bfloat16()
    full = lin(batch)
    for i in (0, 7, 11, 57, 99):
        assert torch.equal(lin(batch[i : i + 1]), full[i : i + 1])
    wide = rand(9, 3 * 1536, seed=7).bfloat16()
    assert torch.equal(lin(wide[:, 1536:3072]), lin(wide[:, 1536:3072].contiguous()))  # strided rows
    assert lin(wide[:0, :1536]).shape == (0, 300)


amx = pytest.mark.skipif("amx" not in KERNELS, reason="no AMX BF16 here (CPU, OS or compiler)")


@amx
def test_amx_int8_rows_do_not_depend_on_the_batch_and_share_the_panels():
    w = quantize_int8(rand(300, 1536, seed=5))
    both = _pack_once(["pdserve", "amx"], w, KERNELS)
    lin = both["amx"]
    assert isinstance(lin, Int8AmxLinear)
    assert lin.packed is both["pdserve"].packed and lin.scale is both["pdserve"].scale  # type: ignore[attr-defined]
    batch = rand(300, 1536, seed=6).bfloat16()  # two 256-row blocks of one panel: one widening each call
    full = lin(batch)
    for i in (0, 7, 11, 57, 255, 256, 299):
        assert torch.equal(lin(batch[i : i + 1]), full[i : i + 1])
    assert torch.equal(lin(batch[16:48]), full[16:48])
    # x as it is, q exact in bf16: the tile sums of x . q, scaled per column, against float32
    ref = (batch.float() @ w.q.float().T) * w.scale
    torch.testing.assert_close(full.float(), ref, rtol=8e-3, atol=1e-3 * float(ref.abs().amax()))
    wide = rand(9, 3 * 1536, seed=7).bfloat16()
    assert torch.equal(lin(wide[:, 1536:3072]), lin(wide[:, 1536:3072].contiguous()))  # strided rows
    assert lin(wide[:0, :1536]).shape == (0, 300)


@amx
def test_amx_int8_tall_input_goes_in_row_blocks_with_the_same_rows():
    """300 rows of K = 4864 pass the AMX kernel's L2 budget: two 160-row blocks, block-major, a panel
    widened once per block; each row's bits as alone."""
    w = quantize_int8(rand(72, 4864, seed=8))
    lin = KERNELS["amx"](w)
    batch = rand(300, 4864, seed=9).bfloat16()
    full = lin(batch)
    for i in (0, 159, 160, 299):
        assert torch.equal(lin(batch[i : i + 1]), full[i : i + 1])
    ref = (batch.float() @ w.q.float().T) * w.scale
    torch.testing.assert_close(full.float(), ref, rtol=8e-3, atol=1e-3 * float(ref.abs().amax()))


def test_pdserve_int8_rounds_rows_to_int16_steps_of_their_largest_value():
    """pdserve's AVX-512 kernel rounds each row of x to int16 steps of its largest value (vpdpwssd): on a
    row with one outlier 1000x the others every output stays within the rounding's bound, |q| . step / 2
    summed over k, plus the output's bf16 rounding; a zero row gives zeros; inf or NaN in a row makes all
    that row's outputs non-finite (NaN there; float arithmetic gives inf or NaN), the other rows untouched."""
    if "pdserve" not in KERNELS:
        pytest.skip("pdserve's int8 kernel does not build here")
    from pdserve.model.linear import _kernel_int8

    w = quantize_int8(rand(64, 576, seed=8) * 0.05)
    lin = Int8DotLinear(w)
    x = rand(4, 576, seed=9)
    x[1, 7] = 1000.0
    x[2] = 0.0
    x = x.bfloat16()
    ref = x.float() @ dequantized(w).T
    got = lin(x).float()
    step = x.float().abs().amax(1, keepdim=True) / 32767
    bound = (dequantized(w).abs().sum(1)[None, :] * step / 2) if _kernel_int8().isa() == "avx512-bf16" else 0.0
    err = (got - ref).abs()
    assert (err <= bound + ref.abs() * 2**-8 + 1e-6).all(), (err - bound - ref.abs() * 2**-8).max()
    assert not got[2].any()
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 100] = bad
        out = lin(y)
        assert not out[3].float().isfinite().any() and torch.equal(out[:3], lin(x[:3]))


# --- the autotune with int8 candidates -----------------------------------------------------------


def fake_int8_kernels(clock: FakeClock, cost, served: list):
    """The real int8 kernels, their calls advancing the fake clock by `cost(name, rows)`, logged."""
    return timed_kernels(KERNELS, clock, cost, served)


def int8_weights() -> dict[str, list[Int8Weight]]:
    qkv = [quantize_int8(rand(96, 64, seed=i)) for i in range(3)]
    return {"qkv": qkv, "head": [quantize_int8(rand(130, 64, seed=9))]}


def test_auto_dispatches_int8_kernels_by_rows():
    if len(KERNELS) < 2:
        pytest.skip("one int8 kernel here")
    names = list(KERNELS)
    small, large = names[1], names[0]  # e.g. pdserve's up to 4 rows, dequantize + oneDNN from 16 on

    def cost(name: str, rows: int) -> float:
        return {small: 1e-3 * rows, large: 5e-3}.get(name, 1.0)

    clock, served = FakeClock(), []
    ws = int8_weights()
    kernels = fake_int8_kernels(clock, cost, served)
    plan = pack_cpu_linears(ws, "auto", buckets=(1, 4, 16, 64), timer=clock, kernels=kernels)
    assert plan.weight_dtype == "int8" and "int8" in plan.describe()
    assert plan.table is not None and plan.table.winners("qkv") == [small, small, large, large]
    lin = plan.packed["qkv"][1]
    assert isinstance(lin, BucketedLinear) and [k.kernel for k in lin.kernels] == [small, large]
    for rows in (1, 4, 5, 16, 64, 200):
        served.clear()
        x = rand(rows, 64, seed=rows).bfloat16()
        got = lin(x)
        assert served == [(small if rows <= 4 else large, rows)]
        torch.testing.assert_close(got.float(), x.float() @ dequantized(ws["qkv"][1]).T, rtol=8e-3, atol=2e-2)


def test_tune_key_and_cache_file_include_the_weight_dtype(tmp_path):
    bf16 = {"qkv": [rand(96, 64, seed=1).bfloat16()]}
    int8 = {"qkv": [quantize_int8(rand(96, 64, seed=1))]}
    kb, ki = tune_key(bf16, ["onednn", "pdserve"], (1, 4)), tune_key(int8, ["onednn", "pdserve"], (1, 4))
    assert kb["weight_dtype"] == "bfloat16" and ki["weight_dtype"] == "int8"
    assert kb["ops"] == ki["ops"]  # the same shapes ...
    assert autotune.cache_path(str(tmp_path), "linear", kb) != autotune.cache_path(str(tmp_path), "linear", ki)
    # the int8 kernel's own source is what the key digests
    assert kb["pdserve_kernel"] != ki["pdserve_kernel"]


def test_batch_invariant_pins_pdserve_int8_kernel():
    if "pdserve" not in KERNELS:
        pytest.skip("pdserve's int8 kernel does not build here")
    plan = pack_cpu_linears(int8_weights(), "auto", batch_invariant=True)
    pinned = plan.kind if plan.table is None else plan.table.pinned  # AMX hosts: pdserve's two kernels measured
    assert pinned in ("pdserve", "amx")
    assert all(isinstance(p, Int8DotLinear) for p in plan.packed["qkv"])  # (Int8AmxLinear is one too)


def test_named_kernels_and_fallback_for_shapes_a_kernel_cannot_take():
    ws = {"odd": [quantize_int8(rand(40, 72, seed=1))]}  # K=72: ATen's kernel needs K % 16 == 0
    if "torch" in KERNELS:
        plan = pack_cpu_linears(ws, "torch")
        assert isinstance(plan.packed["odd"][0], DequantOneDnnLinear)
    plan = pack_cpu_linears(ws, "onednn")
    x = rand(3, 72, seed=2).bfloat16()
    torch.testing.assert_close(plan.packed["odd"][0](x).float(), x.float() @ dequantized(ws["odd"][0]).T,
                               rtol=8e-3, atol=2e-2)
    with pytest.raises(ValueError):
        pack_cpu_linears(ws, "mkl")


def test_gguf_q8_0_rows_requantize_losslessly():
    """A Q8_0 tensor (blocks of 32, fp16 scale each) dequantized to float32 and requantized per channel
    keeps its values exactly when a row's blocks share one scale: no detour through bf16 rounds them."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    w = rand(8, 128, seed=11).clamp(-3.9, 3.9).numpy()
    w[:, ::32] = 4.0 * np.sign(w[:, ::32] + 1e-9)  # every block of a row has the same max |w|: one scale per row
    w[:, 0] = 4.0
    data = quantize(w, gguf.GGMLQuantizationType.Q8_0)
    deq = torch.from_numpy(dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape).astype(np.float32))
    qw = quantize_int8(deq)
    assert torch.equal(dequantized(qw), deq)
    assert not torch.equal(deq.bfloat16().float(), deq)  # whereas bf16 would have changed some


# --- the engine -----------------------------------------------------------------------------------


def make_llm(tiny_weights, **kw):
    from pdserve import LLM
    from tests.support.tiny import TINY

    kw.setdefault("dtype", "bfloat16")
    kw.setdefault("device", "cpu")
    return LLM(model_config=TINY, weights=tiny_weights, num_blocks=64, block_size=4, kernel_cache_dir="", **kw)


def test_engine_int8_frees_the_float_weights_and_agrees_with_bf16(tiny_weights):
    from pdserve import SamplingParams
    from pdserve.model.llama import LlamaModel
    from tests.support.tiny import TINY
    from tests.support.tiny import random_prompts

    prompts = random_prompts(4, 4, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    bf16 = make_llm(tiny_weights, weight_dtype="auto")
    int8 = make_llm(tiny_weights, weight_dtype="int8")
    model = int8.engine.model
    assert model.linear_plan is not None and model.linear_plan.weight_dtype == "int8"
    assert all(getattr(layer, n).numel() == 0 for layer in model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert model.lm_head.numel() == 0 and model.embed.dtype == torch.bfloat16  # untied head freed; embedding kept
    wb8, wb16 = model.weight_bytes(), bf16.engine.model.weight_bytes()
    float_ws = [t for ws in LlamaModel(TINY).linear_weights().values() for t in ws]  # bf16's are freed
    numel, rows = sum(t.numel() for t in float_ws), sum(t.shape[0] for t in float_ws)
    assert wb8["total"] < wb16["total"]
    # at most a packed int8 copy and the plain one (the kernels that win a bucket), and their scales
    assert wb8["linears"] <= 2 * numel + (4 + 4 + 2) * rows
    assert wb8["other"] == sum(p.numel() * p.element_size() for p in model.parameters())  # embedding, norms
    outs = {}
    for name, llm in (("bf16", bf16), ("int8", int8)):
        outs[name] = llm.generate(prompts, params, use_tqdm=False)
    agree = total = 0
    for a, b in zip(outs["bf16"], outs["int8"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        total += len(ta)
        agree += next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for tok in first_a.keys() & first_b.keys():
            assert first_a[tok] == pytest.approx(first_b[tok], abs=0.1)
    assert agree >= 0.5 * total  # the tiny model's margins are wide: observed all 64 tokens equal


def test_int8_errors_are_clear(tiny_weights):
    with pytest.raises(ValueError, match="bf16 activations"):
        make_llm(tiny_weights, weight_dtype="int8", dtype="float32")
    with pytest.raises(ValueError, match="CPU only"):
        make_llm(tiny_weights, weight_dtype="int8", device="meta")
    with pytest.raises(ValueError, match="unknown weight dtype"):
        make_llm(tiny_weights, weight_dtype="int4")


def test_cli_passes_weight_dtype():
    import argparse

    from pdserve.cli import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--weight-dtype", "int8"])).weight_dtype == "int8"
    assert engine_config(p.parse_args([])).weight_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--weight-dtype", "int4"])
