"""The router <-> instance contract of a disaggregated cluster, as typed and bounded msgspec structs: what
the router adds to a client's body (`kv_transfer_params`), what a decode instance answers in its
reservation header, and what `GET /load` reports. The server encodes and decodes these, the router
(pdserve/router/) decodes and encodes them, and the router's test fakes build them: one spelling.

It lives on the server's floor because the instance defines what it accepts; the router sits above and
imports it. Whatever a peer sends is decoded into one of these before it is used: a missing field, a
wrong type or a value out of range is a `msgspec.ValidationError`, and the message is refused or dropped.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdserve.transfer.wire import TransferId

# Headers of the contract: the router sends the cluster secret on every request to an instance (it alone
# unlocks kv_transfer_params and /load); a decode instance answers a remote-prefill request with where
# the prefill instance must send the prompt's KV.
CLUSTER_HEADER = "x-pdserve-cluster-secret"
KV_RESERVATION_HEADER = "x-pdserve-kv-reservation"

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Address = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Backend = Annotated[str, msgspec.Meta(max_length=32)]


class KVReservation(msgspec.Struct, kw_only=True):
    """A decode instance's `x-pdserve-kv-reservation` header: where the prefill instance sends the KV, and
    how many leading prompt tokens the decode side already has (its prefix-cache hit)."""

    transfer_id: TransferId
    address: Address
    backend: Backend
    skip_tokens: NonNegative


class RemoteDecode(msgspec.Struct, kw_only=True):
    """`kv_transfer_params.remote_decode` on a prefill instance: compute the prompt, send its KV there.
    (`backend` is the router's note of the decode side's transport; the instance uses its own.)"""

    transfer_id: TransferId
    address: Address
    backend: Backend | None = None
    skip_tokens: NonNegative = 0


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request body's `kv_transfer_params`: exactly one of
    `{"remote_prefill": true, "transfer_id": T}` (decode instance: reserve blocks, wait for the KV) and
    `{"remote_decode": {...}}` (prefill instance, see `RemoteDecode`)."""

    remote_prefill: bool = False
    transfer_id: TransferId | None = None
    remote_decode: RemoteDecode | None = None

    @property
    def is_remote_prefill(self) -> bool:
        return self.remote_prefill and self.transfer_id is not None and self.remote_decode is None

    @property
    def is_remote_decode(self) -> bool:
        return self.remote_decode is not None and not self.remote_prefill and self.transfer_id is None


class TransferTotals(msgspec.Struct, kw_only=True):
    """One direction's finished KV transfers on an instance (cumulative since it started)."""

    ok: NonNegative = 0
    failed: NonNegative = 0
    bytes: NonNegative = 0
    seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class LoadReport(msgspec.Struct, kw_only=True):
    """An instance's `GET /load` body: what the router needs to pick it."""

    role: Annotated[str, msgspec.Meta(max_length=16)]
    num_running: NonNegative
    num_waiting: NonNegative
    kv_cache_usage: Annotated[float, msgspec.Meta(ge=0, le=1)]
    num_in_flight: NonNegative = 0
    kv_backend: Backend | None = None
    kv_address: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    kv_transfers: Annotated[dict[str, TransferTotals], msgspec.Meta(max_length=2)] = {}


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """The OpenAI-style error answer every route of the server and the router gives (and, after a
    decode instance's reservation, the body or last SSE event of a request that failed)."""

    error: ErrorInfo
