"""`--attention-backend auto` on CPU (attention/cpu_paged.py): the plan picked from injected timings per
phase and bucket, cached on disk and reused without timing, pinned by --batch-invariant, and the
dispatching backend equal to the reference for every choice (and really dispatching: a kernel the plan
does not choose is never called)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from pdserve.attention import cpu_paged as cp
from pdserve.attention.cpu_paged import AttentionPlan, CpuPagedAttention
from pdserve.kv.cache import LayerCache
from pdserve.model.autotune import TuneTable
from tests.model.test_attention_quant import mixed_step


@pytest.fixture(scope="module")
def kernel_ok():
    try:
        cp.load_kernel()
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")


def tables(decode: dict[str, list[float]], prefill: dict[str, list[float]], noise: float = 1.0):
    return (
        TuneTable(cp.DECODE_BATCHES, {"decode": decode}, cp.DECODE_KERNELS, noise=noise),
        TuneTable(cp.PREFILL_LENS, {"prefill": prefill}, cp.PREFILL_KERNELS, noise=noise),
    )


# torch's decode wins one batch but loses overall; SDPA wins short prompts, the C++ kernel long ones.
DECODE = {"cpp": [2e-4, 1e-3, 4e-3], "torch": [1e-4, 2e-3, 2e-2]}
# AMX (where the CPU has it) wins the mid lengths, the AVX-512 kernel the longest.
PREFILL = {"cpp": [1e-3, 2e-3, 8e-3, 3e-2, 1e-1], "amx": [2e-3, 3e-3, 7e-3, 2e-2, 2e-1],
           "sdpa": [5e-4, 1e-3, 9e-3, 6e-2, 2e-1]}


def test_plan_from_injected_timings():
    plan = AttentionPlan.from_tables(*tables(DECODE, PREFILL))
    assert plan.decode == "cpp"  # least summed over the batches, not the winner at batch 1
    assert plan.prefill == ("sdpa", "sdpa", "amx", "amx", "cpp")
    assert [plan.prefill_kernel(n) for n in (1, 16, 17, 64, 65, 300, 1024, 1025, 5000)] == [
        "sdpa", "sdpa", "sdpa", "sdpa", "amx", "amx", "amx", "cpp", "cpp"]
    assert AttentionPlan.from_tables(*tables({"cpp": [1.0, 1.0, 1.0], "torch": [0.5, 0.5, 1.5]}, PREFILL)).decode == "torch"
    tie = AttentionPlan.from_tables(*tables({"cpp": [1.0] * 3, "torch": [1.0] * 3},
                                            {"cpp": [1.0] * 5, "amx": [1.0] * 5, "sdpa": [1.0] * 5}))
    assert tie.decode == "cpp" and tie.prefill == ("cpp",) * 5  # ties go to the C++ kernels
    amx = {"cpp": [2e-4, 1e-3, 4e-3], "amx": [3e-4, 8e-4, 3e-3], "torch": [1e-4, 2e-3, 2e-2]}
    assert AttentionPlan.from_tables(*tables(amx, PREFILL)).decode == "amx"  # the AMX q.k, least overall
    inf = float("inf")  # declined (no AMX, or a quantized cache): never chosen
    assert AttentionPlan.from_tables(*tables({**amx, "amx": [inf] * 3}, PREFILL)).decode == "cpp"
    # a C++ prefill that declines every length (no fast path): SDPA everywhere
    assert AttentionPlan.from_tables(*tables(DECODE, {"cpp": [inf] * 5, "amx": [inf] * 5, "sdpa": [1.0] * 5})).prefill == ("sdpa",) * 5


def test_plan_sets_decode_padding_and_rejects_unknown_kernels(kernel_ok):
    attn = CpuPagedAttention()
    assert attn.plan == AttentionPlan() and not attn.pads_decodes
    attn.plan = AttentionPlan(decode="torch")
    assert attn.pads_decodes  # the runner then bounds the padding of the reference's decode
    with pytest.raises(ValueError):
        attn.plan = AttentionPlan(prefill=("flash",))


def fake_measure(calls: list, noise: float = 1.0):
    def measure(attn, like, num_heads, dtype, **kw):  # type: ignore[no-untyped-def]
        calls.append((num_heads, dtype))
        return tables(DECODE, PREFILL, noise)

    return measure


def like_cache() -> LayerCache:
    return LayerCache(torch.zeros(3, 4, 16, 64).bfloat16(), torch.zeros(3, 4, 16, 64).bfloat16())


def test_autotune_caches_the_tables_and_reuses_them(kernel_ok, monkeypatch, tmp_path, caplog):
    calls: list = []
    monkeypatch.setattr(cp, "measure_attention", fake_measure(calls))
    attn = CpuPagedAttention()
    with caplog.at_level(logging.INFO, logger="pdserve.attention.cpu_paged"):
        attn.autotune(like_cache(), 9, torch.bfloat16, cache_dir=str(tmp_path))
    assert len(calls) == 1 and attn.plan == AttentionPlan.from_tables(*tables(DECODE, PREFILL))
    assert "prefill of a fresh prompt by length" in caplog.text and "sdpa" in caplog.text
    assert len(list(tmp_path.glob("attention-*.json"))) == 2
    again = CpuPagedAttention()
    again.autotune(like_cache(), 9, torch.bfloat16, cache_dir=str(tmp_path))
    assert len(calls) == 1 and again.plan == attn.plan  # read back, not timed
    again.autotune(like_cache(), 18, torch.bfloat16, cache_dir=str(tmp_path))  # another shape: another key
    assert len(calls) == 2


def test_busy_measurement_is_used_not_cached_and_batch_invariant_pins_cpp(kernel_ok, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(cp, "measure_attention", fake_measure(calls, noise=10.0))
    attn = CpuPagedAttention()
    attn.autotune(like_cache(), 9, torch.bfloat16, cache_dir=str(tmp_path))
    assert attn.plan.prefill[0] == "sdpa" and not list(tmp_path.iterdir())
    attn.autotune(like_cache(), 9, torch.bfloat16, batch_invariant=True, cache_dir=str(tmp_path))
    assert len(calls) == 1 and attn.plan == AttentionPlan()  # the C++ kernel per phase, nothing timed


class Forbid:
    """The kernel module with some entry points forbidden: proves a plan's choice is the one that runs."""

    def __init__(self, kernel, forbidden: set[str]) -> None:  # type: ignore[no-untyped-def]
        self._kernel, self._forbidden = kernel, forbidden

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name in self._forbidden:
            raise AssertionError(f"{name} called against the plan")
        return getattr(self._kernel, name)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("decode,prefill", list(itertools.product(cp.DECODE_KERNELS, cp.PREFILL_KERNELS)))
def test_every_choice_matches_the_reference(kernel_ok, kv_dtype, decode, prefill):
    attn = CpuPagedAttention(AttentionPlan(decode=decode, prefill=(prefill,)))
    k = attn._kernel
    if prefill in ("cpp", "amx") and not (k.prefill_fast_path(True, 9, 3, 64, 16) or k.prefill_avx2_path(True, 9, 3, 64, 16)):
        pytest.skip("no C++ prefill kernel (AVX-512 BF16 or AVX2 + FMA) in this build")
    amx = attn._kernel.prefill_amx_fast_path(True, 9, 3, 64, 16)
    if prefill == "amx" and kv_dtype == "bfloat16" and not amx:
        pytest.skip("no AMX on this CPU")
    # The plan's prefill kernel is the one that runs; AMX declines an int8 cache, which the AVX-512 one takes.
    sdpa = {"paged_prefill", "paged_prefill_amx"}
    skip_prefill = {"sdpa": sdpa, "sdpa-f32": sdpa, "cpp": {"paged_prefill_amx"},
                    "amx": {"paged_prefill"} if kv_dtype == "bfloat16" else set()}[prefill]
    forbidden = ({"paged_decode"} if decode == "torch" else set()) | skip_prefill
    isas: list[str] = []
    real_decode = k.paged_decode
    attn._kernel = Forbid(attn._kernel, forbidden)
    if decode != "torch":  # which path each decode call asked for
        attn._kernel.paged_decode = lambda *a, isa: isas.append(isa) or real_decode(*a, isa=isa)  # type: ignore[attr-defined]
    out, refs = mixed_step(attn, kv_dtype, (9, 3, 64), 16, torch.bfloat16)
    for s, n, ref in refs:
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=2e-2, rtol=2e-2)
    # The AMX decode runs where the plan picked it over a bf16 cache; an int8 cache (where it is never timed
    # fastest: declined) and a CPU without AMX take the AVX-512 kernel.
    amx_decode = decode == "amx" and kv_dtype == "bfloat16" and k.decode_amx_fast_path(True, 9, 3, 64, 16)
    if decode != "torch":
        assert isas and set(isas) == {"amx" if amx_decode else "auto"}, isas


def test_real_measurement_gives_a_complete_table(kernel_ok):
    """Smoke: the real timing runs both kernels of each phase at small sizes and fills every cell."""
    attn = CpuPagedAttention()
    k = attn._kernel
    if not (k.prefill_fast_path(True, 9, 3, 64, 16) or k.prefill_avx2_path(True, 9, 3, 64, 16)):
        pytest.skip("no C++ prefill kernel (AVX-512 BF16 or AVX2 + FMA) in this build")
    d, p = cp.measure_attention(attn, like_cache(), 9, torch.bfloat16, decode_batches=(1, 4), context=64,
                                prefill_lens=(16, 48), repeats=1)
    assert d.buckets == (1, 4) and p.buckets == (16, 48)
    amx = attn._kernel.prefill_amx_fast_path(True, 9, 3, 64, 16)
    for t in (d, p):
        for ts in t.seconds.values():
            for name, row in ts.items():
                if name == "amx" and not amx:  # declined where the CPU has no AMX: never chosen
                    assert all(v == float("inf") for v in row)
                else:
                    assert all(0 < v < float("inf") for v in row), (name, row)


def test_sdpa_f32_prefill_widens_the_inputs(monkeypatch):
    """The "sdpa-f32" choice runs the reference's prefill on float32 q, K, V (the result rounded into the
    bf16 output), "sdpa" on them as they are; both close to a float32 reference."""
    seen: list[torch.dtype] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):  # type: ignore[no-untyped-def]
        seen.append(q.dtype)
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for kernel in ("sdpa", "sdpa-f32"):
        seen.clear()
        out, refs = mixed_step(CpuPagedAttention(AttentionPlan(decode="torch", prefill=(kernel,))), "bfloat16",
                               (9, 3, 64), 16, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and seen
        assert set(seen) == ({torch.float32} if kernel == "sdpa-f32" else {torch.bfloat16}), (kernel, seen)
        for s, n, ref in refs:
            torch.testing.assert_close(out[s : s + n].float(), ref, atol=2e-2, rtol=2e-2)
