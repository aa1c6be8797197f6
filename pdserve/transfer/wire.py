"""The KV transports' control messages, as typed and bounded msgspec structs, and the counter of the
messages that fail to decode.

Anything that arrives on a socket is decoded into one of these structs before the transport looks at it:
a wrong frame count, a missing field, a field of the wrong type or out of its range is a `DecodeError`
(`msgspec.ValidationError` is one), and the message is dropped, counted and logged, never raised into the
engine loop. On the wire each struct is a msgpack array whose first element is its tag (`["chunk", ...]`).
"""

from __future__ import annotations

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
MAX_WIRE_LOGPROBS = 64  # entries of the first token's logprobs dict (the server allows 20 + the sampled one)


class ChunkHeader(msgspec.Struct, tag="chunk", array_like=True, frozen=True):
    """One layer's K/V for tokens [start, start + num_tokens): its data follows (tcp), sits in the shared
    buffer (shm) or arrives through the process group under `tag` (torch.distributed)."""

    transfer_id: TransferId
    layer: Count
    start: Count
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    crc: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] | None = None
    tag: Count | None = None


class DoneHeader(msgspec.Struct, tag="done", array_like=True, frozen=True):
    transfer_id: TransferId
    first_token: Count
    logprobs: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_WIRE_LOGPROBS)] | None = None


class HelloHeader(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """torch.distributed: a sender asks the receiver to join a two-rank group at its TCPStore."""

    transfer_id: Annotated[str, msgspec.Meta(max_length=64)]
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]


class AckHeader(msgspec.Struct, tag="ack", array_like=True, frozen=True):
    transfer_id: TransferId
    ok: bool
    error: _Error | None = None


ToReceiver = ChunkHeader | DoneHeader | HelloHeader
ToSender = AckHeader


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
