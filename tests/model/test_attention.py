"""The torch attention backend against naive per-sequence causal attention, for a mixed step (decodes
with paged context, a fresh prompt, a chunk with cached context) in float32 and bfloat16."""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.attention.base import AttentionMetadata, DecodeGroup, PrefillSeq
from pdserve.attention import get_attention_backend
from pdserve.kv.cache import LayerCache


def naive(q, k, v, scale):  # q [L, H, D] for the last L positions; k, v [S, KVH, D]
    L, H, D = q.shape
    S, KVH, _ = k.shape
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * scale
    pos_q = torch.arange(S - L, S)[:, None]
    scores = scores.masked_fill(torch.arange(S)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v.float())


@pytest.mark.parametrize("head_dim", [16, 64])  # 64 takes the AVX-512 BF16 path of cpu-paged where built
@pytest.mark.parametrize("backend", ["torch", "torch-compiled", "cpu-paged"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mixed_step_matches_naive(dtype, tol, backend, head_dim):
    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs, nblocks = 6, 2, head_dim, 4, 64
    k_cache = torch.zeros(KVH, nblocks, bs, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(nblocks, generator=g).tolist()
    # (cached tokens, new tokens) per request: three decodes, then a fresh prompt and a chunk with context.
    shapes = [(9, 1), (3, 1), (17, 1), (0, 11), (6, 5)]
    full_k, full_v, tables, q_parts, k_new, v_new, slots = [], [], [], [], [], [], []
    for cached, new in shapes:
        n = cached + new
        kk = torch.randn(n, KVH, D, generator=g).to(dtype)
        vv = torch.randn(n, KVH, D, generator=g).to(dtype)
        table = [perm.pop() for _ in range(-(-n // bs))]
        for i in range(cached):  # what earlier steps wrote
            k_cache[:, table[i // bs], i % bs] = kk[i]
            v_cache[:, table[i // bs], i % bs] = vv[i]
        full_k.append(kk), full_v.append(vv), tables.append(table)
        q_parts.append(torch.randn(new, H, D, generator=g).to(dtype))
        k_new.append(kk[cached:]), v_new.append(vv[cached:])
        slots += [table[i // bs] * bs + i % bs for i in range(cached, n)]
    nd = 3
    max_nb = max(len(t) for t in tables[:nd])
    dec_table = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables[:nd]]).reshape(-1)
    ctx = torch.tensor([c + n for c, n in shapes[:nd]])
    dec_mask = (torch.arange(max_nb * bs) < ctx[:, None]).view(nd, 1, 1, -1)
    c, n = shapes[4]
    chunk_mask = torch.arange(len(tables[4]) * bs)[None, :] <= (torch.arange(n)[:, None] + c)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=nd,
        decode_groups=[
            DecodeGroup(0, 2, dec_table.view(nd, -1)[:2], ctx[:2], dec_mask[:2]),
            DecodeGroup(2, 1, dec_table.view(nd, -1)[2:], ctx[2:], dec_mask[2:]),
        ],
        prefills=[PrefillSeq(nd, 11, 11, None, None), PrefillSeq(nd + 11, n, c + n, torch.tensor(tables[4]), chunk_mask)],
    )
    q, k, v = torch.cat(q_parts), torch.cat(k_new), torch.cat(v_new)
    out = get_attention_backend(backend).forward(q, k, v, LayerCache(k_cache, v_cache), meta, D**-0.5)
    start = 0
    for i, qp in enumerate(q_parts):
        ref = naive(qp, full_k[i], full_v[i], D**-0.5)
        torch.testing.assert_close(out[start : start + len(qp)].float(), ref, atol=tol, rtol=tol)
        start += len(qp)


def test_decode_groups_bound_padding():
    from pdserve.runner.model_runner import _decode_groups

    lens = sorted([5, 6, 7, 40, 41, 45, 300, 310, 2000])
    groups = _decode_groups(lens, max_waste=0.25)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # contiguous, covering
    for s, e in groups:
        assert (e - s) * lens[e - 1] <= 1.25 * sum(lens[s:e])
    assert len(groups) <= 5
    assert _decode_groups([100] * 64) == [(0, 64)]
    assert _decode_groups([]) == []


@pytest.fixture(scope="module")
def cpu_paged():
    """The C++ backend, or a skip where no compiler can build it."""
    try:
        return get_attention_backend("cpu-paged")
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")


# (query heads, kv heads, head_dim): SmolLM2 (group 3), Qwen2.5 0.5B (group 7, 64) and 1.5B (group 6, 128),
# and the ends of the fast path's range (groups 1 and 8).
SHAPES = [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 4, 128), (16, 2, 64)]
SHAPE_IDS = ["smollm2", "qwen-0.5b", "qwen-1.5b", "g1-d128", "g8-d64"]


def has_fast_kernels(cpu_paged) -> bool:
    """Whether this build has the AVX-512 BF16 kernels at all (SmolLM2's shape has always had them)."""
    return cpu_paged._kernel.decode_fast_path(True, 9, 3, 64)


def test_cpu_paged_fast_path_shapes(cpu_paged):
    if not has_fast_kernels(cpu_paged):
        pytest.skip("no AVX-512 BF16 kernels in this build")
    k = cpu_paged._kernel
    for h, kvh, d in SHAPES:
        assert k.decode_fast_path(True, h, kvh, d) and k.prefill_fast_path(True, h, kvh, d, 16), (h, kvh, d)
    assert not k.decode_fast_path(False, 9, 3, 64)  # float32: the portable loop
    assert not k.decode_fast_path(True, 18, 2, 64)  # group 9
    assert not k.decode_fast_path(True, 8, 2, 96)  # head_dim 96
    assert not k.prefill_fast_path(True, 9, 3, 64, 8)  # blocks of 8 tokens


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_paged_decode_long_contexts(cpu_paged, block_size, shape):
    """The C++ decode kernel on 16-token blocks (its 16-rows-at-a-time path, with partial last blocks)
    over many requests of very different context lengths (its per-thread split), against naive
    attention; and the same result with one thread as with two."""
    g = torch.Generator().manual_seed(1)
    (H, KVH, D), nblocks = shape, 256
    ctx = [1, 15, 16, 17, 33, 250, 700, 2, 64, 129]
    k_cache = torch.randn(KVH, nblocks, block_size, D, generator=g).bfloat16()
    v_cache = torch.randn(KVH, nblocks, block_size, D, generator=g).bfloat16()
    perm = torch.randperm(nblocks, generator=g).tolist()
    max_nb = max(-(-c // block_size) for c in ctx)
    tables = [[perm.pop() for _ in range(-(-c // block_size))] for c in ctx]
    table = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables])
    q = torch.randn(len(ctx), H, D, generator=g).bfloat16()
    group = DecodeGroup(0, len(ctx), table, torch.tensor(ctx), None)  # type: ignore[arg-type]
    out = cpu_paged.decode(q, LayerCache(k_cache, v_cache), group, D**-0.5)
    for i, (c, t) in enumerate(zip(ctx, tables)):
        rows = torch.tensor([t[j // block_size] * block_size + j % block_size for j in range(c)])
        kk = k_cache.reshape(KVH, -1, D)[:, rows].transpose(0, 1)  # [c, KVH, D]
        vv = v_cache.reshape(KVH, -1, D)[:, rows].transpose(0, 1)
        ref = naive(q[i : i + 1], kk, vv, D**-0.5)
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=2e-2, rtol=2e-2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_paged.decode(q, LayerCache(k_cache, v_cache), group, D**-0.5), out)
    finally:
        torch.set_num_threads(threads)


def decode_isas(cpu_paged) -> list[str]:
    """The paths `paged_decode(isa=...)` can be forced onto in this build: the portable loop always, the
    AVX2 + FMA kernel where the compiler targets AVX2 (every AVX-512 CPU too, so it is tested there), the
    AVX-512 kernel with q.k and p.v on AMX tiles where the CPU has AMX BF16."""
    k = cpu_paged._kernel
    return (["portable"] + (["avx2"] if k.decode_avx2_path(9, 3, 64) else [])
            + (["auto"] if k.decode_fast_path(True, 9, 3, 64) else [])
            + (["amx"] if k.decode_amx_fast_path(True, 9, 3, 64, 16) else []))


def checked_decode(cpu_paged, ctx, block_size, shape, isa, seed, nan_past_context):
    """`paged_decode(isa=...)` over random bf16 K/V in blocks scattered at random (rows past each context
    NaN if asked), each request's output checked against naive attention; returns a rerun and the output."""
    g = torch.Generator().manual_seed(seed)
    (H, KVH, D) = shape
    nblocks = sum(-(-c // block_size) for c in ctx) + 2
    k_cache = torch.randn(KVH, nblocks, block_size, D, generator=g).bfloat16()
    v_cache = torch.randn(KVH, nblocks, block_size, D, generator=g).bfloat16()
    perm = torch.randperm(nblocks, generator=g).tolist()
    max_nb = max(-(-c // block_size) for c in ctx)
    tables = [[perm.pop() for _ in range(-(-c // block_size))] for c in ctx]
    table = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables])
    q = torch.randn(len(ctx), H, D, generator=g).bfloat16()
    if nan_past_context:
        for c, t in zip(ctx, tables):
            if c % block_size:
                k_cache[:, t[-1], c % block_size :] = float("nan")
                v_cache[:, t[-1], c % block_size :] = float("nan")
    run = lambda: cpu_paged._kernel.paged_decode(q, k_cache, v_cache, table, torch.tensor(ctx), D**-0.5, isa=isa)
    out = run()
    for i, (c, t) in enumerate(zip(ctx, tables)):
        rows = torch.tensor([t[j // block_size] * block_size + j % block_size for j in range(c)])
        kk = k_cache.reshape(KVH, -1, D)[:, rows].transpose(0, 1)
        vv = v_cache.reshape(KVH, -1, D)[:, rows].transpose(0, 1)
        torch.testing.assert_close(out[i : i + 1].float(), naive(q[i : i + 1], kk, vv, D**-0.5), atol=2e-2, rtol=2e-2)
    return run, out


@pytest.mark.parametrize("isa", ["auto", "amx", "avx2", "portable"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("block_size", [4, 12, 16, 128])
def test_cpu_paged_decode_forced_paths(cpu_paged, block_size, shape, isa):
    """Each decode path forced (the AVX2 kernel is what CPUs without AVX-512 run): its 8-rows-at-a-time
    scores with rows past the context in the last block, blocks that are not a multiple of 8 tokens (its
    row-at-a-time tail), every fast shape, against naive attention; one thread == two. AMX (blocks of a
    multiple of 16 only) scores 16 rows per tile, and the AVX-512 kernel ("auto" where the build has it)
    reads whole 16-row groups for q.k and pairs of V rows for p.v: rows past the context are NaN for both
    here, so they must not reach the output (odd contexts pair their last row with zeros)."""
    if isa not in decode_isas(cpu_paged):
        pytest.skip(f"no {isa} path in this build")
    if isa == "amx" and block_size % 16:
        pytest.skip("the AMX decode takes blocks of a multiple of 16 tokens")
    ctx = [1, 7, 8, 9, 15, 17, 33, 250, 2, 129]
    run, out = checked_decode(cpu_paged, ctx, block_size, shape, isa, seed=3, nan_past_context=isa in ("amx", "auto"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["auto", "amx", "avx2"])
@pytest.mark.parametrize("shape", [(14, 2, 64), (12, 2, 128)], ids=["qwen-0.5b", "qwen-1.5b"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_cpu_paged_decode_sides_past_the_whole_side_prefetch(cpu_paged, block_size, shape, isa):
    """Contexts whose K or V side is longer than what the decode kernels prefetch whole (then they stream
    a fixed lead ahead of the compute) and than the AMX p.v's windows (head_dim 128 takes its two halves
    window by window): right against naive attention, rows past the context NaN (where the path never
    reads them: not the AVX2 one's 8-row groups)."""
    if isa not in decode_isas(cpu_paged):
        pytest.skip(f"no {isa} path in this build")
    checked_decode(cpu_paged, [1100, 2500, 513, 1], block_size, shape, isa, seed=5, nan_past_context=isa != "avx2")


def test_cpu_paged_decode_isa_errors(cpu_paged):
    """An unknown isa, or the AVX2 or AMX path asked for where it cannot run (a float32 cache), is an error."""
    q = torch.randn(1, 9, 64).bfloat16()
    kc = torch.randn(3, 1, 16, 64)
    args = (q, kc, kc, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([4]), 0.125)
    with pytest.raises(RuntimeError, match="isa must be"):
        cpu_paged._kernel.paged_decode(*args, isa="sse")
    with pytest.raises(RuntimeError, match="no AVX2 decode path"):
        cpu_paged._kernel.paged_decode(*args, isa="avx2")
    with pytest.raises(RuntimeError, match="no AMX decode path"):  # float32: on every CPU
        cpu_paged._kernel.paged_decode(*args, isa="amx")


@pytest.mark.parametrize("kernel", ["avx512", "avx2", "amx"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cpu_paged_prefill_kernel(cpu_paged, shape, bs, kernel):
    """The C++ prefill kernels (AVX-512, AVX2 + FMA, and AMX tiles where the CPU has them): fresh prompts
    and chunks with cached context (prefix hits, chunked prefill), lengths off the 8- and 16-row tiles and
    16- and 32-key steps, queries attending causally through scattered blocks whose unused rows hold NaN;
    against naive attention, all sequences in one call, other rows of `out` untouched."""
    g = torch.Generator().manual_seed(2)
    (H, KVH, D), nblocks = shape, 2048 // bs
    k = cpu_paged._kernel
    if kernel == "amx" and not k.prefill_amx_fast_path(True, H, KVH, D, bs):
        pytest.skip("no AMX on this CPU (or in this build)")
    if kernel == "avx2" and not k.prefill_avx2_path(True, H, KVH, D, bs):
        pytest.skip("no AVX2 + FMA in this build")
    run = k.paged_prefill_amx if kernel == "amx" else functools.partial(k.paged_prefill, isa=kernel)
    k_cache = torch.full((KVH, nblocks, bs, D), float("nan")).bfloat16()
    v_cache = torch.full((KVH, nblocks, bs, D), float("nan")).bfloat16()
    perm = torch.randperm(nblocks, generator=g).tolist()
    shapes = [(0, 40), (37, 20), (100, 1), (0, 1), (16, 33), (5, 300)]  # (cached tokens, new tokens)
    tables = [[perm.pop() for _ in range(-(-(c + n) // bs))] for c, n in shapes]
    for (c, n), t in zip(shapes, tables):  # real rows where a sequence has tokens; NaN past them
        for j in range(c + n):
            k_cache[:, t[j // bs], j % bs] = torch.randn(KVH, D, generator=g).bfloat16()
            v_cache[:, t[j // bs], j % bs] = torch.randn(KVH, D, generator=g).bfloat16()
    max_nb = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables])
    pad = 3  # rows before the prefills (decodes in a real step)
    total = pad + sum(n for _, n in shapes)
    qkv = torch.randn(total, (H + 2 * KVH) * D, generator=g).bfloat16()
    q = qkv[:, : H * D].view(total, H, D)  # strided rows, as the model hands it over
    out = torch.full((total, H, D), 7.0, dtype=torch.bfloat16)
    starts = torch.tensor([pad + sum(n for _, n in shapes[:i]) for i in range(len(shapes))])
    lens = torch.tensor([n for _, n in shapes])
    ctx = torch.tensor([c + n for c, n in shapes])
    if not run(q, k_cache, v_cache, table, starts, lens, ctx, D**-0.5, out):
        assert kernel == "avx512" and not k.prefill_fast_path(True, H, KVH, D, bs)
        pytest.skip("no AVX-512 BF16 prefill kernel in this build")
    assert torch.all(out[:pad] == 7.0)
    for i, ((c, n), t) in enumerate(zip(shapes, tables)):
        rows = torch.tensor([t[j // bs] * bs + j % bs for j in range(c + n)])
        kk = k_cache.reshape(KVH, -1, D)[:, rows].transpose(0, 1)
        vv = v_cache.reshape(KVH, -1, D)[:, rows].transpose(0, 1)
        s = int(starts[i])
        ref = naive(q[s : s + n], kk, vv, D**-0.5)
        torch.testing.assert_close(out[s : s + n].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_write_kv_matches_index_copy(cpu_paged, dtype):
    """The C++ KV write puts every (token, head) row where the reference index_copy_ does, from strided
    views of the fused projection, touches nothing else, and rejects a slot outside the cache."""
    g = torch.Generator().manual_seed(3)
    KVH, D, bs, nblocks, T = 3, 64, 16, 12, 37
    qkv = torch.randn(T, (9 + 2 * KVH) * D, generator=g).to(dtype)
    k = qkv[:, 9 * D : (9 + KVH) * D].view(T, KVH, D)
    v = qkv[:, (9 + KVH) * D :].view(T, KVH, D)
    slots = torch.randperm(nblocks * bs, generator=g)[:T]
    caches = [torch.randn(KVH, nblocks, bs, D, generator=g).to(dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    cpu_paged.write_kv(k, v, LayerCache(caches[0], caches[1]), slots)
    get_attention_backend("torch").write_kv(k, v, LayerCache(ref[0], ref[1]), slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_paged.write_kv(k[:1], v[:1], LayerCache(caches[0], caches[1]), torch.tensor([nblocks * bs]))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_cpu_paged_softmax_flushes_tiny_weights(cpu_paged, kv_dtype):
    """Scores spread over hundreds (a peaked head over a long context): most softmax weights fall below
    1e-30, where the kernels flush them to zero instead of computing denormals (csrc/paged_decode.cpp,
    kSoftmaxFlush). Decode and prefill still match float32 attention: a dropped weight of < 1e-30 moves
    no output by a visible amount."""
    from pdserve.kv.quant import dequantize, quantize

    g = torch.Generator().manual_seed(7)
    H, KVH, D, bs, nblocks = 9, 3, 64, 16, 64
    n = 600
    # Keys of very different lengths along one direction: q.k spans about +-300 after scaling.
    k = torch.randn(n, KVH, D, generator=g) * torch.linspace(0.1, 6.0, n)[:, None, None]
    v = torch.randn(n, KVH, D, generator=g)
    kc = torch.zeros(KVH, nblocks * bs, D)
    vc = torch.zeros_like(kc)
    kc[:, :n], vc[:, :n] = k.transpose(0, 1), v.transpose(0, 1)
    kc, vc = kc.view(KVH, nblocks, bs, D), vc.view(KVH, nblocks, bs, D)
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize(kc, "int8"), quantize(vc, "int8")
        cache = LayerCache(kq, vq, ks, vs)
        kc, vc = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
    else:
        cache = LayerCache(kc.bfloat16(), vc.bfloat16())
        kc, vc = kc.bfloat16().float(), vc.bfloat16().float()
    kf = kc.reshape(KVH, -1, D)[:, :n].transpose(0, 1)
    vf = vc.reshape(KVH, -1, D)[:, :n].transpose(0, 1)
    table = torch.arange(-(-n // bs))[None, :]
    q = (torch.randn(1, H, D, generator=g) * 8).bfloat16()
    scores = torch.einsum("hd,shd->hs", q[0].float(), kf.repeat_interleave(H // KVH, 1)) * D**-0.5
    tiny = (scores - scores.max(-1, keepdim=True).values < -69).float().mean()
    assert tiny > 0.5  # the case is the one the flush is for
    group = DecodeGroup(0, 1, table, torch.tensor([n]), None)  # type: ignore[arg-type]
    out = cpu_paged.decode(q, cache, group, D**-0.5)
    torch.testing.assert_close(out.float(), naive(q, kf, vf, D**-0.5), atol=2e-2, rtol=2e-2)
    # Prefill: the last 40 positions as one chunk after 560 cached tokens.
    L = 40
    qp = (torch.randn(L, H, D, generator=g) * 8).bfloat16()
    outp = torch.zeros(L, H, D, dtype=torch.bfloat16)
    ran = cpu_paged._kernel.paged_prefill(
        qp, cache.k, cache.v, table, torch.tensor([0]), torch.tensor([L]), torch.tensor([n]), D**-0.5, outp,
        cache.k_scale, cache.v_scale,
    )
    if ran:
        torch.testing.assert_close(outp.float(), naive(qp, kf, vf, D**-0.5), atol=2e-2, rtol=2e-2)


def test_cpu_paged_amx_prefill_declines_what_it_does_not_run(cpu_paged):
    """The AMX prefill reads only a bf16 cache: an int8 one (or float32 queries) is declined, nothing written,
    so the caller's next kernel runs."""
    k = cpu_paged._kernel
    assert not k.prefill_amx_fast_path(False, 9, 3, 64, 16)
    assert not k.prefill_amx_fast_path(True, 18, 2, 64, 16)  # group 9: no fast shape
    kc = torch.zeros(3, 4, 16, 64, dtype=torch.int8)
    q = torch.randn(16, 9, 64).bfloat16()
    out = torch.full_like(q, 7.0)
    args = (torch.tensor([[0]]), torch.tensor([0]), torch.tensor([16]), torch.tensor([16]), 0.125, out)
    assert not k.paged_prefill_amx(q, kc, kc, *args)
    assert torch.all(out == 7.0)
    assert not k.paged_prefill_amx(q.float(), torch.zeros(3, 4, 16, 64), torch.zeros(3, 4, 16, 64), *args[:-1], out.float())
