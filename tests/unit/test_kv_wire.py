"""Whatever arrives on a KV transport's sockets is decoded into a typed header first: a malformed
message is dropped and counted, never raised into the engine loop, and real transfers go on."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from pdserve.transfer.base import KVChunk, KVDone, KVLayout
from pdserve.transfer.wire import DroppedMessages
from pdserve.transfer.zmq_transport import ShmTransport, TcpTransport

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
pack = msgspec.msgpack.encode

# Each is one multipart message; none may raise out of poll_received().
GARBAGE = [
    [pack(["chunk", []])],  # the probe that killed a decode instance's engine core
    [b"chunk", b"[]"],
    [b"\xc1"],  # not msgpack
    [pack(["chunk", "t1", "zero", 0, 4, None])],
    [pack(["chunk", "t1", 0, 0, 2**63, None])],
    [pack(["chunk", "t1", -1, 0, 4, None])],
    [pack(["chunk", "../../etc/passwd", 0, 0, 4, None])],
    [pack(["done", "t1", 2**64 - 1, None])],
    [pack(["done", "t1", 3, {"x": "y"}])],
    [pack(["done", "t1", 3, {i: 0.0 for i in range(1000)}])],
    [pack(["hello", "", "", 0])],
    [pack(["nonsense", "t1"])],
    [pack({"kind": "chunk"})],
    [pack("chunk")],
    [b"[" * 5000],
]


def make(backend: str):
    if backend == "torch.distributed":
        from pdserve.transfer.torch_dist import TorchDistTransport

        return TorchDistTransport(LAYOUT)
    return ShmTransport(LAYOUT) if backend == "shm" else TcpTransport(LAYOUT)


def poll_until(fn, n: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += fn()
        time.sleep(0.002)
    return got


@pytest.mark.parametrize("backend", ["shm", "tcp", "torch.distributed"])
def test_garbage_on_the_receiver_socket_is_dropped_and_counted(backend):
    sender, receiver = make(backend), make(backend)
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    try:
        receiver.open_receive("t1", 0, 4)
        attacker.connect(receiver.address)
        for frames in GARBAGE:
            attacker.send_multipart(frames)
        assert poll_until(receiver.poll_received, 1, timeout=1.0) == []  # nothing, and nothing raised
        deadline = time.monotonic() + 5
        while receiver.dropped.count < len(GARBAGE) and time.monotonic() < deadline:
            assert receiver.poll_received() == []
            time.sleep(0.002)
        # The hello with an empty host is refused too: only a typed hello reaches the group code.
        assert receiver.dropped.count == len(GARBAGE)

        # The same transport still carries a real transfer bit-exactly.
        sender.open_send("t1", receiver.address, 0, 4)
        kv = torch.arange(2 * 2 * 4 * 4, dtype=torch.float32).view(2, 2, 4, 4)
        sender.send_chunk("t1", 0, 0, kv)
        sender.send_chunk("t1", 1, 0, kv + 1)
        sender.send_done("t1", 7, {7: -0.25})

        def received() -> list:
            sender.poll_acks()
            return receiver.poll_received()

        events = poll_until(received, 3)
        chunks = [e for e in events if isinstance(e, KVChunk)]
        assert sorted(c.layer for c in chunks) == [0, 1]
        for c in chunks:
            assert torch.equal(c.kv, kv + c.layer)
        (done,) = [e for e in events if isinstance(e, KVDone)]
        assert done.first_token == 7 and done.logprobs == {7: -0.25}
    finally:
        attacker.close()
        ctx.term()
        sender.close()
        receiver.close()


def test_garbage_acks_are_dropped_and_counted():
    sender = TcpTransport(LAYOUT)
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)  # a "receiver" that answers with garbage
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        sender.open_send("t1", f"tcp://127.0.0.1:{port}", 0, 4)
        sender.send_chunk("t1", 0, 0, torch.zeros(2, 2, 4, 4))
        assert fake.poll(5000)
        identity = fake.recv_multipart()[0]
        bad = [[b"\xc1"], [pack(["ack", 5, True, None])], [pack(["ack", "t1", "yes", None])],
               [pack(["ack", "t1", True, None]), b"extra"], [pack(["chunk", "t1", 0, 0, 4, None])]]
        for frames in bad:
            fake.send_multipart([identity, *frames])
        fake.send_multipart([identity, pack(["ack", "t1", False, "refused"])])  # a real one, last
        (ack,) = poll_until(sender.poll_acks, 1)
        assert ack.transfer_id == "t1" and not ack.ok and ack.error == "refused"
        assert sender.dropped.count == len(bad)
    finally:
        fake.close()
        ctx.term()
        sender.close()


def test_dropped_messages_log_is_rate_limited(caplog):
    now = [0.0]
    dropped = DroppedMessages("test socket", log_interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="pdserve.wire"):
        for _ in range(100):
            dropped.drop("bad")
        now[0] = 11.0
        dropped.drop("bad again")
    assert dropped.count == 101
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "99 more" in lines[1]


def _transfer(sender, receiver, tid: str = "t9") -> list:
    receiver.open_receive(tid, 0, 4)
    sender.open_send(tid, receiver.address, 0, 4)
    kv = torch.arange(2 * 2 * 4 * 4, dtype=torch.float32).view(2, 2, 4, 4)
    for layer in range(2):
        sender.send_chunk(tid, layer, 0, kv + layer)
    sender.send_done(tid, 5, None)

    def received() -> list:
        sender.poll_acks()
        return receiver.poll_received()

    return poll_until(received, 3, timeout=5.0)


@pytest.mark.parametrize("backend", ["shm", "tcp", "torch.distributed"])
def test_signed_transfers_pass_and_forgeries_are_dropped(backend):
    sender, receiver, stranger = make(backend), make(backend), make(backend)
    for t in (sender, receiver):
        t.authenticate_with(b"cluster secret")
    stranger.authenticate_with(b"another secret")
    ctx = zmq.Context()
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    try:
        events = _transfer(sender, receiver)
        assert sorted(type(e).__name__ for e in events) == ["KVChunk", "KVChunk", "KVDone"]
        receiver.ack("t9", True)
        (ack,) = poll_until(sender.poll_acks, 1)
        assert ack.ok

        # A well-formed first token for an open transfer, unsigned or signed with another secret: dropped.
        receiver.open_receive("t10", 0, 4)
        forger.connect(receiver.address)
        forger.send_multipart([pack(["done", "t10", 666, None])])
        forger.send_multipart([pack(["done", "t10", 666, None, b"\0" * 32])])
        before = receiver.dropped.count
        assert poll_until(receiver.poll_received, 1, timeout=1.0) == []
        assert receiver.dropped.count == before + 2
        if backend != "shm":  # (shm: the stranger cannot map a buffer that was never made for it)
            assert [e for e in _transfer(stranger, receiver, "t11") if isinstance(e, (KVChunk, KVDone))] == []
    finally:
        forger.close()
        ctx.term()
        for t in (sender, receiver, stranger):
            t.close()


def test_forged_acks_are_dropped():
    sender = TcpTransport(LAYOUT)
    sender.authenticate_with(b"cluster secret")
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        sender.open_send("t1", f"tcp://127.0.0.1:{port}", 0, 4)
        sender.send_chunk("t1", 0, 0, torch.zeros(2, 2, 4, 4))
        assert fake.poll(5000)
        identity = fake.recv_multipart()[0]
        fake.send_multipart([identity, pack(["ack", "t1", True, None])])  # "all arrived": a lie
        fake.send_multipart([identity, pack(["ack", "t1", True, None, b"\1" * 32])])
        deadline = time.monotonic() + 2
        while sender.dropped.count < 2 and time.monotonic() < deadline:
            assert sender.poll_acks() == []
            time.sleep(0.002)
        assert sender.dropped.count == 2
    finally:
        fake.close()
        ctx.term()
        sender.close()


def test_a_full_send_queue_fails_the_transfer_and_frees_the_peer():
    from pdserve.server.launcher import free_port

    sender = TcpTransport(LAYOUT)
    sender.max_queued_bytes = 10_000  # a chunk here is 256 bytes of data
    dest = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: ZMQ would queue for good
    try:
        sender.open_send("t1", dest, 0, 4)
        for _ in range(100):
            sender.send_chunk("t1", 0, 0, torch.zeros(2, 2, 4, 4))
        (ack,) = sender.poll_acks()
        assert ack.transfer_id == "t1" and not ack.ok and "queue" in ack.error
        assert dest not in sender._peers  # its socket, and what ZMQ queued in it, are gone
        sender.open_send("t2", dest, 0, 4)  # a later transfer to the same peer starts afresh
        sender.send_chunk("t2", 0, 0, torch.zeros(2, 2, 4, 4))
        assert sender.poll_acks() == []
    finally:
        sender.close()
