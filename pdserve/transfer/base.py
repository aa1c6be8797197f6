"""Moving KV between instances: the transport interface, its states and its registry.

A transport moves *chunks*: the K and V of one layer for a run of consecutive token positions of one
request, as one tensor of `KVLayout.chunk_shape(num_tokens)` (`[2, num_kv_heads, num_tokens, head_dim]` in
the cache's storage dtype; for int8/fp8 each row carries its scale's bytes too, as uint8). It never sees
blocks or scales: packing chunks out of the paged cache and into it is `KVCache.gather_tokens` /
`scatter_tokens`, called by the connector (`pdserve/transfer/connector.py`), so a backend is only about
bytes on a path. Both ends must have the same `KVLayout` (kv dtype, block size, heads, head_dim, layers):
every chunk header names the sender's (`KVLayout.key()`) and a receiver refuses a chunk of another, before
anything reaches its cache; `inproc` refuses at `open_send` already.

One transfer, seen from both ends (`transfer_id` names it on both):

    prefill side                                   decode side
    open_send(tid, dest, start, end)               open_receive(tid, start, end)   (blocks reserved first)
    send_chunk(tid, layer, start, kv)  ... -->     poll_received() -> KVChunk ...   (layer by layer)
    send_done(tid, first_token, logprobs) -->      poll_received() -> KVDone
    poll_acks() -> KVAck(ok)           <--         ack(tid, ok, error)
    close_send(tid)                                close_receive(tid)

Sends never block the caller (the prefill forward goes on with the next layer while a chunk travels).
Failures are values: an ack with ok=False, or no ack before the connector's deadline. A transport is
used by one thread, the engine loop's.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pdserve.kv.cache import KVLayout
from pdserve.transfer.types import KVDone, TransferError
from pdserve.transfer.wire import DroppedMessages

__all__ = ["KVDone", "TransferError"]  # (defined in types: torch-free; re-exported with the rest of the API)

__all__ = [
    "KVAck", "KVChunk", "KVDone", "KVFailed", "KVLayout", "KVLayoutMismatch", "KVTransport", "TransferError",
    "TransferState", "layout_mismatch",
]


class TransferState(enum.Enum):
    PENDING = "pending"  # opened; nothing moved yet
    TRANSFERRING = "transferring"  # chunks are moving
    DONE = "done"  # every chunk and the first token arrived and were written into the decode side's cache
    FAILED = "failed"  # timed out, cancelled, refused or lost: both sides free their blocks


@dataclass(slots=True)
class KVChunk:
    transfer_id: str
    layer: int
    start: int  # position of the first token in the request
    kv: torch.Tensor  # KVLayout.chunk_shape(n); valid until the next poll_received()


@dataclass(slots=True)
class KVFailed:
    """A transfer broke on arrival (bad checksum, malformed frame, buffer gone): fail it."""

    transfer_id: str
    error: str


@dataclass(slots=True)
class KVAck:
    transfer_id: str
    ok: bool
    error: str | None = None


class KVLayoutMismatch(TransferError):
    """The two ends store KV differently (kv dtype, block size, heads, head_dim or layers): they must not
    pair, since the receiver would misread every byte."""


def layout_mismatch(sender: str, receiver: str) -> str | None:
    """The error for a chunk of layout key `sender` arriving at a receiver of `receiver`, or None if equal."""
    if sender == receiver:
        return None
    return f"KV layout mismatch: the sender's cache is {sender or 'unspecified'}, the receiver's {receiver}"


class KVTransport(ABC):
    """One per engine. `address` is where peers send to this instance (empty if it cannot receive)."""

    name: str = ""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.address = ""
        self.dropped = DroppedMessages(f"{self.name} KV transport")  # messages that did not decode

    # ---- prefill side --------------------------------------------------------------------------
    @abstractmethod
    def open_send(self, transfer_id: str, dest: str, start: int, end: int) -> None:
        """Start sending tokens [start, end) of a request to the instance at `dest`. Raises TransferError
        if that is impossible right away (the transfer is then FAILED)."""

    @abstractmethod
    def send_chunk(self, transfer_id: str, layer: int, start: int, kv: torch.Tensor) -> None:
        """Queue one layer's K/V for tokens [start, start + n). May read `kv` after returning only if it
        owns a copy: the caller reuses the memory."""

    @abstractmethod
    def send_done(self, transfer_id: str, first_token: int, logprobs: dict[int, float] | None) -> None:
        """Every chunk was sent; the receiver acks once it has all of them."""

    @abstractmethod
    def poll_acks(self) -> list[KVAck]:
        """Acks that arrived since the last call (non-blocking)."""

    @abstractmethod
    def close_send(self, transfer_id: str) -> None:
        """Forget a transfer (after its ack, a failure or a cancellation). Idempotent."""

    # ---- decode side ---------------------------------------------------------------------------
    @abstractmethod
    def open_receive(self, transfer_id: str, start: int, end: int) -> None:
        """Expect tokens [start, end) of a request (its blocks are already reserved)."""

    @abstractmethod
    def poll_received(self) -> list[KVChunk | KVDone | KVFailed]:
        """Chunks and completions that arrived since the last call (non-blocking), for open transfers
        only; anything for an unknown transfer is refused with a failed ack."""

    @abstractmethod
    def ack(self, transfer_id: str, ok: bool, error: str | None = None) -> None:
        """Tell the sender how the transfer ended (needs its KVDone, or a chunk, to know the sender)."""

    @abstractmethod
    def close_receive(self, transfer_id: str) -> None:
        """Forget a transfer and release its buffers. Idempotent."""

    def authenticate_with(self, secret: bytes) -> None:
        """Sign what this transport sends and accept only what verifies under the cluster's secret.
        Transports that never leave the process need nothing."""

    def close(self) -> None:
        """Release sockets and buffers."""
