"""The KV transports' control messages, as typed and bounded msgspec structs, and the counter of the
messages that fail to decode.

Anything that arrives on a socket is decoded into one of these structs before the transport looks at it:
a wrong frame count, a missing field, a field of the wrong type or out of its range is a `DecodeError`
(`msgspec.ValidationError` is one), and the message is dropped, counted and logged, never raised into the
engine loop. In a cluster with a secret, a message whose MAC does not verify is dropped the same way. On the wire each struct is a msgpack array whose first element is its tag (`["chunk", ...]`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Annotated

import msgspec

# Router transfer ids are uuid4 hex; the shm transport names files after them, so no path characters.
TransferId = Annotated[str, msgspec.Meta(pattern=r"^[0-9A-Za-z_-]{1,64}$")]
# Positions, layers, token ids and torch.distributed tags: what fits an int32 (and a C++ index).
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
_Error = Annotated[str, msgspec.Meta(max_length=4096)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]  # HMAC-SHA256
MAX_WIRE_LOGPROBS = 64  # entries of the first token's logprobs dict (the server allows 20 + the sampled one)


class ChunkHeader(msgspec.Struct, tag="chunk", array_like=True, frozen=True):
    """One layer's K/V for tokens [start, start + num_tokens): its data follows (tcp), sits in the shared
    buffer (shm) or arrives through the process group under `tag` (torch.distributed). `layout` names the
    sender's cache layout; a receiver with another refuses the chunk (the handshake of transfer/base.py)."""

    transfer_id: TransferId
    layer: Count
    start: Count
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    crc: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] | None = None
    tag: Count | None = None
    mac: Mac | None = None
    layout: Annotated[str, msgspec.Meta(max_length=128)] | None = None  # the sender's KVLayout.key()


class DoneHeader(msgspec.Struct, tag="done", array_like=True, frozen=True):
    transfer_id: TransferId
    first_token: Count
    logprobs: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_WIRE_LOGPROBS)] | None = None
    mac: Mac | None = None


class HelloHeader(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """torch.distributed: a sender asks the receiver to join a two-rank group at its TCPStore."""

    transfer_id: Annotated[str, msgspec.Meta(max_length=64)]
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    mac: Mac | None = None


class AckHeader(msgspec.Struct, tag="ack", array_like=True, frozen=True):
    transfer_id: TransferId
    ok: bool
    error: _Error | None = None
    mac: Mac | None = None


ToReceiver = ChunkHeader | DoneHeader | HelloHeader
ToSender = AckHeader
Header = ChunkHeader | DoneHeader | HelloHeader | AckHeader

_encode = msgspec.msgpack.Encoder().encode


class Signer:
    """MACs of a cluster's KV messages: HMAC-SHA256 under a key of its own for each transfer (derived from
    the cluster secret and the transfer id, which the router draws at random: the per-transfer nonce), over
    the header (its `mac` empty) and the chunk's data where it travels on the socket (`tcp`). Without the secret no one can write KV or a first
    token into a transfer, ack one, or make a receiver join a process group."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._keys: dict[str, bytes] = {}  # by transfer id: derived once per transfer, not per chunk

    def key(self, transfer_id: str) -> bytes:
        key = self._keys.get(transfer_id)
        if key is None:
            key = hmac.new(self._secret, b"pdserve-kv\0" + transfer_id.encode(), hashlib.sha256).digest()
            if len(self._keys) > 4096:  # bounded: keys of long-gone transfers are dropped
                self._keys.clear()
            self._keys[transfer_id] = key
        return key

    def mac(self, header: Header, data: memoryview | bytes = b"") -> bytes:
        h = hmac.new(self.key(header.transfer_id), _encode(msgspec.structs.replace(header, mac=None)), hashlib.sha256)
        if data:
            h.update(data)
        return h.digest()

    def sign(self, header: Header, data: memoryview | bytes = b"") -> Header:
        return msgspec.structs.replace(header, mac=self.mac(header, data))

    def verify(self, header: Header, data: memoryview | bytes = b"") -> bool:
        return header.mac is not None and hmac.compare_digest(header.mac, self.mac(header, data))


class DroppedMessages:
    """Counts messages dropped because they did not decode, logging the first one and then at most one
    line per `log_interval_s` (a peer sending garbage in a loop must not flood the log)."""

    def __init__(
        self, what: str, log_interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what = what
        self.count = 0
        self.log_interval_s = log_interval_s
        self.clock = clock
        self._logged_at: float | None = None
        self._unlogged = 0
        self._log = logging.getLogger("pdserve.wire")

    def drop(self, error: object) -> None:
        self.count += 1
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.log_interval_s:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
        self._log.warning("dropped a malformed message on the %s: %s%s", self.what, error, more)
        self._logged_at, self._unlogged = now, 0
