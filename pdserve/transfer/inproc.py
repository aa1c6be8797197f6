"""`inproc`: transports of engines in one process, connected by an explicit `InprocHub` (tests, the
simulator). Chunks are copied on send, exactly as a real wire would, so the sender may reuse its memory."""

from __future__ import annotations

import itertools

import torch

from pdserve.transfer.base import (
    KVAck, KVChunk, KVDone, KVFailed, KVLayout, KVLayoutMismatch, KVTransport, TransferError, layout_mismatch,
)


class InprocHub:
    """Who is listening at which `inproc://` address. Share one hub between the engines of a test."""

    def __init__(self) -> None:
        self.transports: dict[str, InprocTransport] = {}
        self._ids = itertools.count()

    def new_address(self) -> str:
        return f"inproc://{next(self._ids)}"


class InprocTransport(KVTransport):
    name = "inproc"

    def __init__(self, layout: KVLayout, hub: InprocHub) -> None:
        super().__init__(layout)
        self.hub = hub
        self.address = hub.new_address()
        hub.transports[self.address] = self
        self._dest: dict[str, str] = {}  # sending: transfer id -> receiver address
        self._acks: list[KVAck] = []
        self._open: dict[str, str | None] = {}  # receiving: transfer id -> sender address once known
        self._inbox: list[KVChunk | KVDone | KVFailed] = []

    # ---- prefill side --------------------------------------------------------------------------
    def open_send(self, transfer_id: str, dest: str, start: int, end: int) -> None:
        peer = self.hub.transports.get(dest)
        if peer is None:
            raise TransferError(f"no inproc KV receiver at {dest!r}")
        mismatch = layout_mismatch(self.layout.key(), peer.layout.key())
        if mismatch is not None:  # the receiver is in reach: refuse before anything is held or sent
            raise KVLayoutMismatch(mismatch)
        self._dest[transfer_id] = dest

    def send_chunk(self, transfer_id: str, layer: int, start: int, kv: torch.Tensor) -> None:
        self._deliver(transfer_id, KVChunk(transfer_id, layer, start, kv.clone()))

    def send_done(self, transfer_id: str, first_token: int, logprobs: dict[int, float] | None) -> None:
        self._deliver(transfer_id, KVDone(transfer_id, first_token, logprobs))

    def _deliver(self, transfer_id: str, event: KVChunk | KVDone) -> None:
        peer = self.hub.transports.get(self._dest.get(transfer_id, ""))
        if peer is None:  # the receiver went away: the wire is cut
            self._acks.append(KVAck(transfer_id, False, "the KV receiver is gone"))
            return
        peer._accept(self.address, event)

    def poll_acks(self) -> list[KVAck]:
        acks, self._acks = self._acks, []
        return acks

    def close_send(self, transfer_id: str) -> None:
        self._dest.pop(transfer_id, None)

    # ---- decode side ---------------------------------------------------------------------------
    def _accept(self, sender: str, event: KVChunk | KVDone) -> None:
        if event.transfer_id not in self._open:
            self._ack_to(sender, KVAck(event.transfer_id, False, "unknown or closed transfer"))
            return
        self._open[event.transfer_id] = sender
        self._inbox.append(event)

    def open_receive(self, transfer_id: str, start: int, end: int) -> None:
        self._open[transfer_id] = None

    def poll_received(self) -> list[KVChunk | KVDone | KVFailed]:
        events, self._inbox = self._inbox, []
        return events

    def ack(self, transfer_id: str, ok: bool, error: str | None = None) -> None:
        sender = self._open.get(transfer_id)
        if sender is not None:
            self._ack_to(sender, KVAck(transfer_id, ok, error))

    def _ack_to(self, sender: str, ack: KVAck) -> None:
        peer = self.hub.transports.get(sender)
        if peer is not None:
            peer._acks.append(ack)

    def close_receive(self, transfer_id: str) -> None:
        self._open.pop(transfer_id, None)

    def close(self) -> None:
        self.hub.transports.pop(self.address, None)
