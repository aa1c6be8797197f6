"""The int4 KV cache in the KIVI layout (kv/int4.py, kv/cache.py): packing and the quantizers' error
bounds, the block states (open in the residual pool, sealed as packed 4-bit), the reference attention's
reads, and the engine: one set of int4 answers whatever the chunking, prefix caching, preemption,
batching or speculation; closeness to the unquantized cache; capacity; the transfer payload."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from pdserve.kv import int4
from pdserve.kv.cache import KVCache, KVLayout, LayerCache
from tests.support.teacher_forced import kl_and_top1, teacher_forced_logprobs
from tests.support.tiny import TINY, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _greedy(llm, prompts, params=GREEDY) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _int4(make_tiny_llm, **kw):  # type: ignore[no-untyped-def]
    return make_tiny_llm(kv_cache_dtype="int4", **kw)


# ---- the reference quantization ----------------------------------------------------------------------

def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    packed = int4.pack(q)
    assert packed.shape == (3, 5, 4) and packed.dtype == torch.uint8
    assert torch.equal(int4.unpack(packed), q)
    assert int(int4.pack(torch.tensor([1, 2]))[0]) == 0x21  # element 0 in the low nibble


def _block(seed: int, bs: int = 16, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, bs, d, generator=g) * torch.logspace(-2, 1, d)  # channels over 3 decades
    x[..., 3] += 20.0  # an outlier channel with an offset, the case per-channel keys are for
    x[1] = 0.5  # a constant block: scale 0, exact
    return x


@pytest.mark.parametrize("which", ["keys", "values"])
def test_quantizer_error_is_within_half_a_step(which):
    """Asymmetric min/max: off by at most half a step (scale / 2) per value, plus the float16 rounding
    of the scale and zero; keys get one (scale, zero) per channel over the block, values per token."""
    x = _block(1)
    if which == "keys":
        packed, scale, zero = int4.quantize_keys(x)
        assert scale.shape == zero.shape == (4, 64)
        back = int4.dequantize_keys(packed, scale, zero, torch.float32)
        lo, hi, step = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True), scale.float().unsqueeze(-2)
    else:
        packed, scale, zero = int4.quantize_values(x)
        assert scale.shape == zero.shape == (4, 16)
        back = int4.dequantize_values(packed, scale, zero, torch.float32)
        lo, hi, step = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), scale.float().unsqueeze(-1)
    assert packed.shape == (4, 16, 32) and scale.dtype == torch.float16
    err = (back - x).abs()
    fp16 = 2.0**-10 * (lo.abs() + (hi - lo))  # the rounding of zero and of 15 * scale
    assert torch.all(err <= 0.5 * step + fp16 + 1e-6)
    assert torch.equal(back[1], x[1])  # constant: exact
    assert (err > 0.25 * step).any()  # not trivially exact: the bound is reached in places


def test_per_channel_keys_beat_per_token_on_an_outlier_channel():
    """Why keys go per channel: with an outlier channel, per-token scales waste the range on it."""
    x = _block(2)
    per_channel = int4.dequantize_keys(*int4.quantize_keys(x), torch.float32)
    per_token = int4.dequantize_values(*int4.quantize_values(x), torch.float32)
    assert (per_channel - x).pow(2).mean() < 0.2 * (per_token - x).pow(2).mean()


# ---- the cache's block states -------------------------------------------------------------------------

def _cache(num_blocks: int = 8, bs: int = 4, slots: int = 4, host: int = 0) -> KVCache:
    layout = KVLayout(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, torch.uint8, bs, torch.float32)
    assert layout.kv_dtype == "int4" and layout.is_int4
    return KVCache(layout, num_blocks, torch.device("cpu"), num_host_blocks=host, num_residual_slots=slots)


def _fill(cache: KVCache, blocks: list[int], seed: int = 0) -> torch.Tensor:
    """Write whole `blocks` of every layer through the reference write; their K/V `[L, 2, KVH, n, BS, D]`."""
    from pdserve.kv.cache import write

    bs = cache.block_size
    slots = torch.tensor([b * bs + o for b in blocks for o in range(bs)])
    cache.begin_step(slots, torch.tensor([blocks]), torch.zeros(1, dtype=torch.int64))
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(TINY.num_layers, 2, len(slots), TINY.num_kv_heads, TINY.head_dim, generator=g)
    for i, layer in enumerate(cache.layers):
        write(layer, kv[i, 0], kv[i, 1], slots)
    return kv.view(TINY.num_layers, 2, len(blocks), bs, TINY.num_kv_heads, -1).permute(0, 1, 4, 2, 3, 5)


def _next_step(cache: KVCache) -> None:
    """A step that writes nothing: what was marked committed is sealed."""
    cache.begin_step(torch.zeros(0, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_blocks_open_on_first_write_and_read_back_exactly_until_sealed():
    cache = _cache()
    want = _fill(cache, [5, 2])
    assert cache.num_open_blocks == 2 and cache.residual_slot[5] >= 0 and cache.residual_slot[2] >= 0
    ids = torch.tensor([5, 2])
    k, v = cache.layers[1].gather_blocks(ids, torch.float32)
    assert torch.equal(k, want[1, 0]) and torch.equal(v, want[1, 1])  # open: unquantized
    ks, vs = cache.layers[1].gather_sealed(ids, torch.float32)  # what they will read as once sealed
    cache.end_step(torch.tensor([[5, 2]]), torch.tensor([2]))
    _fill(cache, [5, 2])  # the same step again (a replay): a block is not sealed while it is written
    assert cache.num_open_blocks == 2
    cache.end_step(torch.tensor([[5, 2]]), torch.tensor([2]))
    _next_step(cache)
    assert cache.num_open_blocks == 0 and int(cache.residual_slot[5]) == -1
    k2, v2 = cache.layers[1].gather_blocks(ids, torch.float32)
    assert torch.equal(k2, ks) and torch.equal(v2, vs)  # sealing is the on-the-fly quantization
    assert not torch.equal(k2, want[1, 0])
    assert torch.allclose(k2, want[1, 0], atol=0.6)  # 4 bits of randn over a block: a step ~0.4


def test_cpp_int4_write_equals_the_reference_and_refuses_sealed_blocks():
    """`write_kv_int4` (cpu-paged's int4 write) puts rows where `kv.cache.write` does: two caches given the
    same steps hold the same residual rows, bit for bit, with tokens out of order and partial blocks; a
    token in a sealed block is an error that writes nothing."""
    from pdserve.attention.cpu_paged import load_kernel
    from pdserve.kv.cache import write

    try:
        kernel = load_kernel()
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")
    ref, cpp = _cache(), _cache()
    bs, g = ref.block_size, torch.Generator().manual_seed(3)
    slots = torch.tensor([5 * bs + 2, 2 * bs, 5 * bs, 2 * bs + 3, 7 * bs + 1])  # blocks 5, 2, 7: partly
    for c in (ref, cpp):
        c.begin_step(slots, torch.tensor([[5, 2, 7]]), torch.zeros(1, dtype=torch.int64))
    kv = torch.randn(TINY.num_layers, 2, len(slots), TINY.num_kv_heads, TINY.head_dim, generator=g)
    for i in range(TINY.num_layers):
        write(ref.layers[i], kv[i, 0], kv[i, 1], slots)
        lay = cpp.layers[i]
        kernel.write_kv_int4(kv[i, 0], kv[i, 1], lay.residual_k, lay.residual_v, lay.residual_slot, slots)
    assert torch.equal(ref.residual_slot, cpp.residual_slot) and torch.equal(ref.residual, cpp.residual)
    assert ref.residual.abs().sum() > 0
    before = cpp.residual.clone()
    lay = cpp.layers[0]
    sealed = torch.tensor([5 * bs + 1, 3 * bs])  # block 3 was never opened
    with pytest.raises(RuntimeError, match="sealed int4 block"):
        kernel.write_kv_int4(kv[0, 0, :2], kv[0, 1, :2], lay.residual_k, lay.residual_v, lay.residual_slot, sealed)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.write_kv_int4(kv[0, 0, :1], kv[0, 1, :1], lay.residual_k, lay.residual_v, lay.residual_slot,
                             torch.tensor([8 * bs]))
    assert torch.equal(cpp.residual, before)


def test_only_committed_blocks_seal_and_freed_blocks_give_their_slot_back():
    cache = _cache()
    _fill(cache, [1, 3])
    cache.end_step(torch.tensor([[1, 3]]), torch.tensor([1]))  # block 3 holds drafts: stays open
    _next_step(cache)
    assert int(cache.residual_slot[1]) == -1 and int(cache.residual_slot[3]) >= 0
    cache.note_freed(3, False)  # rejected and freed: nothing to keep
    cache.swap([], [])  # every step forgets freed blocks
    assert cache.num_open_blocks == 0
    _fill(cache, [6])
    cache.note_freed(6, True)  # full and cached: sealed, findable by its hash
    cache.swap([], [])
    assert cache.num_open_blocks == 0 and int(cache.residual_slot[6]) == -1
    assert cache.k_qparams[:, 0, :, 6].abs().sum() > 0


def test_swap_moves_sealed_bytes_and_open_blocks_unquantized():
    cache = _cache(host=4)
    _fill(cache, [0, 1], seed=1)
    cache.end_step(torch.tensor([[0, 1]]), torch.tensor([1]))  # block 0 sealed, block 1 open
    _next_step(cache)
    ids = torch.tensor([0, 1])
    before = [layer.gather_blocks(ids, torch.float32) for layer in cache.layers]
    cache.swap([], [(0, 2), (1, 3)])
    cache.note_freed(0, False), cache.note_freed(1, False)
    cache.swap([], [])
    assert cache.num_open_blocks == 0 and set(cache.host_residual) == {3}
    _fill(cache, [4, 5], seed=9)  # the device blocks are reused meanwhile
    cache.end_step(torch.tensor([[4, 5]]), torch.tensor([2]))
    _next_step(cache)
    cache.swap([(2, 6), (3, 7)], [])
    assert int(cache.residual_slot[6]) == -1 and int(cache.residual_slot[7]) >= 0
    for layer, (k, v) in zip(cache.layers, before):
        k2, v2 = layer.gather_blocks(torch.tensor([6, 7]), torch.float32)
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_capacity_from_block_bytes():
    """Tiny model (3 layers, 2 kv heads, head_dim 16, blocks of 4): bf16 2 * 4 * 16 * 2 = 256 bytes per
    head, int4 4 * 16 (packed K and V) + 2 * 16 * 2 (K scale, zero) + 2 * 4 * 2 (V) = 144; SmolLM2
    (head_dim 64, blocks of 16): 4096 against 1344, 3.05x."""
    for cfg_d, bs, ratio in ((16, 4, 256 / 144), (64, 16, 4096 / 1344)):
        bf16 = KVLayout(3, 2, cfg_d, torch.bfloat16, bs)
        q4 = KVLayout(3, 2, cfg_d, torch.uint8, bs)
        assert bf16.block_bytes / q4.block_bytes == pytest.approx(ratio)
        assert q4.residual_slot_bytes == bf16.block_bytes


def test_engine_capacity_counts_the_residual_pool(make_tiny_llm):
    """The residual pool (one slot per block that can be open at once) is paid from the same budget."""
    from pdserve.engine.llm_engine import int4_residual_slots

    budget = int(0.01 * (1 << 30))
    q4 = _int4(make_tiny_llm, num_blocks=None, kv_cache_memory_gb=0.01, max_num_seqs=16,
               max_num_batched_tokens=64).engine
    layout, cache = q4.kv_layout, q4.kv_cache
    slots = int4_residual_slots(q4.config.scheduler, 4, None)
    assert slots == 16 * 2 + 64 // 4 + 4 == cache.residual.shape[3]
    assert cache.num_blocks == (budget - slots * layout.residual_slot_bytes) // layout.block_bytes
    assert cache.nbytes <= budget


# ---- the engine ---------------------------------------------------------------------------------------

def test_one_set_of_int4_answers(make_tiny_llm):
    """Every read sees what a decode would, so chunked prefill, the prefix cache, recompute and swap
    preemption, and batching all give the answers of one request at a time with no prefix cache."""
    base = random_prompts(4, 9, 40, seed=5)
    prompts = base + [p + [7, 8, 9, 10, 11] for p in base]  # each shares its base's full blocks
    alone = [_greedy(_int4(make_tiny_llm, enable_prefix_caching=False), [p])[0] for p in prompts]
    cached = _int4(make_tiny_llm)
    assert _greedy(cached, base) + _greedy(cached, prompts[len(base):]) == alone
    assert cached.engine.scheduler.block_manager.num_prefix_hit_tokens > 0
    assert _greedy(cached, prompts) == alone  # batched
    chunked = _int4(make_tiny_llm, enable_prefix_caching=False, max_num_batched_tokens=16, chunk_size=7)
    assert _greedy(chunked, prompts) == alone
    for mode in ("recompute", "swap"):
        small = _int4(make_tiny_llm, num_blocks=30, max_num_batched_tokens=64, preemption_mode=mode,
                      swap_space_gb=0.01)
        assert _greedy(small, prompts) == alone, mode
        sched = small.engine.scheduler
        assert sched.num_preemptions > 0 and (mode == "recompute" or sched.num_swapped_in_blocks > 0)
        assert small.engine.kv_cache.num_open_blocks <= len(prompts)
    assert cached.engine.kv_cache.num_open_blocks <= len(prompts)  # finished requests' slots came back


def test_int4_answers_are_not_the_unquantized_ones(make_tiny_llm):
    """The equalities above are not vacuous: sealed blocks are really read as 4 bits."""
    prompts, params = random_prompts(6, 20, 40, seed=8), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _greedy(_int4(make_tiny_llm), prompts, params) != _greedy(make_tiny_llm(), prompts, params)


def test_speculation_does_not_change_int4_output(make_tiny_llm):
    """Draft tokens fill blocks before they are verified: such a block is sealed only once they are
    accepted, and a rejected one is rewritten in place, so greedy output is speculation's plain one."""
    ps = random_prompts(6, 4, 30, seed=5)
    prompts = [p + p for p in ps]  # repeated text: lookups find matches
    for opts in (dict(), dict(num_blocks=24, preemption_mode="swap")):
        want = _greedy(_int4(make_tiny_llm, **opts), prompts)
        llm = _int4(make_tiny_llm, speculative_config=NGRAM, **opts)
        assert _greedy(llm, prompts) == want
        stats = llm.engine.spec_decode_stats
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_teacher_forced_kl_against_the_unquantized_cache(make_tiny_llm, monkeypatch):
    """Teacher-forced over 6 x 64 positions of the tiny random model (blocks of 16): mean KL(unquantized ||
    int4). The newest tokens in full precision matter: read as sealed too (no residual: every query's
    own block quantized), the distributions move ~3x further (measured: 5.7e-4 with, 1.6e-3 without)."""
    ref = make_tiny_llm(num_blocks=64).engine
    seqs = random_prompts(6, 64, 64, seed=21)
    want = [teacher_forced_logprobs(ref, ids) for ids in seqs]

    def mean_kl() -> float:
        q4 = _int4(make_tiny_llm, num_blocks=64, block_size=16).engine
        return torch.cat([kl_and_top1(w, teacher_forced_logprobs(q4, ids))[0] for w, ids in zip(want, seqs)]).mean().item()

    kl = mean_kl()
    monkeypatch.setattr(LayerCache, "gather_blocks", LayerCache.gather_sealed)
    kl_no_residual = mean_kl()
    assert 0 < kl < 1.5e-3 and kl_no_residual > 2 * kl, (kl, kl_no_residual)


def _as_stored(cache: KVCache, block: int, layer: int) -> list[torch.Tensor]:
    """What a sealed block holds in one layer: packed K/V, K's and V's scales and zeros."""
    return [cache.data[layer, :, :, block], cache.k_qparams[layer, :, :, block], cache.v_qparams[layer, :, :, block]]


def test_transfer_payload_rebuilds_the_cache_state():
    """Disaggregation moves int4 as stored: a chunk of whole blocks (one sealed, one still open because
    this step wrote it) and an open last block of 3 tokens lands as the same state on the other side:
    the whole blocks sealed with the bytes the sender seals them with, the last one open with its
    unquantized rows; stale state of the blocks' earlier owner (open, a free not yet forgotten) is gone."""
    a, b = _cache(slots=4), _cache(slots=4)
    _fill(a, [5, 2])
    a.end_step(torch.tensor([[5, 2]]), torch.tensor([1]))
    _fill(a, [2, 7], seed=1)  # seals 5; 2 and 7 open, written this step
    assert [int(a.residual_slot[i]) >= 0 for i in (5, 2, 7)] == [False, True, True]
    _fill(b, [1, 3], seed=2)  # the receiver's blocks, open under an earlier owner
    b.note_freed(1, cached=True)  # ... one of them freed: its next forget would seal it from the residual
    b.note_freed(4, cached=False)  # the block for the open tail, freed: its forget would drop the tail
    bs = a.block_size
    src = torch.cat([torch.arange(bs) + 5 * bs, torch.arange(bs) + 2 * bs, torch.arange(3) + 7 * bs])
    dst = torch.cat([torch.arange(bs) + 1 * bs, torch.arange(bs) + 3 * bs, torch.arange(3) + 4 * bs])
    for layer in range(TINY.num_layers):
        payload = a.gather_tokens(layer, src)
        assert payload.shape == a.layout.chunk_shape(11) == (2, TINY.num_kv_heads, 2 * 72 + 3 * 16 * 4)
        b.scatter_tokens(layer, dst, payload)
    _next_step(b)
    assert [int(b.residual_slot[i]) >= 0 for i in (1, 3, 4)] == [False, False, True] and b.num_open_blocks == 1
    a.end_step(torch.tensor([[5, 2, 7]]), torch.tensor([2]))
    _next_step(a)  # the sender seals 2 as its next step would
    ra, rb = int(a.residual_slot[7]), int(b.residual_slot[4])
    for layer in range(TINY.num_layers):
        for src_block, dst_block in [(5, 1), (2, 3)]:
            for x, y in zip(_as_stored(a, src_block, layer), _as_stored(b, dst_block, layer)):
                assert torch.equal(x, y)
        assert torch.equal(a.residual[layer, :, :, ra, :3], b.residual[layer, :, :, rb, :3])
        ka, va = a.layers[layer].gather_blocks(torch.tensor([5, 2, 7]), torch.float32)
        kb, vb = b.layers[layer].gather_blocks(torch.tensor([1, 3, 4]), torch.float32)
        assert torch.equal(ka.flatten(1, 2)[:, :11], kb.flatten(1, 2)[:, :11])
        assert torch.equal(va.flatten(1, 2)[:, :11], vb.flatten(1, 2)[:, :11])


def test_transfer_payload_is_refused_unless_it_fits():
    a = _cache()
    _fill(a, [2])
    payload = a.gather_tokens(0, torch.arange(3) + 8)
    with pytest.raises(ValueError, match="does not fit"):
        a.scatter_tokens(0, torch.arange(4) + 8, payload)
    with pytest.raises(ValueError, match="block boundary"):
        a.scatter_tokens(0, torch.arange(3) + 9, payload)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_paged_int4_decode_equals_the_reference(dtype, tol):
    """The C++ decode reads sealed blocks in place and open ones from the residual pool: the reference's
    decode of the same cache, over contexts mixing both (a request's last block open, one request all
    open, padded block tables)."""
    from pdserve.attention.base import DecodeGroup
    from pdserve.attention.cpu_paged import CpuPagedAttention
    from pdserve.attention.torch_ref import TorchAttention

    bs, d, kvh, h = 16, 64, 2, 6
    layout = KVLayout(1, kvh, d, torch.uint8, bs, dtype)
    cache = KVCache(layout, 24, torch.device("cpu"), num_residual_slots=8)
    g = torch.Generator().manual_seed(4)
    ctx = [37, 16, 5, 64]
    tables = [[3, 9, 4], [7], [11], [0, 1, 2, 5]]
    for n, table in zip(ctx, tables):
        slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)])
        cache.begin_step(slots, torch.tensor([table]), torch.zeros(1, dtype=torch.int64))
        k, v = (torch.randn(n, kvh, d, generator=g).to(dtype) for _ in range(2))
        TorchAttention().write_kv(k, v, cache.layers[0], slots)
        cache.end_step(torch.tensor([table]), torch.tensor([n // bs if n != 16 else 0]))  # request 1 stays open
    _next_step(cache)
    assert 0 < cache.num_open_blocks < 9
    nb = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (nb - len(t)) for t in tables])
    lens = torch.tensor(ctx)
    mask = (torch.arange(nb * bs) < lens[:, None]).view(len(ctx), 1, 1, -1)
    group = DecodeGroup(0, len(ctx), table, lens, mask)
    q = torch.randn(len(ctx), h, d, generator=g).to(dtype)
    want = TorchAttention().decode(q, cache.layers[0], group, 0.125)
    attn = CpuPagedAttention()
    assert attn.supports_kv_dtype("int4")
    got = attn.decode(q, cache.layers[0], group, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_bf16_engine_decodes_int4_with_the_cpp_kernel(tiny_weights):
    """A bf16 engine on the CPU keeps cpu-paged for int4 (C++ decode, reference writes and prefills),
    and its greedy tokens mostly equal the torch reference's (bf16 sums in another order may flip a
    near tie)."""
    from pdserve import LLM

    prompts = random_prompts(4, 20, 40, seed=2)

    def run(backend: str) -> tuple[str, list[list[int]]]:
        llm = LLM(dtype="bfloat16", device="cpu", model_config=TINY, weights=tiny_weights, num_blocks=128,
                  block_size=16, kv_cache_dtype="int4", attention_backend=backend)
        return llm.engine.runner.attn.name, _greedy(llm, prompts)

    (name, got), (_, want) = run("cpu-paged"), run("torch")
    assert name == "cpu-paged"
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.75 * sum(len(w) for w in want), (got, want)


def _random_int4_layer(bs: int, d: int, kvh: int, num_blocks: int, slots: int, seed: int) -> LayerCache:
    """A layer of an int4 cache with every block sealed from random K/V (channels over 2 decades and an
    outlier channel, so the per-channel scales differ) and random bf16 rows in every residual slot;
    the caller opens blocks by pointing `residual_slot` at a slot."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kvh, num_blocks, bs, d, generator=g) * torch.logspace(-1, 1, d)
    k[..., 5] += 8.0
    v = torch.randn(kvh, num_blocks, bs, d, generator=g)
    (pk, ks, kz), (pv, vs, vz) = int4.quantize_keys(k), int4.quantize_values(v)
    rk, rv = (torch.randn(kvh, slots, bs, d, generator=g).to(torch.bfloat16) for _ in range(2))
    return LayerCache(pk, pv, ks, vs, kz, vz, rk, rv, torch.full((num_blocks,), -1, dtype=torch.int32))


def _int4_decode_case(kernel, bs: int, d: int, group: int, seed: int, isa: str = "auto"):  # type: ignore[no-untyped-def]
    """(C++ int4 decode in bf16, the reference in float32, the portable loop in bf16) on a random cache:
    requests with a partly filled open last block, one all open, one of exactly full sealed blocks, one
    shorter than 16 tokens, one with an open block mid-context (adopted from the prefix cache before it
    was sealed), one of 20 blocks and a few tokens (the AVX-512 kernel's integer p.v takes sealed blocks
    in runs of at most 256 rows; an open block splits its runs), block tables in random order and padded."""
    from pdserve.attention.base import DecodeGroup
    from pdserve.attention.torch_ref import TorchAttention

    kvh, nb = 2, 64
    layer = _random_int4_layer(bs, d, kvh, nb, slots=12, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ctx = [3 * bs + 5, bs - 3, 4 * bs, 7, 2 * bs + 1, 5 * bs + bs // 2, 20 * bs + 3]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for n in ctx:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    mid_context = [tables[4][1], tables[5][0], tables[6][9]]
    opened = [t[-1] for n, t in zip(ctx, tables) if n % bs] + mid_context
    for slot, blk in enumerate(opened):
        layer.residual_slot[blk] = slot
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(ctx)
    mask = (torch.arange(width * bs) < lens[:, None]).view(len(ctx), 1, 1, -1)
    q = torch.randn(len(ctx), kvh * group, d, generator=g).to(torch.bfloat16)
    scale = d**-0.5
    want = TorchAttention().decode(q.float(), layer, DecodeGroup(0, len(ctx), table, lens, mask), scale)
    args = (layer.k, layer.v, layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero, layer.residual_k,
            layer.residual_v, layer.residual_slot, table, lens, scale)
    got = kernel.paged_decode_int4(q, *args, isa=isa)
    # The portable loop in float32 queries and residual, rounded to bf16: the same maths, another order.
    f32 = (*args[:6], layer.residual_k.float(), layer.residual_v.float(), *args[8:])
    portable = kernel.paged_decode_int4(q.float(), *f32).to(torch.bfloat16)
    return got, want, portable


@pytest.fixture(scope="module")
def fast_int4_kernel():  # type: ignore[no-untyped-def]
    from pdserve.attention.cpu_paged import load_kernel

    try:
        kernel = load_kernel()
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")
    if not kernel.decode_int4_fast_path(True, 6, 2, 64, 16):
        pytest.skip("no AVX-512 BF16 kernels in this build")
    return kernel


@pytest.mark.parametrize("bs,d", [(16, 64), (16, 128), (32, 64), (32, 128)])
@pytest.mark.parametrize("group", [1, 3, 7, 8])
def test_avx512_int4_decode_equals_the_reference(fast_int4_kernel, bs, d, group):
    """The AVX-512 int4 decode (nibbles read in place, key scales folded into the query per block, value
    scales into p) against the reference in float32 over the same cache, mixing sealed and open blocks.
    Measured (this test's cases): max error 1.0e-2 .. 4.4e-2, where the torch reference run in bf16 is off
    by 1.7e-2 .. 5.2e-2 (it rounds the dequantized keys to bf16, the kernel rounds q_c s_c) and the
    portable loop by the output's bf16 rounding (~7e-3); |out| up to ~4."""
    got, want, portable = _int4_decode_case(fast_int4_kernel, bs, d, group, seed=bs + d + group)
    err = (got.float() - want).abs()
    assert err.max() < 6e-2 and err.mean() < 4e-3, (err.max(), err.mean())
    assert (portable.float() - want).abs().max() < 1.5e-2  # the case itself is sound


@pytest.fixture(scope="module")
def avx2_int4_kernel():  # type: ignore[no-untyped-def]
    """The kernel module where its build has the AVX2 + FMA int4 kernels (every x86-64 host of this machine
    kind; tests force them with `isa="avx2"`)."""
    from pdserve.attention.cpu_paged import load_kernel

    try:
        kernel = load_kernel()
    except Exception as e:  # no compiler here
        pytest.skip(f"cpu-paged unavailable: {e}")
    if not kernel.decode_int4_avx2_path(True, 6, 2, 64, 16):
        pytest.skip("no AVX2 + FMA kernels in this build")
    return kernel


@pytest.mark.parametrize("bs,d", [(16, 64), (16, 128), (32, 64), (32, 128)])
@pytest.mark.parametrize("group", [1, 3, 6, 7, 8])
def test_avx2_int4_decode_equals_the_reference(avx2_int4_kernel, bs, d, group):
    """The AVX2 + FMA int4 decode (hosts without AVX-512 BF16; forced here by `isa="avx2"` wherever the
    build has AVX2) against the reference in float32 on the same mixed sealed/open caches. It keeps
    q_c s_c in float32 (no bf16 dot product to feed), so only the bf16 output rounds: measured max error
    3.9e-3 .. 7.8e-3 over these cases, the portable loop's own."""
    kernel = avx2_int4_kernel
    got, want, portable = _int4_decode_case(kernel, bs, d, group, seed=bs + d + group, isa="avx2")
    err = (got.float() - want).abs()
    assert err.max() < 1e-2 and err.mean() < 1e-3, (err.max(), err.mean())
    assert (portable.float() - want).abs().max() < 1.5e-2  # the case itself is sound


def test_kernel_paths_name_the_int4_decode(fast_int4_kernel):
    """`kernel_paths` (the start log) names the decode that runs: AVX-512 for bf16 with blocks of a
    multiple of 16, the portable loop otherwise, with the reason."""
    from pdserve.attention.cpu_paged import CpuPagedAttention

    attn = CpuPagedAttention()
    decode, prefill, why = attn.kernel_paths(_random_int4_layer(16, 64, 2, 4, 2, seed=0), 6)
    assert decode == "C++ AVX-512 BF16, int4 KV (head_dim 64, 3 query heads per kv head)" and why is None
    assert prefill == "C++ AVX-512 BF16 flash, int4 KV (head_dim 64, 3 query heads per kv head)"
    small = _random_int4_layer(8, 64, 2, 4, 2, seed=0)
    decode, _, why = attn.kernel_paths(small, 6)
    assert decode == "C++ portable loop, int4 KV" and why == "block size 8 is not a multiple of 16"
    assert attn.kernel_paths(small, 6)[1] == "torch reference (int4)"
    f32 = _random_int4_layer(16, 64, 2, 4, 2, seed=0)
    f32.residual_k = f32.residual_k.float()
    decode, _, why = attn.kernel_paths(f32, 6)
    assert decode == "C++ portable loop, int4 KV" and "residual pool is torch.float32" in why


def _int4_prefill_case(kernel, bs: int, d: int, group: int, seed: int, isa: str = "auto"):  # type: ignore[no-untyped-def]
    """(C++ int4 prefill in bf16, the reference in float32) for one step's chunks: a fresh prompt (every
    block open: its queries read the blocks before their own quantized on the fly), a chunk after sealed
    context, a chunk shorter than a tile ending mid-block, and one whose context holds an open block
    adopted from the prefix cache."""
    from pdserve.attention.base import AttentionMetadata, PrefillSeq
    from pdserve.attention.torch_ref import TorchAttention

    kvh, nb = 2, 64
    layer = _random_int4_layer(bs, d, kvh, nb, slots=24, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    chunks = [(3 * bs + 5, 3 * bs + 5), (4 * bs + 7, bs + 10), (2 * bs + 9, 6), (3 * bs + 2, bs + 2)]  # (ctx, q_len)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used, slot = [], 0, 0
    for i, (n, qn) in enumerate(chunks):
        table = perm[used : used + -(-n // bs)]
        used += len(table)
        written = {t // bs for t in range(n - qn, n)} | ({1} if i == 3 else set())  # chunk 3: block 1 adopted open
        for kb in sorted(written):
            layer.residual_slot[table[kb]] = slot
            slot += 1
        tables.append(table)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q_lens = torch.tensor([qn for _, qn in chunks])
    starts = torch.cumsum(q_lens, 0) - q_lens
    ctx = torch.tensor([n for n, _ in chunks])
    prefills = [PrefillSeq(int(s), qn, n, None, None) for s, (n, qn) in zip(starts, chunks)]
    total = int(q_lens.sum())
    meta = AttentionMetadata(torch.zeros(total, dtype=torch.int64), 0, [], prefills, table, ctx, starts, q_lens)
    q = torch.randn(total, kvh * group, d, generator=g).to(torch.bfloat16)
    scale = d**-0.5
    want = torch.empty(total, kvh * group, d)
    TorchAttention()._prefill_int4(q.float(), layer, meta, scale, want)
    got = torch.full_like(q, float("nan"))
    ran = kernel.paged_prefill_int4(q, layer.k, layer.v, layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero,
                                    layer.residual_k, layer.residual_v, layer.residual_slot, table, starts, q_lens, ctx,
                                    scale, got, isa=isa)
    assert ran
    return got, want


@pytest.mark.parametrize("bs,d", [(16, 64), (16, 128), (32, 64), (32, 128)])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_avx512_int4_prefill_equals_the_reference(fast_int4_kernel, bs, d, group):
    """The C++ int4 prefill against the reference in float32. The kernel dequantizes sealed rows to bf16
    (n * s + z, one rounding, as the reference does in bf16) and rounds p to bf16 for p.v, so it is not
    exact; measured over these cases: max error 1.6e-2 .. 3.3e-2, mean ~1.1e-3 (|out| up to ~4), the order of
    the torch reference's own bf16 error in decode."""
    got, want = _int4_prefill_case(fast_int4_kernel, bs, d, group, seed=3 * bs + d + group)
    err = (got.float() - want).abs()
    assert err.max() < 6e-2 and err.mean() < 4e-3, (err.max(), err.mean())


@pytest.mark.parametrize("bs,d", [(16, 64), (16, 128), (32, 64), (32, 128)])
@pytest.mark.parametrize("group", [1, 3, 6, 7])
def test_avx2_int4_prefill_equals_the_reference(avx2_int4_kernel, bs, d, group):
    """The AVX2 + FMA int4 prefill (forced by `isa="avx2"`) against the reference in float32: sealed rows
    dequantized to float (not rounded to bf16) and p kept in float, so only the output's bf16 rounding and
    the open blocks' sealed versions (bf16, as the reference's) differ; measured over these cases: max error
    7.5e-3 .. 9.5e-3, mean ~5e-4 (the AVX-512 kernel's: 1.6e-2 .. 4.1e-2, ~1e-3)."""
    kernel = avx2_int4_kernel
    got, want = _int4_prefill_case(kernel, bs, d, group, seed=3 * bs + d + group, isa="avx2")
    err = (got.float() - want).abs()
    assert err.max() < 1.5e-2 and err.mean() < 1e-3, (err.max(), err.mean())


def _int4_engine_case():  # type: ignore[no-untyped-def]
    """A qwen-like random model (head_dim 64, 3 query heads per kv head), four prompts, greedy parameters,
    and engine(backend): a bf16 engine on it with an int4 cache in blocks of 16 and chunked prompts."""
    from pdserve import LLM
    from pdserve.model.llama import random_weights
    from tests.model.test_kernel_paths import qwen_like

    cfg = qwen_like(64)
    weights = random_weights(cfg)
    prompts = random_prompts(4, 30, 70, seed=3, vocab=cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def engine(backend: str):  # type: ignore[no-untyped-def]
        return LLM(dtype="bfloat16", device="cpu", model_config=cfg, weights=weights, num_blocks=64, block_size=16,
                   kv_cache_dtype="int4", attention_backend=backend, max_num_batched_tokens=48)

    return cfg, prompts, params, engine


def test_bf16_engine_runs_the_avx512_int4_kernels():
    """A bf16 engine with head_dim 64 and blocks of 16 runs the AVX-512 int4 decode and prefill (the
    start log's paths), chunked prompts included, and its greedy tokens mostly equal the torch
    reference's (bf16 sums in another order may flip a near tie of the random model)."""
    from pdserve.attention.cpu_paged import load_kernel

    if not load_kernel().decode_int4_fast_path(True, 9, 3, 64, 16):
        pytest.skip("no AVX-512 BF16 here: the int4 kernels' portable paths are tested above")
    cfg, prompts, params, engine = _int4_engine_case()
    llm = engine("cpu-paged")
    got = _greedy(llm, prompts, params)
    decode, prefill, why = llm.engine.runner.attn.kernel_paths(llm.engine.kv_cache.layers[0], cfg.num_heads)
    assert "AVX-512" in decode and "AVX-512" in prefill and why is None
    want = _greedy(engine("torch"), prompts, params)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.75 * sum(len(w) for w in want), (got, want)


def test_int4_prefill_reads_earlier_open_blocks_as_sealed(fast_int4_kernel, monkeypatch):
    """The prefill test above can fail: read unquantized instead (the open blocks before a query's own,
    as a prompt's own K/V in KIVI's paper), the reference moves past the bound (measured: 0.13 against
    the kernel, where the right reference is 0.02 away)."""
    got, want = _int4_prefill_case(fast_int4_kernel, 16, 64, 3, seed=115)
    monkeypatch.setattr(LayerCache, "gather_sealed", LayerCache.gather_blocks)
    _, want_open = _int4_prefill_case(fast_int4_kernel, 16, 64, 3, seed=115)
    assert (got.float() - want).abs().max() < 6e-2 < (got.float() - want_open).abs().max()


class _Avx2Only:
    """The kernel module as a build without AVX-512 BF16 sees it: the path predicates say no AVX-512 and the
    int4 entry points run their AVX2 + FMA kernels (what an AVX2 host's engine calls)."""

    def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
        self._kernel = kernel
        self.calls = {"decode": 0, "prefill": 0}  # AVX2 kernel calls that ran

    def decode_int4_fast_path(self, *args) -> bool:  # type: ignore[no-untyped-def]
        return False

    def decode_fast_path(self, *args) -> bool:  # type: ignore[no-untyped-def]
        return False

    def paged_decode_int4(self, *args):  # type: ignore[no-untyped-def]
        self.calls["decode"] += 1
        return self._kernel.paged_decode_int4(*args, isa="avx2")

    def paged_prefill_int4(self, *args) -> bool:  # type: ignore[no-untyped-def]
        ran = self._kernel.paged_prefill_int4(*args, isa="avx2")
        self.calls["prefill"] += ran
        return ran

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._kernel, name)


def test_engine_on_the_avx2_int4_kernels(avx2_int4_kernel):
    """An engine on an AVX2 host: the start log names the AVX2 int4 decode and prefill, and a bf16 engine
    with a qwen-like shape (head_dim 64, 3 query heads per kv head, blocks of 16) running them, chunked
    prompts included, gives mostly the torch reference's greedy tokens."""
    cfg, prompts, params, engine = _int4_engine_case()
    llm = engine("cpu-paged")
    attn = llm.engine.runner.attn
    attn._kernel = avx2 = _Avx2Only(attn._kernel)
    decode, prefill, why = attn.kernel_paths(llm.engine.kv_cache.layers[0], cfg.num_heads)
    shape = f"head_dim 64, {cfg.num_heads // cfg.num_kv_heads} query heads per kv head"
    assert (decode, prefill, why) == (f"C++ AVX2 + FMA, int4 KV ({shape})", f"C++ AVX2 + FMA flash, int4 KV ({shape})", None)
    assert attn.kernel_paths(_random_int4_layer(8, 64, 2, 4, 2, seed=0), 6) == (
        "C++ portable loop, int4 KV", "torch reference (int4)", "block size 8 is not a multiple of 16")
    got = _greedy(llm, prompts, params)
    assert avx2.calls["decode"] > 0 and avx2.calls["prefill"] > 0, avx2.calls
    want = _greedy(engine("torch"), prompts, params)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.9 * sum(len(w) for w in want), (same, got, want)
