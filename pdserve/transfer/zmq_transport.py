"""`shm` (processes on one host) and `tcp` (across hosts): KV transfer over ZMQ.

Control path, shared by both: every transport binds one ROUTER socket at its `address`; a sender keeps
one DEALER per receiver it talks to. A message is a msgpack header (`chunk`, `done` or `ack`), plus for
`tcp` the chunk's bytes. The receiver acks over the same connection (the ROUTER answers the DEALER's
identity), so a sender never needs an address of its own. ZMQ's I/O thread does the sending: `send_*`
only queue, and the prefill forward goes on with the next layer while a chunk travels.

Data path:
- `tcp`: the chunk's bytes follow its header in the same message, with a CRC32 the receiver checks.
- `shm`: the receiver creates one buffer per transfer, a file in /dev/shm laid out
  `[num_layers, *KVLayout.chunk_shape(tokens)]` and mapped by both processes; the sender copies each
  chunk straight into it and sends only the header. Nothing is pickled; the only copies are cache ->
  buffer on the prefill side and buffer -> cache on the decode side. Buffers are named after the
  receiver (its pid), so one that a killed receiver left behind is removed by the next one to start.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import tempfile
import warnings
import zlib
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from pdserve.transfer.base import (
    KVAck, KVChunk, KVDone, KVFailed, KVLayout, KVLayoutMismatch, KVTransport, TransferError, layout_mismatch,
)
from pdserve.transfer.wire import AckHeader, ChunkHeader, DoneHeader, Header, HelloHeader, Signer, ToReceiver

_encode = msgspec.msgpack.Encoder().encode
_MAX_ERROR = 4096  # characters of an ack's error text (AckHeader's bound)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor of any dtype (bf16 has no numpy type: view it as bytes)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def bytes_tensor(buf: memoryview | bytes | mmap.mmap, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only frames: we only ever copy out of them
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


@dataclass(slots=True)
class _Out:
    dest: str
    start: int
    end: int
    buffer: torch.Tensor | None = None  # shm: the receiver's buffer, mapped here
    num_queued_bytes: int = 0  # handed to ZMQ for this transfer (it holds them until they are sent)
    acked_ok: bool = False


@dataclass(slots=True)
class _In:
    start: int
    end: int
    identity: bytes | None = None  # the sender's DEALER, once it has said something
    buffer: torch.Tensor | None = None  # shm
    path: str | None = None  # shm


@dataclass(slots=True)
class _Peer:
    socket: zmq.Socket
    transfers: set[str] = field(default_factory=set)
    num_queued_bytes: int = 0  # of its open transfers: what ZMQ may still hold for this peer


# Bytes of open transfers that one peer may have queued: ZMQ keeps what it could not send yet (a slow or
# unreachable peer), so past this a transfer fails instead of memory growing without bound.
MAX_QUEUED_BYTES = 2 * 2**30


class _ZmqTransport(KVTransport):
    # Close a peer's socket (dropping whatever ZMQ still queues for it) once its last open transfer ends
    # without a successful ack; the next transfer to it connects afresh.
    _drop_failed_peers = True

    def __init__(self, layout: KVLayout, bind: str, verify: bool, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        super().__init__(layout)
        self.verify = verify
        self.max_queued_bytes = max_queued_bytes
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.bind(bind)
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, _Peer] = {}
        self._out: dict[str, _Out] = {}
        self._in: dict[str, _In] = {}
        self._acks: list[KVAck] = []  # failures found locally, reported with the peers' acks
        self._receiver_decoder = msgspec.msgpack.Decoder(ToReceiver)
        self._ack_decoder = msgspec.msgpack.Decoder(AckHeader)
        self._signer: Signer | None = None

    def authenticate_with(self, secret: bytes) -> None:
        """Sign every message sent and drop every message received whose MAC does not verify under this
        cluster secret (see `wire.Signer`). Call before the first transfer."""
        self._signer = Signer(secret)

    def _signed(self, header: Header, data: memoryview | bytes = b"") -> Header:
        return header if self._signer is None else self._signer.sign(header, data)

    def _authentic(self, header: Header, data: memoryview | bytes = b"") -> bool:
        if self._signer is None or self._signer.verify(header, data):
            return True
        self.dropped.drop(f"a {type(header).__name__} for transfer {header.transfer_id!r} whose MAC does not verify")
        return False

    # ---- prefill side --------------------------------------------------------------------------
    def open_send(self, transfer_id: str, dest: str, start: int, end: int) -> None:
        if not 0 <= start < end:
            raise TransferError(f"bad token range [{start}, {end})")
        out = _Out(dest, start, end)
        self._open_send_data(out, transfer_id)
        peer = self._peers.get(dest)
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            try:
                sock.connect(dest)
            except zmq.ZMQError as e:
                sock.close()
                raise TransferError(f"cannot connect to KV receiver {dest!r}: {e}") from None
            peer = self._peers[dest] = _Peer(sock)
        peer.transfers.add(transfer_id)
        self._out[transfer_id] = out

    def send_chunk(self, transfer_id: str, layer: int, start: int, kv: torch.Tensor) -> None:
        out = self._out.get(transfer_id)
        if out is None:
            return  # failed or cancelled while the step ran
        extra, frames = self._chunk_data(out, layer, start, kv)
        num_tokens = self.layout.chunk_num_tokens(kv.shape[2], out.end - start)
        header = ChunkHeader(transfer_id, layer, start, num_tokens, *extra, layout=self.layout.key())
        if self._signer is not None:
            header = self._signed(header, self._mac_data(kv))
        self._send(out, transfer_id, [_encode(header), *frames])

    def send_done(self, transfer_id: str, first_token: int, logprobs: dict[int, float] | None) -> None:
        out = self._out.get(transfer_id)
        if out is not None:
            self._send(out, transfer_id, [_encode(self._signed(DoneHeader(transfer_id, first_token, logprobs)))])

    def _send(self, out: _Out, transfer_id: str, frames: list[bytes | memoryview]) -> None:
        peer = self._peers[out.dest]
        size = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        if peer.num_queued_bytes + size > self.max_queued_bytes:
            self._fail_send(
                transfer_id,
                f"the KV send queue to {out.dest} is full ({peer.num_queued_bytes} bytes of open transfers, "
                f"limit {self.max_queued_bytes}): the decode instance is too slow or unreachable",
            )
            return
        try:
            peer.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames) == 1)
        except zmq.ZMQError as e:
            self._fail_send(transfer_id, f"sending KV failed: {e}")
            return
        out.num_queued_bytes += size
        peer.num_queued_bytes += size

    def _fail_send(self, transfer_id: str, error: str) -> None:
        self._acks.append(KVAck(transfer_id, False, error))
        self.close_send(transfer_id)

    def poll_acks(self) -> list[KVAck]:
        acks, self._acks = self._acks, []
        for peer in self._peers.values():
            while True:
                try:
                    frames = peer.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    if len(frames) != 1:
                        raise msgspec.DecodeError(f"an ack is one frame, got {len(frames)}")
                    ack = self._ack_decoder.decode(frames[0])
                except msgspec.DecodeError as e:  # a peer's garbage is dropped, never raised into the loop
                    self.dropped.drop(e)
                    continue
                if ack.transfer_id in peer.transfers and self._authentic(ack):
                    acks.append(KVAck(ack.transfer_id, ack.ok, ack.error))
                    out = self._out.get(ack.transfer_id)
                    if out is not None:
                        out.acked_ok = ack.ok
        return acks

    def close_send(self, transfer_id: str) -> None:
        out = self._out.pop(transfer_id, None)
        if out is None:
            return
        peer = self._peers[out.dest]
        peer.transfers.discard(transfer_id)
        peer.num_queued_bytes -= out.num_queued_bytes
        if self._drop_failed_peers and not out.acked_ok and not peer.transfers:
            peer.socket.close(0)  # frees what ZMQ still queued for a peer that did not take it
            del self._peers[out.dest]

    # ---- decode side ---------------------------------------------------------------------------
    def open_receive(self, transfer_id: str, start: int, end: int) -> None:
        rec = _In(start, end)
        self._open_receive_data(rec, transfer_id)
        self._in[transfer_id] = rec

    def poll_received(self) -> list[KVChunk | KVDone | KVFailed]:
        events: list[KVChunk | KVDone | KVFailed] = []
        for identity, header, payload in self._messages():
            if isinstance(header, HelloHeader):
                self.dropped.drop("a torch.distributed hello sent to a transport without process groups")
                continue
            if not self._authentic(header, self._received_mac_data(header, payload)):
                continue  # verified before _accept: a forger must not become the transfer's ack address
            rec = self._accept(identity, header.transfer_id)
            if rec is None:
                continue
            if isinstance(header, DoneHeader):
                events.append(KVDone(header.transfer_id, header.first_token, header.logprobs))
            else:
                events.append(self._chunk_event(rec, header, payload))
        return events

    def _messages(self) -> Iterator[tuple[bytes, ToReceiver, list[zmq.Frame]]]:
        """(sender identity, decoded header, data frames) of every message waiting. One that does not
        decode is dropped and counted: a peer's garbage never reaches the engine loop."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                if len(frames) < 2:
                    raise msgspec.DecodeError("a message needs a header frame")
                header = self._receiver_decoder.decode(frames[1].buffer)
            except msgspec.DecodeError as e:
                self.dropped.drop(e)
                continue
            yield frames[0].bytes, header, frames[2:]

    def _accept(self, identity: bytes, transfer_id: str) -> _In | None:
        """The open transfer a message belongs to (remembering who sends it), or None after refusing it."""
        rec = self._in.get(transfer_id)
        if rec is None:
            self._reply(identity, transfer_id, False, "unknown or closed transfer")
            return None
        rec.identity = identity
        return rec

    def _chunk_event(self, rec: _In, header: ChunkHeader, payload: list[zmq.Frame]) -> KVChunk | KVFailed:
        transfer_id, layer, start, n, crc = (
            header.transfer_id, header.layer, header.start, header.num_tokens, header.crc
        )
        lay = self.layout
        mismatch = layout_mismatch(header.layout or "", lay.key())
        if mismatch is not None:  # before the data is touched: nothing of another layout reaches the cache
            return KVFailed(transfer_id, mismatch)
        if not (0 <= layer < lay.num_layers and rec.start <= start and start + n <= rec.end and n > 0):
            return KVFailed(transfer_id, f"chunk out of range: layer {layer}, tokens [{start}, {start + n})")
        try:
            kv = self._chunk_tensor(rec, layer, start, n, payload)
        except (ValueError, RuntimeError, IndexError) as e:
            return KVFailed(transfer_id, f"malformed chunk: {e}")
        if crc is not None and zlib.crc32(tensor_bytes(kv)) != crc:
            return KVFailed(transfer_id, f"checksum mismatch in layer {layer}, tokens [{start}, {start + n})")
        return KVChunk(transfer_id, layer, start, kv)

    def ack(self, transfer_id: str, ok: bool, error: str | None = None) -> None:
        rec = self._in.get(transfer_id)
        if rec is not None and rec.identity is not None:
            self._reply(rec.identity, transfer_id, ok, error)

    def _reply(self, identity: bytes, transfer_id: str, ok: bool, error: str | None) -> None:
        with contextlib.suppress(zmq.ZMQError):
            ack = self._signed(AckHeader(transfer_id, ok, None if error is None else error[:_MAX_ERROR]))
            self._router.send_multipart([identity, _encode(ack)], zmq.NOBLOCK)

    def close_receive(self, transfer_id: str) -> None:
        rec = self._in.pop(transfer_id, None)
        if rec is not None:
            self._close_receive_data(rec)

    def close(self) -> None:
        for transfer_id in list(self._in):
            self.close_receive(transfer_id)
        self._router.close(0)
        for peer in self._peers.values():
            peer.socket.close(0)
        self._ctx.term()

    # ---- data path (subclasses) ----------------------------------------------------------------
    def _open_send_data(self, out: _Out, transfer_id: str) -> None:
        pass

    def _mac_data(self, kv: torch.Tensor) -> memoryview | bytes:
        """The bytes a chunk's MAC covers besides its header: its K/V."""
        return tensor_bytes(kv)

    def _received_mac_data(self, header: Header, payload: list[zmq.Frame]) -> memoryview | bytes:
        """The bytes an arrived message's MAC covers besides its header (empty where none can be found:
        the MAC then fails, unless the message has no data)."""
        if not isinstance(header, ChunkHeader) or self._signer is None:
            return b""
        return self._arrived_data(header, payload)

    def _arrived_data(self, header: ChunkHeader, payload: list[zmq.Frame]) -> memoryview | bytes:
        return payload[0].buffer if len(payload) == 1 else b""

    @abstractmethod
    def _chunk_data(self, out: _Out, layer: int, start: int, kv: torch.Tensor) -> tuple[tuple, list[memoryview]]:
        """Put one chunk on its data path; returns (the header's last fields: its CRC32 or None first,
        the frames to send after the header)."""

    def _open_receive_data(self, rec: _In, transfer_id: str) -> None:
        pass

    @abstractmethod
    def _chunk_tensor(self, rec: _In, layer: int, start: int, n: int, payload: list[zmq.Frame]) -> torch.Tensor:
        """The K/V of an arrived chunk, `KVLayout.chunk_shape(n)`, from its data frames or buffer."""

    def _close_receive_data(self, rec: _In) -> None:
        pass


class TcpTransport(_ZmqTransport):
    """Chunks travel inline, framed and checksummed. `host` is the interface to listen on; the address
    peers use is `tcp://host:port` (give a routable host, not 0.0.0.0, for other machines)."""

    name = "tcp"

    def __init__(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, verify: bool = True) -> None:
        super().__init__(layout, f"tcp://{host}:{port or '*'}", verify=True)

    def _chunk_data(self, out: _Out, layer: int, start: int, kv: torch.Tensor) -> tuple[tuple, list[memoryview]]:
        data = tensor_bytes(kv)  # kv is the caller's fresh gather; ZMQ holds it until sent
        return (zlib.crc32(data),), [data]

    def _chunk_tensor(self, rec: _In, layer: int, start: int, n: int, payload: list[zmq.Frame]) -> torch.Tensor:
        lay = self.layout
        if len(payload) != 1:
            raise ValueError("a chunk needs exactly one data frame")
        return bytes_tensor(payload[0].buffer, lay.chunk_dtype, lay.chunk_shape(n))


_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_PREFIX = "pdserve-kv-"


class ShmTransport(_ZmqTransport):
    """Chunks go through a shared-memory buffer per transfer; ZMQ (ipc) carries only headers and acks."""

    name = "shm"

    def __init__(self, layout: KVLayout, verify: bool = False) -> None:
        _remove_stale_buffers()
        self._stem = f"{_SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        super().__init__(layout, f"ipc://{os.path.join(tempfile.gettempdir(), self._stem)}.sock", verify)

    def _buffer_path(self, address: str, transfer_id: str) -> str:
        stem = os.path.basename(address).removesuffix(".sock")
        if not stem.startswith(_SHM_PREFIX) or not re.fullmatch(r"[0-9A-Za-z_-]+", transfer_id):
            raise TransferError(f"not an shm KV receiver address or transfer id: {address!r}, {transfer_id!r}")
        return os.path.join(_SHM_DIR, f"{stem}-{transfer_id}")

    def _shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.layout.num_layers, *self.layout.chunk_shape(num_tokens))

    def _open_send_data(self, out: _Out, transfer_id: str) -> None:
        path = self._buffer_path(out.dest, transfer_id)
        try:
            out.buffer = _map(path, self._shape(out.end - out.start), self.layout.chunk_dtype, create=False)
        except _SizeMismatch as e:  # the receiver sized it for its own layout
            raise KVLayoutMismatch(
                f"KV layout mismatch: the receiver's buffer ({e}) does not fit this instance's {self.layout.key()}"
            ) from None
        except OSError as e:
            raise TransferError(f"the receiver's KV buffer is not there ({e})") from None

    def _chunk_data(self, out: _Out, layer: int, start: int, kv: torch.Tensor) -> tuple[tuple, list[memoryview]]:
        assert out.buffer is not None
        at = self.layout.chunk_len(start - out.start)  # (int4: chunks start at block boundaries)
        out.buffer[layer, :, :, at : at + kv.shape[2]].copy_(kv)
        return (zlib.crc32(tensor_bytes(kv)) if self.verify else None,), []

    def _open_receive_data(self, rec: _In, transfer_id: str) -> None:
        rec.path = self._buffer_path(self.address, transfer_id)
        rec.buffer = _map(rec.path, self._shape(rec.end - rec.start), self.layout.chunk_dtype, create=True)

    def _chunk_tensor(self, rec: _In, layer: int, start: int, n: int, payload: list[zmq.Frame]) -> torch.Tensor:
        assert rec.buffer is not None
        at, lay = self.layout.chunk_len(start - rec.start), self.layout
        return rec.buffer[layer, :, :, at : at + lay.chunk_len(n)]

    # The MACs cover headers only: the data sits in a file only this user can open (mode 0600), and
    # hashing every chunk twice would cost more than the copy the shared buffer saves.
    def _mac_data(self, kv: torch.Tensor) -> bytes:
        return b""

    def _arrived_data(self, header: ChunkHeader, payload: list[zmq.Frame]) -> bytes:
        return b""

    def _close_receive_data(self, rec: _In) -> None:
        rec.buffer = None
        if rec.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rec.path)

    def close(self) -> None:
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(tempfile.gettempdir(), f"{self._stem}.sock"))


class _SizeMismatch(OSError):
    """A receiver's shm buffer of another size than the sender's layout needs for the same tokens."""


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A tensor over a file mapped shared (the mapping outlives the file's name)."""
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise _SizeMismatch(f"{os.fstat(fd).st_size} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return bytes_tensor(mm, dtype, shape)


def _remove_stale_buffers() -> None:
    """Buffers and sockets of receivers whose process is gone (killed before it could clean up)."""
    for folder in {_SHM_DIR, tempfile.gettempdir()}:
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                m = re.match(rf"{_SHM_PREFIX}(\d+)-", name)
                if m and not _alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
