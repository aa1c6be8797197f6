"""cpu-paged on a quantized KV cache (int8, fp8 e4m3; kv/quant.py): the C++ write quantizes exactly as the
reference does, and decode and prefill read the one-byte values in place. The oracle is float32
attention over the dequantized cache (`kv/quant.dequantize`): the kernels differ from it only by their
own rounding (bf16 outputs; prefill's bf16 probabilities), never by the quantization. int8 caches hold
rows off zero (all positive, all negative, constant, zeros), where a wrong zero would show."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention import get_attention_backend
from pdserve.attention.base import AttentionMetadata, DecodeGroup, PrefillSeq
from pdserve.kv.cache import LayerCache
from pdserve.kv.quant import QUANT_DTYPES, dequantize, quantize

KV_DTYPES = ["int8", "fp8_e4m3"]

# (query heads, kv heads, head_dim): SmolLM2 (group 3), Qwen2.5 0.5B (group 7) and 1.5B (group 6, 128), the
# fast path's ends (groups 1 and 8), and a group of 9 that only the portable loop takes.
SHAPES = [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 4, 128), (16, 2, 64), (18, 2, 64)]
SHAPE_IDS = ["smollm2", "qwen-0.5b", "qwen-1.5b", "g1-d128", "g8-d64", "g9-portable"]


@pytest.fixture(scope="module")
def cpu_paged():
    try:
        return get_attention_backend("cpu-paged")
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")


def wide_rows(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Values over five decades within a row, so that rows quantize to small codes too (fp8 subnormals,
    int8 zeros and ones), not only to codes near the row's maximum."""
    return torch.randn(shape, generator=g) * torch.pow(10.0, -5 * torch.rand(shape, generator=g))


def offset_rows(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """wide_rows shifted by a per-row offset in [-3, 3] (most rows then all positive or all negative),
    every 7th row constant (scale 0: the row reads as its zero) and every 11th zeros."""
    x = wide_rows(shape, g) + (torch.rand(*shape[:-1], 1, generator=g) * 6 - 3)
    rows = x.view(-1, shape[-1])
    rows[::7] = rows[::7, :1]
    rows[::11] = 0
    return x


def quantized_cache(kvh: int, nblocks: int, bs: int, d: int, kv_dtype: str, g: torch.Generator) -> LayerCache:
    """A cache of random rows, stored as the reference quantizes them (int8: rows off zero,
    `offset_rows`)."""
    rows = offset_rows if kv_dtype == "int8" else wide_rows
    k, ks = quantize(rows((kvh, nblocks, bs, d), g), kv_dtype)
    v, vs = quantize(rows((kvh, nblocks, bs, d), g), kv_dtype)
    return LayerCache(k, v, ks, vs)


def dequantized(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
    assert cache.k_scale is not None and cache.v_scale is not None
    return dequantize(cache.k, cache.k_scale, torch.float32), dequantize(cache.v, cache.v_scale, torch.float32)


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 causal attention of q [L, H, D] (the last L positions) over k, v [S, KVH, D]."""
    L, H, _ = q.shape
    S, KVH, _ = k.shape
    k = k.float().repeat_interleave(H // KVH, dim=1)
    v = v.float().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale
    pos_q = torch.arange(S - L, S)[:, None]
    scores = scores.masked_fill(torch.arange(S)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def context_rows(cache_k: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """The first n tokens' rows [n, KVH, D] of a sequence with block table `table`."""
    kvh, _, bs, d = cache_k.shape
    rows = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)])
    return cache_k.reshape(kvh, -1, d)[:, rows].transpose(0, 1)


def random_tables(lengths: list[int], bs: int, nblocks: int, g: torch.Generator) -> tuple[list[list[int]], torch.Tensor]:
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lengths]
    max_nb = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (max_nb - len(t)) for t in tables])


def test_supported_kv_dtypes_and_paths(cpu_paged):
    assert all(cpu_paged.supports_kv_dtype(d) for d in ("bfloat16", "float32", "int8", "fp8_e4m3", "int4"))
    assert not cpu_paged.supports_kv_dtype("float16")  # (int4: decode in C++, tests/model/test_kv_int4.py)
    g = torch.Generator().manual_seed(0)
    k = cpu_paged._kernel
    if k.decode_fast_path(True, 9, 3, 64):
        isa = "AVX-512 BF16"
    elif k.decode_avx2_path(9, 3, 64):
        isa = "AVX2 + FMA"
    else:
        pytest.skip("neither AVX-512 BF16 nor AVX2 kernels in this build")
    for kv_dtype, label in (("int8", "int8 KV"), ("fp8_e4m3", "fp8 e4m3 KV")):
        decode, prefill, why = cpu_paged.kernel_paths(quantized_cache(3, 4, 16, 64, kv_dtype, g), 9)
        assert why is None and decode == f"C++ {isa}, {label} (head_dim 64, 3 query heads per kv head)"
        assert prefill.startswith(f"C++ {isa} flash, {label} (head_dim 64, 3 query heads per kv head)")
        decode, _, why = cpu_paged.kernel_paths(quantized_cache(2, 4, 16, 64, kv_dtype, g), 18)
        assert decode == f"C++ portable loop, {label}" and why is not None and "outside the fast kernels" in why
        _, prefill, why = cpu_paged.kernel_paths(quantized_cache(3, 4, 8, 64, kv_dtype, g), 9)
        assert prefill == "torch SDPA" and why is not None and "not a multiple of 16" in why


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32, 8, 12])  # 8, 12: the fast kernels' row-at-a-time tails
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_reads_quantized_cache(cpu_paged, kv_dtype, block_size, shape, isa):
    """Decodes of very different context lengths (partial blocks, one token, several hundred) through
    scattered blocks, all in one call, against float32 attention over the dequantized cache; the same
    bits with one thread as with two. `auto`: the engine's path; `avx2`: the AVX2 kernel forced (what CPUs
    without AVX-512 run), where this build has it."""
    checked_quantized_decode(cpu_paged, kv_dtype, block_size, shape, isa, [1, 15, 16, 17, 33, 250, 700, 2, 64, 129])


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_decode_quantized_sides_past_the_whole_side_prefetch(cpu_paged, kv_dtype, block_size, isa):
    """Contexts whose K or V side (rows, and their scales in step) is longer than what the decode kernels
    prefetch into L2 whole (128 KB: 2,048 int8 rows of head_dim 64), so they stream a fixed lead ahead of
    the compute: right against the dequantized reference on the engine's path and on the AVX2 one."""
    checked_quantized_decode(cpu_paged, kv_dtype, block_size, (14, 2, 64), isa, [2100, 1, 3000, 513])


def checked_quantized_decode(cpu_paged, kv_dtype, block_size, shape, isa, ctx):
    """One paged_decode call over `ctx` (blocks scattered at random over a quantized cache) against float32
    attention over the dequantized cache; the same bits with one thread as with two."""
    (H, KVH, D) = shape
    if isa == "avx2" and not cpu_paged._kernel.decode_avx2_path(H, KVH, D):
        pytest.skip("no AVX2 decode path in this build for this shape")
    g = torch.Generator().manual_seed(1)
    nblocks = sum(-(-c // block_size) for c in ctx) + 8
    cache = quantized_cache(KVH, nblocks, block_size, D, kv_dtype, g)
    tables, table = random_tables(ctx, block_size, nblocks, g)
    q = torch.randn(len(ctx), H, D, generator=g).bfloat16()
    group = DecodeGroup(0, len(ctx), table, torch.tensor(ctx), None)  # type: ignore[arg-type]

    def decode() -> torch.Tensor:
        if isa == "auto":
            return cpu_paged.decode(q, cache, group, D**-0.5)
        return cpu_paged._kernel.paged_decode(q, cache.k, cache.v, table, torch.tensor(ctx), D**-0.5, cache.k_scale,
                                              cache.v_scale, isa=isa)

    out = decode()
    k, v = dequantized(cache)
    for i, (c, t) in enumerate(zip(ctx, tables)):
        ref = naive(q[i : i + 1], context_rows(k, t, c), context_rows(v, t, c), D**-0.5)
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=1e-2, rtol=1e-2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode(), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_float32_queries_take_the_portable_loop(cpu_paged, kv_dtype):
    """float32 queries over a quantized cache (a float32 model): the portable loop, close to exact."""
    g = torch.Generator().manual_seed(4)
    H, KVH, D, bs, nblocks = 9, 3, 64, 16, 40
    ctx = [1, 17, 100, 300]
    cache = quantized_cache(KVH, nblocks, bs, D, kv_dtype, g)
    tables, table = random_tables(ctx, bs, nblocks, g)
    q = torch.randn(len(ctx), H, D, generator=g)
    out = cpu_paged.decode(q, cache, DecodeGroup(0, len(ctx), table, torch.tensor(ctx), None), D**-0.5)  # type: ignore[arg-type]
    assert out.dtype == torch.float32
    k, v = dequantized(cache)
    for i, (c, t) in enumerate(zip(ctx, tables)):
        ref = naive(q[i : i + 1], context_rows(k, t, c), context_rows(v, t, c), D**-0.5)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(9, 3, 64), (18, 2, 64)], ids=["fast", "portable"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_code_dequantizes_exactly(cpu_paged, kv_dtype, shape):
    """One-token contexts (softmax weight exactly 1) whose V rows hold every code of the dtype (fp8:
    subnormals, both zeros; not the NaN codes): the output is each value, the code times its scale (int8:
    plus its zero), rounded to bf16 once, bit for bit, in the vector conversions and the portable table
    alike. (int8: scales and zeros of nearby exponents, so that every value and partial sum is exact in
    float32 whichever way a kernel groups (c + 128) s + z.) The parameters of the rows not read are NaN."""
    (H, KVH, D), bs = shape, 16
    dtype = QUANT_DTYPES[kv_dtype]
    if dtype == torch.int8:
        codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    else:
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)
    n = -(-codes.numel() // D)
    rows = torch.zeros(n * D, dtype=dtype)
    rows[: codes.numel()] = codes
    k = torch.zeros(KVH, n, bs, D, dtype=dtype)
    v = torch.zeros(KVH, n, bs, D, dtype=dtype)
    v[:, :, 0] = rows.view(n, D)
    if dtype == torch.int8:
        v_params = torch.full((KVH, n, bs, 2), float("nan"), dtype=torch.float16)
        pairs = torch.tensor([[0.37, -1.5], [1.9e-3, 3e-3]], dtype=torch.float16)
        v_params[:, :, 0] = pairs[torch.arange(n) % 2]
        k_params = torch.tensor([1.0, 0.0], dtype=torch.float16).expand(KVH, n, bs, 2).contiguous()
        s, z = v_params[:, :, 0].float().unbind(-1)
        expect = (v[:, :, 0].float() + 128) * s[..., None] + z[..., None]
    else:
        v_params = torch.full((KVH, n, bs), float("nan"))
        v_params[:, :, 0] = torch.tensor([0.37, 1.9e-3])[torch.arange(n) % 2]
        k_params = torch.ones(KVH, n, bs)
        expect = v[:, :, 0].float() * v_params[:, :, 0, None]
    q = torch.randn(n, H, D).bfloat16()
    group = DecodeGroup(0, n, torch.arange(n)[:, None], torch.ones(n, dtype=torch.int64), None)  # type: ignore[arg-type]
    out = cpu_paged.decode(q, LayerCache(k, v, k_params, v_params), group, D**-0.5)
    expect = expect.transpose(0, 1).repeat_interleave(H // KVH, dim=1).bfloat16()  # [n, H, D]
    assert torch.equal(out, expect)


def prefill_case(H: int, KVH: int, D: int, kv_dtype: str, g: torch.Generator):  # type: ignore[no-untyped-def]
    bs, nblocks = 16, 96
    cache = quantized_cache(KVH, nblocks, bs, D, kv_dtype, g)
    shapes = [(0, 40), (37, 20), (100, 1), (0, 1), (16, 33), (5, 300)]  # (cached tokens, new tokens)
    tables, table = random_tables([c + n for c, n in shapes], bs, nblocks, g)
    return cache, shapes, tables, table


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=SHAPE_IDS[:5])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_reads_quantized_cache(cpu_paged, kv_dtype, shape, isa):
    """Fresh prompts and chunks after cached context (prefix hits, chunked prefill), lengths off the
    16-row tiles, all in one call from strided query rows; rows of `out` outside the prefills untouched."""
    g = torch.Generator().manual_seed(2)
    H, KVH, D = shape
    cache, shapes, tables, table = prefill_case(H, KVH, D, kv_dtype, g)
    pad = 3
    total = pad + sum(n for _, n in shapes)
    qkv = torch.randn(total, (H + 2 * KVH) * D, generator=g).bfloat16()
    q = qkv[:, : H * D].view(total, H, D)
    out = torch.full((total, H, D), 7.0, dtype=torch.bfloat16)
    starts = torch.tensor([pad + sum(n for _, n in shapes[:i]) for i in range(len(shapes))])
    lens = torch.tensor([n for _, n in shapes])
    ctx = torch.tensor([c + n for c, n in shapes])
    ran = cpu_paged._kernel.paged_prefill(
        q, cache.k, cache.v, table, starts, lens, ctx, D**-0.5, out, cache.k_scale, cache.v_scale, isa=isa
    )
    if not ran:
        pytest.skip(f"no {isa} prefill kernel in this build")
    assert torch.all(out[:pad] == 7.0)
    k, v = dequantized(cache)
    for i, ((c, n), t) in enumerate(zip(shapes, tables)):
        s = int(starts[i])
        ref = naive(q[s : s + n], context_rows(k, t, c + n), context_rows(v, t, c + n), D**-0.5)
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=2e-2, rtol=2e-2)


def slots_of(table: list[int], start: int, end: int, bs: int) -> list[int]:
    return [table[j // bs] * bs + j % bs for j in range(start, end)]


def mixed_step(cpu_paged, kv_dtype: str, shape: tuple[int, int, int], bs: int, q_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """One backend forward of a real step's layout (three decodes, a fresh prompt, a chunk after cached
    context) over a quantized cache ("bfloat16": a plain one): (output, float32 attention over the
    dequantized rows per sequence)."""
    g = torch.Generator().manual_seed(5)
    (H, KVH, D), nblocks = shape, 48 * 16 // bs
    if kv_dtype == "bfloat16":
        cache = LayerCache(torch.zeros(KVH, nblocks, bs, D).bfloat16(), torch.zeros(KVH, nblocks, bs, D).bfloat16())
    else:
        dtype = QUANT_DTYPES[kv_dtype]
        params = (KVH, nblocks, bs, 2) if kv_dtype == "int8" else (KVH, nblocks, bs)
        pdtype = torch.float16 if kv_dtype == "int8" else torch.float32
        cache = LayerCache(
            torch.zeros(KVH, nblocks, bs, D, dtype=dtype), torch.zeros(KVH, nblocks, bs, D, dtype=dtype),
            torch.zeros(params, dtype=pdtype), torch.zeros(params, dtype=pdtype),
        )
    shapes = [(9, 1), (40, 1), (130, 1), (0, 23), (21, 12)]  # (cached, new): three decodes, two prefills
    tables, _ = random_tables([c + n for c, n in shapes], bs, nblocks, g)
    rows = offset_rows if kv_dtype == "int8" else wide_rows
    full_k = [rows((c + n, KVH, D), g).to(q_dtype) for c, n in shapes]
    full_v = [rows((c + n, KVH, D), g).to(q_dtype) for c, n in shapes]
    for (c, _), t, kk, vv in zip(shapes, tables, full_k, full_v):  # what earlier steps wrote
        if c:
            cpu_paged.write_kv(kk[:c], vv[:c], cache, torch.tensor(slots_of(t, 0, c, bs)))
    nd = 3
    max_nb = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables])
    ctx = torch.tensor([c + n for c, n in shapes])
    starts = torch.tensor([sum(n for _, n in shapes[:i]) for i in range(len(shapes))])
    c4, n4 = shapes[4]
    # The chunk's causal mask over its blocks' slots (the reference's prefill reads it; the kernel does not).
    slot = torch.arange(len(tables[4]) * bs)[None, :]
    mask = slot <= (c4 + torch.arange(n4))[:, None]
    dec_mask = (torch.arange(max_nb * bs) < ctx[:nd, None]).view(nd, 1, 1, -1)  # the reference's decode reads it
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([s for (c, n), t in zip(shapes, tables) for s in slots_of(t, c, c + n, bs)]),
        num_decode_tokens=nd,
        decode_groups=[DecodeGroup(0, nd, padded[:nd], ctx[:nd], dec_mask)],
        prefills=[
            PrefillSeq(nd, 23, 23, None, None),
            PrefillSeq(int(starts[4]), n4, c4 + n4, torch.tensor(tables[4]), mask),
        ],
        prefill_block_table=padded[nd:],
        prefill_context_lens=ctx[nd:],
        prefill_query_starts=starts[nd:],
        prefill_query_lens=torch.tensor([n for _, n in shapes[nd:]]),
    )
    q = torch.randn(sum(n for _, n in shapes), H, D, generator=g).to(q_dtype)
    k_new = torch.cat([kk[c:] for (c, _), kk in zip(shapes, full_k)])
    v_new = torch.cat([vv[c:] for (c, _), vv in zip(shapes, full_v)])
    out = cpu_paged.forward(q, k_new, v_new, cache, meta, D**-0.5)
    refs = []
    for i, ((c, n), kk, vv) in enumerate(zip(shapes, full_k, full_v)):
        if kv_dtype != "bfloat16":
            (kq, ks), (vq, vs) = quantize(kk, kv_dtype), quantize(vv, kv_dtype)
            kk, vv = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
        s = int(starts[i])
        refs.append((s, n, naive(q[s : s + n], kk.float(), vv.float(), D**-0.5)))
    return out, refs


@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128)], ids=["smollm2", "qwen-1.5b"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_mixed_step_through_forward(cpu_paged, kv_dtype, shape):
    """The new rows are quantized into the cache, then every query attends to its whole context read back
    from it (the C++ prefill kernel here), as the reference attends over the same dequantized rows."""
    H, KVH, D = shape
    k = cpu_paged._kernel
    if not (k.prefill_fast_path(True, H, KVH, D, 16) or k.prefill_avx2_path(True, H, KVH, D, 16)):
        pytest.skip("no C++ prefill kernel in this build (the fallback is the reference's)")
    out, refs = mixed_step(cpu_paged, kv_dtype, shape, 16, torch.bfloat16)
    for s, n, ref in refs:
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "bs,q_dtype,tol", [(8, torch.bfloat16, 2e-2), (16, torch.float32, 1e-4)], ids=["blocks-of-8", "float32"]
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_fallback_on_quantized_cache(cpu_paged, kv_dtype, bs, q_dtype, tol):
    """Where the C++ prefill kernel declines (blocks not a multiple of 16, float32 queries) cpu-paged falls
    back to the reference's prefill, which must dequantize the cache itself: the fresh prompt read back
    from the quantized cache, the chunk's cached context gathered and dequantized. Both equal float32
    attention over the dequantized rows."""
    H, KVH, D = 9, 3, 64
    k = cpu_paged._kernel
    assert not k.prefill_fast_path(q_dtype == torch.bfloat16, H, KVH, D, bs)
    assert not k.prefill_avx2_path(q_dtype == torch.bfloat16, H, KVH, D, bs)
    out, refs = mixed_step(cpu_paged, kv_dtype, (H, KVH, D), bs, q_dtype)
    assert out.dtype == q_dtype
    for s, n, ref in refs:
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=tol, rtol=tol)


def special_rows(T: int, KVH: int, D: int, g: torch.Generator) -> torch.Tensor:
    """Random rows over five decades of magnitude (fp8 subnormals) plus the edge cases of the rounding: a
    row of zeros, a single non-zero value, values exactly half-way between two codes (int8: zero -4 and
    scale 2, row 9; fp8: scale 1, integers with more than 4 significant bits), equal values, huge and tiny
    rows; for int8's zero: rows all positive and all negative, a constant row (scale 0) and one off
    float16's grid (float32 rows: a float16 subnormal scale)."""
    x = wide_rows((T, KVH, D), g) * 3
    x[0, 0] = 0.0
    x[1, 0] = 0.0
    x[1, 0, 5] = -2.5
    x[2, 0] = torch.arange(D) - D // 2
    x[2, 0, 0] = 254.0
    x[3, 0] = torch.arange(D) * 7 + 1
    x[3, 0, 1] = -448.0
    x[4, 0] = 1.0
    x[5, 0] *= 1e30
    x[6, 0] *= 1e-30
    x[7, 0] = x[7, 0].abs() + 2.0
    x[8, 0] = -x[8, 0].abs() - 0.5
    x[9, 0] = 2.0 * torch.arange(D) - 3  # with min -4 and max 506 (zero -4, scale 2), every other value is
    x[9, 0, 0], x[9, 0, 1] = -4.0, 506.0  # half-way between two codes (ties to even); all exact in bf16
    x[10, 0] = 5.5
    x[11, 0] = 0.1
    return x


@pytest.mark.parametrize("head_dim", [64, 40])  # the AVX-512 quantizer (multiples of 16) and the scalar one
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_quantizes_like_the_reference(cpu_paged, kv_dtype, in_dtype, head_dim):
    """The C++ write stores exactly kv/quant.quantize's codes and scales (bit for bit, both dtypes,
    bf16 and float32 rows) at each slot, from strided views of the fused projection, and touches no
    other slot."""
    g = torch.Generator().manual_seed(3)
    KVH, D, bs, nblocks, T = 3, head_dim, 16, 12, 61
    dtype = QUANT_DTYPES[kv_dtype]
    qkv = torch.empty(T, (9 + 2 * KVH) * D, dtype=in_dtype)
    k = qkv[:, 9 * D : (9 + KVH) * D].view(T, KVH, D)
    v = qkv[:, (9 + KVH) * D :].view(T, KVH, D)
    k.copy_(special_rows(T, KVH, D, g))
    v.copy_(special_rows(T, KVH, D, g).flip(0))
    slots = torch.randperm(nblocks * bs, generator=g)[:T]
    fill = torch.randint(-100, 100, (KVH, nblocks, bs, D), generator=g, dtype=torch.int8)
    params = (KVH, nblocks, bs, 2) if kv_dtype == "int8" else (KVH, nblocks, bs)
    pdtype = torch.float16 if kv_dtype == "int8" else torch.float32
    cache = LayerCache(
        fill.clone().view(dtype), fill.flip(0).clone().view(dtype),
        torch.full(params, -1.0, dtype=pdtype), torch.full(params, -2.0, dtype=pdtype),
    )
    before = LayerCache(cache.k.clone(), cache.v.clone(), cache.k_scale.clone(), cache.v_scale.clone())  # type: ignore[union-attr]
    cpu_paged.write_kv(k, v, cache, slots)
    for x, stored, scale, old, old_scale in (
        (k, cache.k, cache.k_scale, before.k, before.k_scale),
        (v, cache.v, cache.v_scale, before.v, before.v_scale),
    ):
        ref, ref_scale = quantize(x.transpose(0, 1), kv_dtype)  # [KVH, T, D]
        got = stored.view(KVH, -1, D)[:, slots]
        assert torch.equal(got.view(torch.int8), ref.view(torch.int8)), "codes differ from kv/quant.py"
        assert torch.equal(scale.flatten(1, 2)[:, slots], ref_scale), "parameters differ from kv/quant.py"
        untouched = torch.ones(nblocks * bs, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(stored.view(KVH, -1, D)[:, untouched].view(torch.int8), old.view(KVH, -1, D)[:, untouched].view(torch.int8))
        assert torch.equal(scale.flatten(1, 2)[:, untouched], old_scale.flatten(1, 2)[:, untouched])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv_rejects_bad_slots_and_missing_scales(cpu_paged, kv_dtype):
    g = torch.Generator().manual_seed(6)
    KVH, D, bs, nblocks = 2, 64, 16, 4
    cache = quantized_cache(KVH, nblocks, bs, D, kv_dtype, g)
    k = torch.randn(1, KVH, D).bfloat16()
    for bad in (nblocks * bs, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            cpu_paged.write_kv(k, k, cache, torch.tensor([bad]))
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        cpu_paged.write_kv(k, k, LayerCache(cache.k, cache.v), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="scales must be contiguous"):
        cpu_paged.write_kv(k, k, LayerCache(cache.k, cache.v, cache.k_scale.double(), cache.v_scale), torch.tensor([0]))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        table = torch.zeros(1, 1, dtype=torch.int64)
        cpu_paged.decode(k, LayerCache(cache.k, cache.v), DecodeGroup(0, 1, table, torch.ones(1, dtype=torch.int64), None), 1.0)  # type: ignore[arg-type]
