"""The engine's side of prefill/decode disaggregation: which requests send or receive KV, the KV they
move, deadlines, and what the engine loop must do about each transfer's end.

On a prefill instance a request carries `RemoteDecode` (where its KV goes and how many leading tokens the
decode side already has in its prefix cache). Every step that computes some of its prompt hands the
connector a layer hook: as soon as a layer has written its K/V, those tokens of that layer are gathered
out of the paged cache and given to the transport, so sending overlaps the remaining layers (and, with
chunked prefill, the remaining chunks). After the step that samples its first token the request waits,
blocks held, in the scheduler's `sending` set until the decode side acks; then its blocks are freed.

On a decode instance a request carries `RemotePrefill`. The scheduler reserves its blocks first (prefix
hits included: those tokens are not sent); the connector then expects tokens [cached, prompt length)
of every layer, writes each arriving chunk into the reserved blocks, and reports the request complete
only when every layer has every token and the first token has arrived: never partial KV.

The connector changes no request state: it reports events and the engine tells the scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kv.cache import KVCache
from pdserve.request import Request
from pdserve.transfer.base import KVChunk, KVDone, KVFailed, KVTransport, TransferError, TransferState
from pdserve.transfer.types import RemoteDecode, RemotePrefill, TransferEvents

__all__ = ["KVConnector", "RemoteDecode", "RemotePrefill", "TransferEvents", "TransferRecord"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One finished transfer, for metrics."""

    req_id: str
    direction: str  # "send" | "receive"
    ok: bool
    num_tokens: int
    num_bytes: int
    duration: float  # seconds from open to the end (ack sent or received)
    error: str | None = None


@dataclass(slots=True)
class _Send:
    req: Request
    transfer_id: str
    start: int  # first position to send (the decode side holds the ones before)
    next_token: int  # first position not sent yet
    opened: float
    state: TransferState = TransferState.PENDING
    deadline: float | None = None  # set once the first token is sent: the ack must come by then
    num_bytes: int = 0


@dataclass(slots=True)
class _Receive:
    req: Request
    transfer_id: str
    start: int
    end: int
    deadline: float
    opened: float
    state: TransferState = TransferState.PENDING
    num_received: list[int] = field(default_factory=list)  # per layer
    done: KVDone | None = None
    num_bytes: int = 0
    slots: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class KVConnector:
    def __init__(
        self,
        transport: KVTransport,
        kv_cache: KVCache,
        ack_timeout_s: float = 10.0,
        lease_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.ack_timeout_s = ack_timeout_s
        self.lease_s = lease_s
        self.clock = clock
        self.num_layers = kv_cache.layout.num_layers
        if transport.layout.key() != kv_cache.layout.key():
            raise ValueError(
                f"the KV transport's layout ({transport.layout.describe()}) is not the cache's "
                f"({kv_cache.layout.describe()})"
            )
        self._sends: dict[str, _Send] = {}  # by req_id
        self._receives: dict[str, _Receive] = {}  # by req_id
        self._by_transfer: dict[str, str] = {}  # transfer_id -> req_id, both directions
        self.records: list[TransferRecord] = []  # finished transfers since the caller last took them
        self.num_bytes_sent = 0
        self.num_bytes_received = 0

    @property
    def address(self) -> str:
        return self.transport.address

    def state(self, req_id: str) -> TransferState | None:
        """The state of the request's open transfer; None once it has ended (or if it never had one)."""
        t = self._sends.get(req_id) or self._receives.get(req_id)
        return t.state if t is not None else None

    @property
    def num_active(self) -> int:
        return len(self._sends) + len(self._receives)

    def _slots(self, req: Request, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(req.block_ids[: -(-end // self.block_size)], dtype=torch.int64)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.kv_cache.device)

    # ---- prefill side --------------------------------------------------------------------------
    def start_send(self, req: Request, spec: RemoteDecode) -> None:
        """Open the transfer before the request is queued; raises TransferError (nothing is held then)."""
        if not 0 <= spec.skip_tokens < req.num_prompt_tokens:
            raise TransferError(
                f"skip_tokens must be in [0, {req.num_prompt_tokens}) for a {req.num_prompt_tokens}-token prompt"
            )
        self.transport.open_send(spec.transfer_id, spec.address, spec.skip_tokens, req.num_prompt_tokens)
        self._sends[req.req_id] = _Send(req, spec.transfer_id, spec.skip_tokens, spec.skip_tokens, self.clock())
        self._by_transfer[spec.transfer_id] = req.req_id

    def layer_hook(self, steps: list[tuple[Request, int]]) -> Callable[[int], None] | None:
        """A hook for the step's forward, called with each layer's index once that layer's K/V are in the
        cache. `steps`: (request, tokens computed this step) for the step's requests. None if nothing
        this step has KV to send."""
        plan: list[tuple[_Send, int, torch.Tensor]] = []
        for req, n in steps:
            send = self._sends.get(req.req_id)
            end = req.num_computed_tokens + n
            if self.kv_cache.is_int4 and end < req.num_prompt_tokens:
                end -= end % self.block_size  # int4 moves whole (sealed) blocks, and the open one last
            if send is None or end <= send.next_token:
                continue
            plan.append((send, send.next_token, self._slots(req, send.next_token, end)))
            send.next_token = end
            send.state = TransferState.TRANSFERRING
        if not plan:
            return None
        transport = self.transport
        cache = self.kv_cache

        def after_layer(layer: int) -> None:
            for send, start, slots in plan:
                kv = cache.gather_tokens(layer, slots)  # values and, for int8/fp8, their scales
                transport.send_chunk(send.transfer_id, layer, start, kv)
                send.num_bytes += kv.numel() * kv.element_size()

        return after_layer

    def finish_send(self, req: Request) -> bool:
        """The request's last prompt token was computed and its first token sampled: send that token.
        False if its transfer has already ended (failed or cancelled)."""
        send = self._sends.get(req.req_id)
        if send is None:
            return False
        assert send.next_token == req.num_prompt_tokens, "the whole prompt's KV must have been sent"
        logprobs = req.logprobs[-1] if req.logprobs else None
        self.transport.send_done(send.transfer_id, req.output_token_ids[-1], logprobs)
        send.deadline = self.clock() + self.ack_timeout_s
        return True

    # ---- decode side ---------------------------------------------------------------------------
    def start_receive(self, req: Request, spec: RemotePrefill) -> None:
        """Blocks for the whole prompt are reserved; tokens from `req.num_computed_tokens` on will arrive."""
        start, end = req.num_computed_tokens, req.num_prompt_tokens
        self.transport.open_receive(spec.transfer_id, start, end)
        now = self.clock()
        self._receives[req.req_id] = _Receive(
            req, spec.transfer_id, start, end, now + self.lease_s, now, num_received=[0] * self.num_layers
        )
        self._by_transfer[spec.transfer_id] = req.req_id

    def _on_chunk(self, rec: _Receive, chunk: KVChunk) -> str | None:
        if rec.done is not None:
            return "a KV chunk arrived after the first token"
        try:  # (int4: dim 2 is bytes; the layout tells the tokens)
            n = self.kv_cache.layout.chunk_num_tokens(chunk.kv.shape[2], rec.end - chunk.start)
        except ValueError as e:
            return str(e)
        key = (chunk.start, n)
        slots = rec.slots.get(key)
        if slots is None:
            slots = rec.slots[key] = self._slots(rec.req, chunk.start, chunk.start + n)
        try:  # a payload of another shape or dtype is refused whole, before anything is written
            self.kv_cache.scatter_tokens(chunk.layer, slots, chunk.kv)
        except ValueError as e:
            return str(e)
        rec.num_received[chunk.layer] += n
        rec.num_bytes += chunk.kv.numel() * chunk.kv.element_size()
        rec.state = TransferState.TRANSFERRING
        return None

    # ---- both ----------------------------------------------------------------------------------
    def poll(self) -> TransferEvents:
        """Apply what arrived, collect acks, expire deadlines. Non-blocking; call once per engine step."""
        ev = TransferEvents()
        now = self.clock()
        for item in self.transport.poll_received():
            rec = self._receives.get(self._by_transfer.get(item.transfer_id, ""))
            if rec is None:
                continue
            error = None
            if isinstance(item, KVChunk):
                error = self._on_chunk(rec, item)
            elif isinstance(item, KVFailed):
                error = item.error
            else:
                rec.done = item
                want = rec.end - rec.start
                if any(c != want for c in rec.num_received):
                    error = f"incomplete KV: {sum(rec.num_received)} of {want * len(rec.num_received)} token-layers"
            if error is not None:
                self._end_receive(rec, False, error, now)
                ev.failed_receives.append((rec.req, error))
            elif rec.done is not None:
                self._end_receive(rec, True, None, now)
                ev.received.append((rec.req, rec.done))
        for ack in self.transport.poll_acks():
            send = self._sends.get(self._by_transfer.get(ack.transfer_id, ""))
            if send is None:
                continue
            if ack.ok and send.deadline is None:
                continue  # acks only come after the first token; ignore a confused peer
            error = None if ack.ok else f"KV transfer to the decode instance failed: {ack.error}"
            self._end_send(send, ack.ok, error, now)
            ev.sent.append((send.req, ack.ok, error))
        for send in [s for s in self._sends.values() if s.deadline is not None and now > s.deadline]:
            error = f"KV transfer timed out: no acknowledgement within {self.ack_timeout_s:g} s"
            self._end_send(send, False, error, now)
            ev.sent.append((send.req, False, error))
        for rec in [r for r in self._receives.values() if now > r.deadline]:
            error = f"KV transfer timed out: the prompt's KV did not arrive within {self.lease_s:g} s"
            self._end_receive(rec, False, error, now)
            ev.failed_receives.append((rec.req, error))
        return ev

    def cancel(self, req_id: str) -> None:
        """The request ended on this side (abort, error): stop its transfer, tell the peer if we can."""
        send = self._sends.get(req_id)
        if send is not None:
            self._end_send(send, False, "cancelled", self.clock())
        rec = self._receives.get(req_id)
        if rec is not None:
            self._end_receive(rec, False, "cancelled", self.clock())

    def _end_send(self, send: _Send, ok: bool, error: str | None, now: float) -> None:
        send.state = TransferState.DONE if ok else TransferState.FAILED
        self.transport.close_send(send.transfer_id)
        del self._sends[send.req.req_id]
        self._by_transfer.pop(send.transfer_id, None)
        self.num_bytes_sent += send.num_bytes
        self.records.append(
            TransferRecord(
                send.req.req_id, "send", ok, send.next_token - send.start, send.num_bytes, now - send.opened, error
            )
        )

    def _end_receive(self, rec: _Receive, ok: bool, error: str | None, now: float) -> None:
        rec.state = TransferState.DONE if ok else TransferState.FAILED
        self.transport.ack(rec.transfer_id, ok, error)
        self.transport.close_receive(rec.transfer_id)
        del self._receives[rec.req.req_id]
        self._by_transfer.pop(rec.transfer_id, None)
        self.num_bytes_received += rec.num_bytes
        self.records.append(
            TransferRecord(rec.req.req_id, "receive", ok, rec.end - rec.start, rec.num_bytes, now - rec.opened, error)
        )

    def take_records(self) -> list[TransferRecord]:
        records, self.records = self.records, []
        return records

    def close(self) -> None:
        for req_id in list(self._sends) + list(self._receives):
            self.cancel(req_id)
        self.transport.close()
