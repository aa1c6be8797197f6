"""Every KV transport moves chunks bit-exactly, refuses transfers nobody opened, and reports broken ones
as failures (not exceptions)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.transfer.base import KVChunk, KVDone, KVFailed, KVLayout, TransferError
from pdserve.transfer.inproc import InprocHub, InprocTransport
from pdserve.transfer.zmq_transport import ShmTransport, TcpTransport

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


@pytest.fixture(params=["inproc", "shm", "tcp", "torch.distributed"])
def ends(request):
    hub = InprocHub()

    def make():
        if request.param == "inproc":
            return InprocTransport(LAYOUT, hub)
        if request.param == "torch.distributed":
            from pdserve.transfer.torch_dist import TorchDistTransport

            return TorchDistTransport(LAYOUT)
        return ShmTransport(LAYOUT, verify=True) if request.param == "shm" else TcpTransport(LAYOUT)

    sender, receiver = make(), make()
    yield sender, receiver
    sender.close()
    receiver.close()


def poll_until(fn, n: int, timeout: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += fn()
        time.sleep(0.001)
    return got


def test_chunks_arrive_exactly_and_the_ack_returns(ends):
    sender, receiver = ends
    receiver.open_receive("t1", 4, 10)
    sender.open_send("t1", receiver.address, 4, 10)
    g = torch.Generator().manual_seed(0)
    sent = {(layer, start): torch.randn(2, 2, n, 8, generator=g).to(torch.bfloat16)
            for layer in range(3) for start, n in ((4, 4), (8, 2))}
    for (layer, start), kv in sent.items():
        sender.send_chunk("t1", layer, start, kv)
    sender.send_done("t1", 42, {42: -0.5, 7: -1.5})

    def received() -> list:
        sender.poll_acks()  # lets a sender whose channel was still opening flush what waits
        return receiver.poll_received()

    events = poll_until(received, len(sent) + 1)
    chunks = [e for e in events if isinstance(e, KVChunk)]
    assert len(chunks) == len(sent)
    for c in chunks:
        assert torch.equal(c.kv, sent[(c.layer, c.start)])
    (done,) = [e for e in events if isinstance(e, KVDone)]
    assert done.first_token == 42 and done.logprobs == {42: -0.5, 7: -1.5}
    receiver.ack("t1", True)
    (ack,) = poll_until(sender.poll_acks, 1)
    assert ack.transfer_id == "t1" and ack.ok
    receiver.close_receive("t1")
    sender.close_send("t1")


def test_a_transfer_nobody_opened_is_refused(ends):
    sender, receiver = ends
    receiver.open_receive("other", 0, 4)
    if isinstance(sender, ShmTransport):  # the buffer is named after the transfer: it is not there
        with pytest.raises(TransferError):
            sender.open_send("t2", receiver.address, 0, 4)
        return
    sender.open_send("t2", receiver.address, 0, 4)
    sender.send_chunk("t2", 0, 0, torch.zeros(2, 2, 4, 8, dtype=torch.bfloat16))
    def acks() -> list:
        receiver.poll_received()  # refuses the chunk
        return sender.poll_acks()

    (ack,) = poll_until(acks, 1)
    assert ack.transfer_id == "t2" and not ack.ok and "unknown" in (ack.error or "")


def test_tcp_checksum_mismatch_fails_the_transfer():
    sender, receiver = TcpTransport(LAYOUT), TcpTransport(LAYOUT)
    try:
        receiver.open_receive("t3", 0, 4)
        sender.open_send("t3", receiver.address, 0, 4)
        real = sender._chunk_data

        def corrupt(out, layer, start, kv):
            (crc,), frames = real(out, layer, start, kv)
            return (crc ^ 1,), frames

        sender._chunk_data = corrupt  # type: ignore[method-assign]
        sender.send_chunk("t3", 0, 0, torch.ones(2, 2, 4, 8, dtype=torch.bfloat16))
        (event,) = poll_until(receiver.poll_received, 1)
        assert isinstance(event, KVFailed) and "checksum" in event.error
    finally:
        sender.close()
        receiver.close()


def test_out_of_range_chunk_is_refused():
    sender, receiver = TcpTransport(LAYOUT), TcpTransport(LAYOUT)
    try:
        receiver.open_receive("t4", 8, 12)
        sender.open_send("t4", receiver.address, 8, 12)
        sender.send_chunk("t4", 0, 4, torch.ones(2, 2, 4, 8, dtype=torch.bfloat16))  # before the range
        (event,) = poll_until(receiver.poll_received, 1)
        assert isinstance(event, KVFailed) and "out of range" in event.error
    finally:
        sender.close()
        receiver.close()


def test_shm_buffers_are_removed(tmp_path):
    import os

    receiver = ShmTransport(LAYOUT)
    receiver.open_receive("t5", 0, 16)
    path = receiver._in["t5"].path
    assert path is not None and os.path.exists(path)
    receiver.close_receive("t5")
    assert not os.path.exists(path)
    receiver.close()
