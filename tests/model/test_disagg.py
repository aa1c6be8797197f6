"""Prefill/decode disaggregation at the engine level (two engines in one process, tiny random model,
float32): disaggregated greedy output equals colocated output on every backend, only the blocks the
decode side lacks travel, and every way a transfer can end frees the blocks on both sides."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.transfer.connector import RemoteDecode, RemotePrefill
from pdserve.engine.disagg import generate_disaggregated
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError
from pdserve.request import RequestStatus
from pdserve.transfer.base import KVLayout, TransferState
from pdserve.transfer.inproc import InprocHub, InprocTransport
from tests.support.tiny import TINY, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LAYOUT = KVLayout(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, torch.float32, block_size=4)


def make_engine(
    weights, role: str, transport=None, *, lease_s: float = 120.0, ack_timeout_s: float = 10.0,
    kv_cache_dtype: str = "auto", tokenizer=None, **sched,
):
    kv = KVTransferConfig(
        role=role, backend=None if role == "both" else "inproc", lease_s=lease_s, ack_timeout_s=ack_timeout_s
    )
    cfg = EngineConfig(
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_blocks=256, block_size=4, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(**sched),
        kv_transfer=kv,
    )
    return LLMEngine(cfg, model_config=TINY, weights=weights, kv_transport=transport, tokenizer=tokenizer)


def make_transport(backend: str, hub: InprocHub, layout: KVLayout = LAYOUT):
    if backend == "inproc":
        return InprocTransport(layout, hub)
    from pdserve.transfer.torch_dist import TorchDistTransport
    from pdserve.transfer.zmq_transport import ShmTransport, TcpTransport

    if backend == "torch.distributed":
        return TorchDistTransport(layout)
    return ShmTransport(layout, verify=True) if backend == "shm" else TcpTransport(layout)


@pytest.fixture
def pair(tiny_weights):
    """A prefill and a decode engine over one backend; closed (sockets, shm buffers) afterwards."""
    made = []

    def make(backend: str = "inproc", p_opts: dict | None = None, d_opts: dict | None = None):
        hub = InprocHub()
        p_opts, d_opts = p_opts or {}, d_opts or {}
        p = make_engine(tiny_weights, "prefill", make_transport(backend, hub, _layout(p_opts)), **p_opts)
        d = make_engine(tiny_weights, "decode", make_transport(backend, hub, _layout(d_opts)), **d_opts)
        made.extend([p, d])
        return p, d

    yield make
    for e in made:
        e.close()


def _layout(opts: dict) -> KVLayout:
    """The layout of a test engine built with `opts` (its transport must have the same)."""
    return KVLayout.for_model(TINY, 4, opts.get("kv_cache_dtype", "auto"), torch.float32)


def colocated(weights, prompts, params=GREEDY, **sched) -> list[list[int]]:
    e = make_engine(weights, "both", **sched)
    for i, p in enumerate(prompts):
        e.add_request(p, params, req_id=str(i))
    done = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def assert_no_leaks(*engines: LLMEngine) -> None:
    for e in engines:
        assert not e.has_unfinished_requests()
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
        e.block_manager.check_invariants([])
        assert e.connector is not None and e.connector.num_active == 0


@pytest.fixture(scope="module")
def prompts():
    ps = random_prompts(8, 3, 70, seed=11)
    return ps + [ps[0] + [5, 6, 7, 8, 9]]  # shares ps[0]'s blocks: a prefix-cache hit on both sides


@pytest.mark.parametrize("backend", ["inproc", "shm", "tcp", "torch.distributed"])
def test_disaggregated_equals_colocated(pair, tiny_weights, prompts, backend):
    p, d = pair(backend)
    outs = generate_disaggregated(p, d, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, prompts)
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
    assert_no_leaks(p, d)
    sent = sum(r.num_bytes for r in p.connector.take_records() if r.ok)  # type: ignore[union-attr]
    assert sent == d.connector.num_bytes_received > 0  # type: ignore[union-attr]


def test_chunked_prefill_sends_chunk_by_chunk(pair, tiny_weights, prompts):
    """Prompts spread over several steps on the prefill side still arrive whole."""
    p, d = pair(p_opts=dict(policy="chunked", max_num_batched_tokens=16, chunk_size=7))
    outs = generate_disaggregated(p, d, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, prompts)
    assert_no_leaks(p, d)


def test_decode_side_prefix_hits_are_not_sent(pair, prompts):
    p, d = pair()
    generate_disaggregated(p, d, prompts[:1], GREEDY)
    p.connector.take_records()  # type: ignore[union-attr]
    # Same prompt again: the decode side has all its full blocks; only the tail is sent.
    generate_disaggregated(p, d, prompts[:1], GREEDY)
    (record,) = p.connector.take_records()  # type: ignore[union-attr]
    n = len(prompts[0])
    assert record.ok and record.num_tokens == n - (n - 1) // 4 * 4
    assert record.num_bytes == record.num_tokens * LAYOUT.bytes_per_token


def test_penalties_count_the_first_token_made_on_the_prefill_side(pair, tiny_weights, prompts):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3)
    p, d = pair()
    outs = generate_disaggregated(p, d, prompts, params)
    want = colocated(tiny_weights, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want != colocated(tiny_weights, prompts)
    assert_no_leaks(p, d)


def test_first_token_logprobs_and_seeded_sampling_match(pair, tiny_weights, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    p, d = pair()
    outs = generate_disaggregated(p, d, prompts[:4], params)
    ref = make_engine(tiny_weights, "both")
    for i, prompt in enumerate(prompts[:4]):
        ref.add_request(prompt, params, req_id=str(i))
    want = {}
    while ref.has_unfinished_requests():
        for o in ref.step():
            if o.finished:
                want[o.request_id] = o.outputs[0]
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == want[str(i)].token_ids
        assert o.outputs[0].logprobs is not None and len(o.outputs[0].logprobs) == 10
        assert o.outputs[0].logprobs[0] == pytest.approx(want[str(i)].logprobs[0])


def test_first_token_that_stops_finishes_on_the_decode_side(pair, tiny_weights, prompts):
    params = SamplingParams(temperature=0, max_tokens=1)
    p, d = pair()
    outs = generate_disaggregated(p, d, prompts[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, prompts[:3], params)
    assert_no_leaks(p, d)


def _start(p: LLMEngine, d: LLMEngine, prompt: list[int], tid: str = "t0") -> None:
    d.add_request(prompt, GREEDY, req_id="d0", kv_transfer=RemotePrefill(tid))
    d.step()
    ((rid, skip),) = d.take_kv_reservations()
    assert rid == "d0"
    p.add_request(prompt, GREEDY, req_id="p0", kv_transfer=RemoteDecode(tid, d.connector.address, skip))  # type: ignore[union-attr]


def _run(*engines: LLMEngine, steps: int = 50) -> list:
    outs = []
    for _ in range(steps):
        for e in engines:
            outs += [o for o in e.step() if o.finished]
    return outs


def test_decode_abort_mid_transfer_fails_the_prefill_and_frees_both(pair, prompts):
    p, d = pair(p_opts=dict(policy="chunked", max_num_batched_tokens=8))
    _start(p, d, prompts[0])
    p.step()  # the first chunk's KV is on its way
    assert p.connector.state("p0") is TransferState.TRANSFERRING  # type: ignore[union-attr]
    d.abort_request("d0")
    outs = _run(p, d)
    (out,) = [o for o in outs if o.request_id == "p0"]
    assert out.outputs[0].finish_reason == "error" and "transfer" in (out.error or "")
    assert_no_leaks(p, d)


def test_prefill_abort_expires_the_reservation(pair, prompts):
    clock = [0.0]
    p, d = pair(d_opts=dict(lease_s=5.0))
    d.connector.clock = lambda: clock[0]  # type: ignore[union-attr]
    _start(p, d, prompts[1])
    p.abort_request("p0")
    assert _run(p, d, steps=3) == []  # the decode side still waits: nothing said the prefill died
    assert d.scheduler.requests["d0"].status is RequestStatus.WAITING_FOR_KV
    clock[0] = 6.0
    (out,) = _run(p, d, steps=2)
    assert out.request_id == "d0" and out.outputs[0].finish_reason == "error" and "timed out" in (out.error or "")
    assert_no_leaks(p, d)


def test_missing_ack_times_out_on_the_prefill_side(pair, prompts):
    clock = [0.0]
    p, d = pair(p_opts=dict(ack_timeout_s=2.0))
    p.connector.clock = lambda: clock[0]  # type: ignore[union-attr]
    _start(p, d, prompts[2])
    p.step()  # whole prompt + first token: now waiting for the ack, which never comes (decode never polls)
    assert p.scheduler.requests["p0"].status is RequestStatus.SENDING_KV
    assert p.block_manager.num_free_blocks < p.block_manager.num_blocks  # blocks held while sending
    clock[0] = 3.0
    (out,) = _run(p, steps=1)
    assert out.outputs[0].finish_reason == "error" and "timed out" in (out.error or "")
    d.abort_request("d0")
    assert_no_leaks(p, d)


def test_incomplete_kv_is_never_served(pair, prompts):
    """A lost chunk: the decode side fails the request instead of decoding from partial KV."""
    p, d = pair()
    transport = p.connector.transport  # type: ignore[union-attr]
    real = transport.send_chunk
    transport.send_chunk = lambda tid, layer, start, kv: None if layer == 1 else real(tid, layer, start, kv)
    _start(p, d, prompts[3])
    outs = {o.request_id: o for o in _run(p, d)}
    assert outs["d0"].outputs[0].finish_reason == "error" and "incomplete" in (outs["d0"].error or "")
    assert outs["d0"].outputs[0].token_ids == []
    assert outs["p0"].outputs[0].finish_reason == "error"
    assert_no_leaks(p, d)


def test_roles_refuse_the_other_side(pair, prompts):
    p, d = pair()
    with pytest.raises(InvalidRequestError, match="decode instance"):
        d.add_request(prompts[0], GREEDY, kv_transfer=RemoteDecode("x", p.connector.address))  # type: ignore[union-attr]
    with pytest.raises(InvalidRequestError, match="prefill instance"):
        p.add_request(prompts[0], GREEDY, kv_transfer=RemotePrefill("x"))
    with pytest.raises(InvalidRequestError, match="cannot send"):
        p.add_request(prompts[0], GREEDY, kv_transfer=RemoteDecode("x", "inproc://nobody"))
    assert_no_leaks(p, d)


def test_reservation_waits_for_blocks(tiny_weights, prompts):
    """A decode instance with too few free blocks reserves later instead of failing."""
    hub = InprocHub()
    p = make_engine(tiny_weights, "prefill", InprocTransport(LAYOUT, hub))
    cfg_blocks = 30  # 120 tokens: room for about two of these prompts at a time
    d = LLMEngine(
        EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(num_blocks=cfg_blocks, block_size=4),
                     kv_transfer=KVTransferConfig(role="decode", backend="inproc")),
        model_config=TINY, weights=tiny_weights, kv_transport=InprocTransport(LAYOUT, hub),
    )
    long = [pr for pr in prompts if len(pr) > 40][:4]
    outs = generate_disaggregated(p, d, long, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, long)
    assert_no_leaks(p, d)


def test_a_failed_step_still_reports_finished_transfers(pair, prompts):
    """A transfer acknowledged just before a step that fails must still finish its request (else its
    client would wait forever)."""
    p, d = pair()
    _start(p, d, prompts[4])
    p.step()  # prompt and first token sent
    d.step()  # received and acknowledged
    p.add_request(prompts[5], GREEDY, req_id="other")  # so that the next step runs the model

    def boom(*_):
        raise RuntimeError("simulated kernel failure")

    p.runner.execute = boom  # type: ignore[method-assign]
    outs = {o.request_id: o for o in p.step()}
    assert outs["p0"].finished and outs["p0"].outputs[0].finish_reason == "length"
    assert outs["other"].outputs[0].finish_reason == "error"
    _run(d)
    assert_no_leaks(p, d)


@pytest.mark.parametrize("backend", ["inproc", "shm", "tcp"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_moves_in_its_stored_dtype(pair, tiny_weights, prompts, backend, kv_dtype):
    """KV travels as stored (values and their scales, bit for bit): disaggregated output equals colocated
    output with the same quantized cache, and each token costs the quantized layout's bytes."""
    opts = {"kv_cache_dtype": kv_dtype}
    p, d = pair(backend, opts, opts)
    outs = generate_disaggregated(p, d, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, prompts, kv_cache_dtype=kv_dtype)
    assert_no_leaks(p, d)
    records = [r for r in p.connector.take_records() if r.ok]  # type: ignore[union-attr]
    layout = _layout(opts)
    assert all(r.num_bytes == r.num_tokens * layout.bytes_per_token for r in records)
    assert layout.bytes_per_token * 64 == LAYOUT.bytes_per_token * 20  # rows of 16 + 4 bytes, not 16 x 4


# (int4, tiny model: blocks of 4 tokens) 12 tokens end exactly on a block boundary, 13 one past it.
BOUNDARY_PROMPTS = [list(range(1, 13)), list(range(1, 14))]


@pytest.mark.parametrize("backend,chunked", [
    ("inproc", False), ("inproc", True), ("shm", False), ("tcp", True), ("torch.distributed", False),
])
def test_int4_kv_moves_as_stored(pair, tiny_weights, prompts, backend, chunked):
    """int4 travels as the prefill side stores it (whole blocks sealed, the open last block's rows
    unquantized), so the decode side holds the same cache state: disaggregated greedy output equals a
    colocated int4 engine's, for prompts that end on a block boundary and inside a block, with prefix
    hits on the decode side and (chunked) a prompt computed over several steps whose chunks end inside
    blocks; the bytes are exactly sealed blocks plus the open block's rows."""
    opts = {"kv_cache_dtype": "int4"}
    p_opts = {**opts, **(dict(policy="chunked", max_num_batched_tokens=16, chunk_size=7) if chunked else {})}
    p, d = pair(backend, p_opts, opts)
    ps = prompts + BOUNDARY_PROMPTS
    outs = generate_disaggregated(p, d, ps, GREEDY)
    assert all(o.error is None for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, ps, kv_cache_dtype="int4")
    assert_no_leaks(p, d)
    layout = _layout(opts)
    records = {r.req_id: r for r in p.connector.take_records() if r.ok}  # type: ignore[union-attr]
    assert len(records) == len(ps)
    row = 2 * TINY.num_layers * TINY.num_kv_heads  # payload rows per chunk: K/V x kv heads, every layer
    assert all(r.num_bytes == row * layout.chunk_len(r.num_tokens) for r in records.values())
    whole, partial = records[f"p{len(prompts)}"], records[f"p{len(prompts) + 1}"]
    assert (whole.num_tokens, whole.num_bytes) == (12, 3 * layout.block_bytes)  # sealed blocks only
    assert partial.num_bytes == whole.num_bytes + row * TINY.head_dim * 4  # + the open token's float32 rows


def test_int4_moves_fewer_bytes_than_int8_and_unquantized(pair, tiny_weights):
    """The same prompts cost fewer bytes as int4 than int8, and int8 fewer than unquantized (prompts of
    whole blocks: an open block's rows travel unquantized, 64 bytes a row at this head_dim in float32)."""
    ps = [list(range(1, 13)), list(range(3, 35))]
    sent = {}
    for kv_dtype in ("int4", "int8", "auto"):
        p, d = pair("inproc", {"kv_cache_dtype": kv_dtype}, {"kv_cache_dtype": kv_dtype})
        generate_disaggregated(p, d, ps, GREEDY)
        sent[kv_dtype] = sum(r.num_bytes for r in p.connector.take_records() if r.ok)  # type: ignore[union-attr]
    assert 0 < sent["int4"] < sent["int8"] < sent["auto"], sent


@pytest.mark.parametrize("other", ["int8", "auto"])
@pytest.mark.parametrize("backend", ["inproc", "shm", "tcp"])
def test_int4_refuses_to_pair_with_another_layout(pair, prompts, backend, other):
    """An int4 prefill instance and an int8 or unquantized decode instance refuse each other with the
    typed layout error: at open (inproc names both layouts; shm finds the receiver's buffer of another
    size) or, over tcp, at the first chunk, before anything reaches the decode side's cache."""
    p, d = pair(backend, {"kv_cache_dtype": "int4"}, {"kv_cache_dtype": other})
    if backend == "tcp":
        before = d.kv_cache.data.clone()
        outs = generate_disaggregated(p, d, prompts[:2], GREEDY)
        assert all("KV layout mismatch" in (o.error or "") for o in outs)
        assert torch.equal(d.kv_cache.data.view(torch.uint8), before.view(torch.uint8))
    else:
        d.add_request(prompts[0], GREEDY, req_id="d0", kv_transfer=RemotePrefill("t0"))
        d.step()
        ((rid, skip),) = d.take_kv_reservations()
        with pytest.raises(InvalidRequestError, match="KV layout mismatch.*int4"):
            p.add_request(prompts[0], GREEDY, kv_transfer=RemoteDecode("t0", d.connector.address, skip))  # type: ignore[union-attr]
        d.abort_request(rid)
        d.step()
    assert_no_leaks(p, d)


def test_inproc_refuses_to_pair_different_layouts(pair, prompts):
    """A prefill instance with an int8 cache cannot send to a decode instance with a float32 one: the
    send is refused at open with a typed error, and nothing is held on either side."""
    p, d = pair(p_opts={"kv_cache_dtype": "int8"})
    d.add_request(prompts[0], GREEDY, req_id="d0", kv_transfer=RemotePrefill("t0"))
    d.step()
    ((rid, skip),) = d.take_kv_reservations()
    with pytest.raises(InvalidRequestError, match="mismatch: the sender's cache is int8-asym/.*float32/"):
        p.add_request(prompts[0], GREEDY, kv_transfer=RemoteDecode("t0", d.connector.address, skip))  # type: ignore[union-attr]
    d.abort_request(rid)
    d.step()
    assert_no_leaks(p, d)


@pytest.mark.parametrize("backend", ["shm", "tcp", "torch.distributed"])
def test_receiver_refuses_chunks_of_another_layout(pair, prompts, backend):
    """Over a socket the layout travels in every chunk header: a decode instance refuses the first chunk
    of another layout before it touches its cache, and the request fails cleanly on both sides. (int8
    and fp8 payloads have the same shape and dtype: only the layout key tells them apart.)"""
    p, d = pair(backend, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8_e4m3"})
    before = d.kv_cache.data.clone()
    outs = generate_disaggregated(p, d, prompts[:2], GREEDY)
    assert all(o.error is not None for o in outs)
    assert any("KV layout mismatch" in (o.error or "") for o in outs)
    assert torch.equal(d.kv_cache.data.view(torch.uint8), before.view(torch.uint8))
    assert_no_leaks(p, d)


def test_connector_refuses_a_transport_of_another_layout(tiny_weights):
    with pytest.raises(ValueError, match="not the cache's"):
        make_engine(tiny_weights, "decode", InprocTransport(LAYOUT, InprocHub()), kv_cache_dtype="int8")


def test_shm_sender_refuses_a_buffer_of_another_layout(pair, prompts):
    """shm: the decode side sizes each transfer's buffer for its own layout; a sender whose layout needs
    other sizes refuses it at open (int8 rows of 16 + 4 bytes against float32 rows of 64)."""
    p, d = pair("shm", {"kv_cache_dtype": "int8"}, {})
    d.add_request(prompts[0], GREEDY, req_id="d0", kv_transfer=RemotePrefill("t0"))
    d.step()
    ((rid, skip),) = d.take_kv_reservations()
    with pytest.raises(InvalidRequestError, match="KV layout mismatch: the receiver's buffer"):
        p.add_request(prompts[0], GREEDY, kv_transfer=RemoteDecode("t0", d.connector.address, skip))  # type: ignore[union-attr]
    d.abort_request(rid)
    d.step()
    assert_no_leaks(p, d)
