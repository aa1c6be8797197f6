"""`torch.distributed`: KV by point-to-point send/recv of torch.distributed, gloo on CPU and NCCL on
CUDA (the same code; the group type follows the device).

Headers and acks travel over ZMQ exactly as for `tcp` (see zmq_transport.py); only the chunks' data
goes through the process group. Each (sender, receiver) pair gets its own two-rank group, made on first
contact: the sender hosts a TCPStore, says `hello` with its address, and both sides build the group in
a background thread (building blocks until the other side joins), so neither engine loop waits on it.
Chunks sent before the group is up wait in order; the receiver posts a receive per chunk header and
hands chunks out, in arrival order, as their receives complete. Point-to-point works only report
completion from `wait()`, so one waiter thread per group waits on them in order (the engine loop never
blocks) and keeps each sent tensor alive until its send is done.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist
import zmq

from pdserve.transfer.base import KVChunk, KVDone, KVFailed, KVLayout, TransferError
from pdserve.transfer.wire import ChunkHeader, DoneHeader, HelloHeader
from pdserve.transfer.zmq_transport import _encode, _In, _Out, _ZmqTransport

_CONNECT_TIMEOUT = datetime.timedelta(seconds=10)


@dataclass(slots=True)
class _Group:
    """A two-rank process group with one peer (rank 0: the sender)."""

    pg: object | None = None
    error: str | None = None
    thread: threading.Thread | None = None
    next_tag: int = 0
    pending: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (kv, tag) sent before the group is up
    transfers: set[str] = field(default_factory=set)
    # (work, its tensor, called with None or an error once it is done); None stops the waiter
    works: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def watch(self, work: object, tensor: torch.Tensor, on_done: Callable[[str | None], None]) -> None:
        self.works.put((work, tensor, on_done))

    def _wait_loop(self) -> None:
        while (item := self.works.get()) is not None:
            work, _tensor, on_done = item
            try:
                work.wait()  # type: ignore[attr-defined]
                on_done(None)
            except Exception as e:  # noqa: BLE001 - a timed-out or broken p2p op fails its transfer
                on_done(f"torch.distributed transfer failed: {e}")

    def build(self, store: dist.Store | tuple[str, int], rank: int, device: torch.device) -> None:
        """Join the group in a thread. `store`: the one we host (rank 0), or the (host, port) of the
        peer's (rank 1: connecting to it waits for the peer, so it is done in the thread too)."""

        def run() -> None:
            nonlocal store
            try:
                if isinstance(store, tuple):
                    store = dist.TCPStore(store[0], store[1], 2, False, timeout=_CONNECT_TIMEOUT)
                prefixed = dist.PrefixStore("pdserve-kv/", store)
                if device.type == "cuda":
                    from torch._C._distributed_c10d import ProcessGroupNCCL

                    self.pg = ProcessGroupNCCL(prefixed, rank, 2)
                else:
                    from torch._C._distributed_c10d import ProcessGroupGloo

                    self.pg = ProcessGroupGloo(prefixed, rank, 2, _CONNECT_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - any failure to connect fails this peer's transfers
                self.error = f"torch.distributed group with the peer failed: {e}"
                return
            self._wait_loop()

        self.thread = threading.Thread(target=run, name="pdserve-kv-group", daemon=True)
        self.thread.start()

    @property
    def ready(self) -> bool:
        return self.pg is not None


@dataclass(slots=True)
class _Arrival:
    """A chunk header (or done) waiting, in order, for its data."""

    identity: bytes
    event: KVChunk | KVDone | KVFailed
    tag: int | None = None
    posted: bool = False
    result: str | None = None  # "" once its data is in, else the error


class TorchDistTransport(_ZmqTransport):
    name = "torch.distributed"
    _drop_failed_peers = False  # its process group is bound to the peer socket's identity

    def __init__(
        self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(layout, f"tcp://{host}:{port or '*'}", verify=False)
        self.host = host
        self.device = torch.device(device)
        self._out_groups: dict[str, _Group] = {}  # by receiver address
        self._in_groups: dict[bytes, _Group] = {}  # by sender identity
        self._stores: list[dist.Store] = []  # the stores we host, kept alive
        self._arrivals: deque[_Arrival] = deque()

    # ---- prefill side --------------------------------------------------------------------------
    def open_send(self, transfer_id: str, dest: str, start: int, end: int) -> None:
        super().open_send(transfer_id, dest, start, end)
        group = self._out_groups.get(dest)
        if group is None or group.error is not None:
            store = dist.TCPStore(self.host, 0, 2, True, timeout=_CONNECT_TIMEOUT, wait_for_workers=False)
            self._stores.append(store)
            group = self._out_groups[dest] = _Group()
            try:
                self._peers[dest].socket.send_multipart(
                    [_encode(self._signed(HelloHeader("", self.host, store.port)))], flags=zmq.NOBLOCK
                )
            except zmq.ZMQError as e:
                raise TransferError(f"cannot reach KV receiver {dest!r}: {e}") from None
            group.build(store, 0, self.device)
        group.transfers.add(transfer_id)

    def _chunk_data(self, out: _Out, layer: int, start: int, kv: torch.Tensor) -> tuple[tuple, list[memoryview]]:
        """The data goes by the group (tagged); the header carries no CRC, only the tag."""
        group = self._out_groups[out.dest]
        tag = group.next_tag
        group.next_tag += 1
        group.pending.append((kv.contiguous(), tag))
        self._flush(group)
        return (None, tag), []

    def _flush(self, group: _Group) -> None:
        if group.pg is None:
            return
        try:
            for kv, tag in group.pending:
                group.watch(group.pg.send([kv], 1, tag), kv, _ignore)  # type: ignore[attr-defined]
        except RuntimeError as e:  # the peer's side of the group is gone: fail everything sent to it
            group.error = f"torch.distributed send failed: {e}"
        group.pending.clear()

    def poll_acks(self) -> list:
        for dest, group in self._out_groups.items():
            if group.error is not None:
                for transfer_id in list(group.transfers):
                    if transfer_id in self._out:
                        self._fail_send(transfer_id, group.error)
                group.transfers.clear()
                group.pending.clear()  # chunks that waited for a group that never came up
            else:
                self._flush(group)
        return super().poll_acks()

    def close_send(self, transfer_id: str) -> None:
        out = self._out.get(transfer_id)
        if out is not None:
            self._out_groups[out.dest].transfers.discard(transfer_id)
        super().close_send(transfer_id)

    # ---- decode side ---------------------------------------------------------------------------
    def poll_received(self) -> list[KVChunk | KVDone | KVFailed]:
        for identity, header, _ in self._messages():
            if not self._authentic(header):  # the data comes by the group: the MACs cover headers
                continue
            if isinstance(header, HelloHeader):
                old = self._in_groups.get(identity)
                if old is not None:  # a sender says hello once; a second one replaces its group
                    old.works.put(None)
                group = self._in_groups[identity] = _Group()
                group.build((header.host, header.port), 1, self.device)
                continue
            rec = self._accept(identity, header.transfer_id)
            if rec is None:
                continue
            if isinstance(header, DoneHeader):
                done = KVDone(header.transfer_id, header.first_token, header.logprobs)
                self._arrivals.append(_Arrival(identity, done))
            elif header.tag is None:
                failed = KVFailed(header.transfer_id, "a torch.distributed chunk header without its tag")
                self._arrivals.append(_Arrival(identity, failed))
            else:
                slot = self._chunk_event(rec, replace_crc(header), [])  # empty until received
                self._arrivals.append(_Arrival(identity, slot, header.tag))
        return self._ready_arrivals()

    def _mac_data(self, kv: torch.Tensor) -> bytes:
        return b""  # the data goes by the group, whose peer an authenticated hello named

    def _chunk_tensor(self, rec: _In, layer: int, start: int, n: int, payload: list[zmq.Frame]) -> torch.Tensor:
        """Where the chunk's receive will write (posted once the group is up)."""
        lay = self.layout
        return torch.empty(lay.chunk_shape(n), dtype=lay.chunk_dtype, device=self.device)

    def _ready_arrivals(self) -> list[KVChunk | KVDone | KVFailed]:
        """Post receives where the group is up, then hand out the arrivals whose data is in, in order."""
        events: list[KVChunk | KVDone | KVFailed] = []
        for a in self._arrivals:
            if a.tag is not None and not a.posted and isinstance(a.event, KVChunk):
                group = self._in_groups.get(a.identity)
                if group is not None and group.pg is not None:
                    a.posted = True
                    kv = a.event.kv
                    group.watch(group.pg.recv([kv], 0, a.tag), kv, _setter(a))  # type: ignore[attr-defined]
        while self._arrivals:
            a = self._arrivals[0]
            if isinstance(a.event, KVChunk) and a.tag is not None:
                group = self._in_groups.get(a.identity)
                error = group.error if group is not None else "no group with the sender"
                if a.result:
                    error = a.result
                if error is not None:
                    a.event = KVFailed(a.event.transfer_id, error)
                elif a.result is None:
                    break
            events.append(self._arrivals.popleft().event)
        return events

    def close(self) -> None:
        self._arrivals.clear()
        for group in [*self._out_groups.values(), *self._in_groups.values()]:
            group.works.put(None)
        super().close()


def replace_crc(header: ChunkHeader) -> ChunkHeader:
    """The data comes by the group, unchecksummed: a CRC in the header has nothing to check."""
    return msgspec.structs.replace(header, crc=None)


def _ignore(error: str | None) -> None:
    pass


def _setter(a: _Arrival) -> Callable[[str | None], None]:
    def done(error: str | None) -> None:
        a.result = error or ""

    return done
