"""pdserve's bf16 projection kernels (model/linear.py), AVX-512 and AMX: x @ W.T to bf16 accuracy for
any row count (one and several row tiles, several k slices), output widths off the 32-column panels,
strided rows; each row's result independent of the rows around it; the AMX kernel sharing the AVX-512
one's panels; and the engine giving the same greedy tokens with them as with oneDNN on the tiny model."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.linear import (
    AmxLinear,
    Bf16DotLinear,
    _pack_once,
    amx_bf16,
    cpu_linear_packer,
    onednn_bf16,
    resident_bytes,
)

try:
    cpu_linear_packer("pdserve")
except ValueError as e:  # no compiler or no AVX-512 BF16 here
    pytest.skip(str(e), allow_module_level=True)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("n,k", [(96, 64), (70, 576), (5, 1536), (960, 578)])
@pytest.mark.parametrize("m", [1, 3, 12, 13, 16, 40, 130, 300])
def test_matches_float32_reference(m, n, k):
    x, w = rand(m, k, seed=1), rand(n, k, seed=2)
    got = Bf16DotLinear(w)(x)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ref = x.float() @ w.float().T
    # bf16 inputs are exact in fp32; the only error is fp32 accumulation order and the final bf16 rounding.
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3 * k**0.5)


def test_rows_do_not_depend_on_the_batch():
    """The same row alone, among 12 (one tile), among 100 (several tiles, sliced k) and among 400 (several
    row blocks) gives the same bits."""
    w = rand(300, 1536, seed=3)
    lin = Bf16DotLinear(w)
    big = rand(400, 1536, seed=4)
    batch = big[:100]
    full = lin(batch)
    assert torch.equal(lin(big)[:100], full)
    for i in (0, 7, 11, 57, 99):
        assert torch.equal(lin(batch[i : i + 1]), full[i : i + 1])
        lo = (i // 12) * 12
        assert torch.equal(lin(batch[lo : lo + 12])[i - lo], full[i])


def test_strided_rows_and_empty_input():
    w = rand(64, 128, seed=5)
    lin = Bf16DotLinear(w)
    wide = rand(9, 384, seed=6)
    x = wide[:, 128:256]  # rows 384 apart, as a view into a fused projection's output
    assert torch.equal(lin(x), lin(x.contiguous()))
    assert lin(wide[:0, :128]).shape == (0, 64)


def test_engine_greedy_matches_library_gemm(tiny_weights):
    """Against oneDNN's bf16 GEMM where the CPU has one, else against the fp32 GEMM on the same bf16 values."""
    from pdserve import LLM, SamplingParams
    from tests.support.tiny import TINY, random_prompts

    peer = "onednn" if onednn_bf16() else "fp32"
    prompts = random_prompts(4, 4, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = {}
    kinds = ("pdserve", "amx", peer) if amx_bf16() else ("pdserve", peer)
    for kind in kinds:
        llm = LLM(dtype="bfloat16", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=64,
                  block_size=4, linear_kernel=kind)
        outs[kind] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in [p for kind in kinds[:-1] for p in zip(outs[kind], outs[peer])]:
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in lp_a.keys() & lp_b.keys():
                assert lp_a[tok] == pytest.approx(lp_b[tok], abs=0.05)


# ---- the AMX kernel (same panels, AMX BF16 tiles) ----------------------------------------------------
amx = pytest.mark.skipif(not amx_bf16(), reason="no AMX BF16 here (CPU, OS or compiler)")


@amx
@pytest.mark.parametrize("n,k", [(96, 64), (70, 576), (5, 1536), (960, 896)])
@pytest.mark.parametrize("m", [1, 3, 15, 16, 17, 32, 33, 100, 300, 530])
def test_amx_matches_float32_reference(m, n, k):
    x, w = rand(m, k, seed=1), rand(n, k, seed=2)
    got = AmxLinear(w)(x)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=8e-3, atol=1e-3 * k**0.5)


@amx
def test_amx_rows_do_not_depend_on_the_batch():
    """A row alone, in a partial last tile, in a tile pair and among 300 (two row blocks) gives the same bits."""
    lin = AmxLinear(rand(300, 1536, seed=3))
    batch = rand(300, 1536, seed=4)
    full = lin(batch)
    for i in (0, 15, 16, 31, 57, 271, 299):
        assert torch.equal(lin(batch[i : i + 1]), full[i : i + 1])
        assert torch.equal(lin(batch[i : i + 20])[0], full[i])


@amx
@pytest.mark.parametrize("m, k", [(700, 1536), (300, 4864)])
def test_amx_tall_inputs_go_in_row_blocks_with_the_same_rows(m, k):
    """x past the kernel's L2 budget runs block-major (3 blocks of 256 rows at K = 1536, 2 of 160 at
    K = 4864): the same bits per row as alone, and right against float32."""
    w, x = rand(72, k, seed=11), rand(m, k, seed=12)
    lin = AmxLinear(w)
    full = lin(x)
    for i in sorted({0, 159, 160, 255, 256, 511, m - 1} & set(range(m))):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1])
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, rtol=8e-3, atol=1e-3 * k**0.5)


@amx
def test_amx_strided_rows_and_empty_input():
    lin = AmxLinear(rand(64, 128, seed=5))
    wide = rand(37, 384, seed=6)
    x = wide[:, 128:256]
    assert torch.equal(lin(x), lin(x.contiguous()))
    assert lin(wide[:0, :128]).shape == (0, 64)


@amx
def test_amx_shares_the_avx512_kernels_panels_and_declines_odd_k():
    w = rand(96, 576, seed=7)
    kernels = {"pdserve": Bf16DotLinear, "amx": AmxLinear}
    both = _pack_once(["pdserve", "amx"], w, kernels)
    assert both["amx"].packed is both["pdserve"].packed  # type: ignore[attr-defined]
    assert resident_bytes([t for k in both.values() for t in k.weight_tensors()]) == 96 * 576 * 2  # type: ignore[attr-defined]
    x = rand(40, 576, seed=8)
    torch.testing.assert_close(both["amx"](x).float(), both["pdserve"](x).float(), rtol=8e-3, atol=0.03)
    # K not a multiple of 32: a pinned "amx" packs the library's kernel for that weight instead
    odd = cpu_linear_packer("amx")(rand(96, 578, seed=9))  # type: ignore[misc]
    assert not isinstance(odd, AmxLinear)
