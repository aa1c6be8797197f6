"""`pack_cpu_linears` (model/linear.py): "auto" packs per op the kernels that measured fastest per row
bucket and dispatches by row count; every row count gives x @ W.T to bf16 rounding; a kernel that wins
no bucket is not packed; the decision is read back from the cache without timing; named kernels and
`batch_invariant` pin one kernel; the engine keeps the plan. Timings come from a fake clock."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.linear import (
    BucketedLinear,
    Fp32Linear,
    OneDnnLinear,
    TorchLinear,
    available_kernels,
    onednn_bf16,
    pack_cpu_linears,
)
from tests.support.fake_kernels import FakeClock, timed_kernels

if not torch.backends.mkldnn.is_available():
    pytest.skip("needs oneDNN (mkldnn) for a second kernel", allow_module_level=True)

BUCKETS = (1, 4, 16, 64)
# The library GEMM the fake timings call "onednn": oneDNN's bf16 one where the CPU has it, else the fp32 one
# (a CPU without AVX-512 has no oneDNN bf16 matmul).
LIBRARY, LIBRARY_NAME = (OneDnnLinear, "onednn") if onednn_bf16() else (Fp32Linear, "fp32")


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def fake_kernels(clock: FakeClock, cost, served: list | None = None):
    """Real kernels whose calls advance the fake clock by `cost(name, rows)` and log who served them."""
    return timed_kernels({"onednn": LIBRARY, "torch": TorchLinear}, clock, cost, served)


def small_rows_to_torch(name: str, rows: int) -> float:
    return (1e-3 * rows) if name == "torch" else 5e-3  # torch wins up to 4 rows, oneDNN from 16 on


def weights() -> dict[str, list[torch.Tensor]]:
    return {"qkv": [rand(96, 64, seed=i) for i in range(3)], "head": [rand(130, 64, seed=9)]}


def kernel_names(packed) -> list[str]:
    if isinstance(packed, BucketedLinear):
        return [k.kernel for k in packed.kernels]
    return [packed.kernel]


def test_auto_dispatches_by_rows_and_matches_float32():
    clock = FakeClock()
    served: list = []
    ws = weights()
    plan = pack_cpu_linears(ws, "auto", buckets=BUCKETS, timer=clock, kernels=fake_kernels(clock, small_rows_to_torch, served))
    assert plan.table is not None and plan.table.winners("qkv") == ["torch", "torch", "onednn", "onednn"]
    lin = plan.packed["qkv"][1]
    assert isinstance(lin, BucketedLinear) and kernel_names(lin) == ["torch", "onednn"]
    for rows in (1, 3, 4, 5, 16, 17, 64, 200):
        served.clear()
        x = rand(rows, 64, seed=100 + rows)
        got = lin(x)
        assert served == [("torch" if rows <= 4 else "onednn", rows)]
        ref = x.float() @ ws["qkv"][1].float().T
        torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-3 * 64**0.5)


def test_a_kernel_that_wins_no_bucket_is_not_packed():
    clock = FakeClock()
    plan = pack_cpu_linears(
        weights(), "auto", buckets=BUCKETS, timer=clock,
        kernels=fake_kernels(clock, lambda name, rows: 1e-3 if name == "onednn" else 1.0),
    )
    for op in ("qkv", "head"):
        assert all(kernel_names(p) == ["onednn"] for p in plan.packed[op])


def test_decision_is_cached_and_reused_without_timing(tmp_path):
    clock = FakeClock()
    first = pack_cpu_linears(weights(), "auto", buckets=BUCKETS, timer=clock, cache_dir=str(tmp_path),
                             kernels=fake_kernels(clock, small_rows_to_torch))
    assert not first.cache_hit and first.cache and first.cache.startswith(str(tmp_path))

    def no_timing() -> float:
        raise AssertionError("a cache hit must not measure")

    again = pack_cpu_linears(weights(), "auto", buckets=BUCKETS, timer=no_timing, cache_dir=str(tmp_path),
                             kernels=fake_kernels(clock, small_rows_to_torch))
    assert again.cache_hit and again.cache == first.cache
    assert again.table == first.table
    assert "cached" in again.describe() and "rows" in again.describe()
    # other shapes: another key, measured again
    other = {"qkv": [rand(96, 32, seed=1)], "head": [rand(130, 32, seed=2)]}
    fresh = pack_cpu_linears(other, "auto", buckets=BUCKETS, timer=clock, cache_dir=str(tmp_path),
                             kernels=fake_kernels(clock, small_rows_to_torch))
    assert not fresh.cache_hit and fresh.cache != first.cache


def test_named_kernel_pins_every_row_count():
    plan = pack_cpu_linears(weights(), LIBRARY_NAME)
    assert plan.table is None and all(isinstance(p, LIBRARY) for p in plan.packed["qkv"])
    with pytest.raises(ValueError):
        pack_cpu_linears(weights(), "mkl")


def test_batch_invariant_pins_the_row_independent_kernel():
    if "pdserve" not in available_kernels():
        pytest.skip("pdserve's kernel does not build here")
    from pdserve.model.linear import AmxLinear, Bf16DotLinear

    plan = pack_cpu_linears(weights(), "auto", batch_invariant=True)
    # pdserve's AVX-512 kernel alone, or (on AMX hosts) whichever of it and the AMX one is faster at decode
    pinned = plan.kind if plan.table is None else plan.table.pinned
    assert pinned in ("pdserve", "amx")
    kernel = Bf16DotLinear if pinned == "pdserve" else AmxLinear
    assert all(type(p) is kernel for p in plan.packed["qkv"])
    lin = plan.packed["qkv"][0]
    batch = rand(70, 64, seed=5)
    full = lin(batch)
    for i in (0, 13, 69):
        assert torch.equal(lin(batch[i : i + 1]), full[i : i + 1])


def test_batch_invariant_without_a_row_independent_kernel_pins_the_decode_winner():
    clock = FakeClock()
    plan = pack_cpu_linears(weights(), "auto", batch_invariant=True, buckets=BUCKETS, timer=clock,
                            kernels=fake_kernels(clock, small_rows_to_torch))
    # torch: 3 * (1+4+16+64) ms per op vs oneDNN 3 * 4 * 5 ms: oneDNN is faster summed over decode buckets
    assert plan.table is not None and plan.table.pinned == "onednn"
    assert all(kernel_names(p) == ["onednn"] for p in plan.packed["qkv"])


def test_real_measurement_is_correct_at_every_bucket():
    """No fake clock: whatever wins here, each row count still computes x @ W.T."""
    ws = {"o": [rand(64, 64, seed=i) for i in range(2)]}
    plan = pack_cpu_linears(ws, "auto", buckets=(1, 8, 32))
    for rows in (1, 2, 8, 9, 32, 40):
        x = rand(rows, 64, seed=rows)
        torch.testing.assert_close(plan.packed["o"][0](x).float(), x.float() @ ws["o"][0].float().T,
                                   rtol=8e-3, atol=1e-2)


def test_engine_keeps_the_plan(tiny_weights, tmp_path):
    from pdserve import LLM
    from tests.support.tiny import TINY

    llm = LLM(dtype="bfloat16", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=32,
              block_size=4, kernel_cache_dir=str(tmp_path))
    plan = llm.engine.model.linear_plan
    assert plan is not None and plan.kind == "auto" and set(plan.packed) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert plan.cache and plan.cache.startswith(str(tmp_path))
    out = llm.generate([[1, 2, 3]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    fp32 = LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=32, block_size=4)
    assert fp32.engine.model.linear_plan is None


def test_a_busy_measurement_is_used_but_not_cached(tmp_path):
    clock = FakeClock()
    n = {"calls": 0}

    def stalled(name: str, rows: int) -> float:
        n["calls"] += 1
        return small_rows_to_torch(name, rows) * (1 if n["calls"] % 5 == 0 else 20)

    plan = pack_cpu_linears(weights(), "auto", buckets=BUCKETS, timer=clock, cache_dir=str(tmp_path),
                            kernels=fake_kernels(clock, stalled))
    assert plan.table.noise > 2 and "not cached" in plan.describe()
    assert list(tmp_path.iterdir()) == []


def test_batch_invariant_engine_gives_a_request_the_same_tokens_alone_and_in_a_batch(tmp_path):
    """The promise of --batch-invariant: greedy tokens and log-probs of a request do not depend on the
    requests batched with it (bf16, every row count through the row-independent kernel). At these
    widths (SmolLM2's 576 / 1536) oneDNN's log-probs do change with the batch (6 of 8 requests when
    measured), so this fails for a batch-dependent kernel; TINY's 64-wide layers would not show it."""
    if "pdserve" not in available_kernels():
        pytest.skip("pdserve's kernel does not build here")
    import dataclasses

    from pdserve import LLM, SamplingParams
    from pdserve.model.llama import random_weights
    from tests.support.tiny import TINY, random_prompts

    cfg = dataclasses.replace(TINY, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                              head_dim=64, num_layers=2)
    llm = LLM(dtype="bfloat16", device="cpu", model_config=cfg, weights=random_weights(cfg, seed=1234, std=0.05),
              num_blocks=256, block_size=4, batch_invariant=True, enable_prefix_caching=False,
              kernel_cache_dir=str(tmp_path))
    plan = llm.engine.model.linear_plan
    assert (plan.kind if plan.table is None else plan.table.pinned) in ("pdserve", "amx")
    prompts = random_prompts(8, 3, 40, seed=11)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    together = llm.generate(prompts, params, use_tqdm=False)
    for p, t in zip(prompts, together):
        alone = llm.generate([p], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == t.outputs[0].token_ids
        assert alone.outputs[0].logprobs == t.outputs[0].logprobs


def test_a_kernel_winning_two_separate_runs_of_buckets_is_packed_once():
    clock = FakeClock()

    def cost(name: str, rows: int) -> float:  # torch wins at 1 and 64 rows, oneDNN at 4 and 16 (both monotone)
        ms = {"torch": {1: 1.0, 4: 3.0, 16: 3.2, 64: 3.3}, "onednn": {1: 2.0, 4: 2.0, 16: 3.0, 64: 4.0}}
        return 1e-3 * ms[name][rows]

    plan = pack_cpu_linears(weights(), "auto", buckets=BUCKETS, timer=clock, kernels=fake_kernels(clock, cost))
    lin = plan.packed["qkv"][0]
    assert isinstance(lin, BucketedLinear) and kernel_names(lin) == ["torch", "onednn", "torch"]
    assert lin.kernels[0] is lin.kernels[2]  # one copy of the weights per kernel, however many runs it serves


def test_fp32_kernel_is_a_bf16_gemm_on_the_fp32_units():
    """`--linear-kernel fp32`: float32 copies of the bf16 weights, the output rounded once to bf16; bf16
    products are exact in fp32, so it agrees with the float32 product of the same bf16 values to bf16's
    rounding. It is a candidate everywhere (the compute-bound kernel where oneDNN has no bf16 matmul)."""
    ws = weights()
    assert "fp32" in available_kernels()
    plan = pack_cpu_linears(ws, "fp32")
    assert plan.table is None and all(isinstance(p, Fp32Linear) for p in plan.packed["qkv"])
    for rows in (1, 5, 70):
        x = rand(rows, 64, seed=rows)
        got = plan.packed["head"][0](x)
        ref = x.float() @ ws["head"][0].float().T
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=4e-3, atol=1e-3)


def test_onednn_is_a_bf16_candidate_only_where_it_has_a_bf16_matmul():
    """On a CPU without AVX-512 (AMD Zen 2/3) oneDNN refuses to pack a bf16 weight: "auto" must not list it
    there (the first start crashed on such a host), and naming it must say what to use instead."""
    if onednn_bf16():
        assert "onednn" in available_kernels()
        return
    assert "onednn" not in available_kernels()
    with pytest.raises(ValueError, match="fp32"):
        pack_cpu_linears(weights(), "onednn")
