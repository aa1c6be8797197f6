"""The transfer layer's torch-free types: what a request asks of a KV transfer, how the prefill side's last
word looks, what one poll finds, how a transfer fails. The engine loop and the simulator's transfers
(`pdserve.sim.simulator.simulate_cluster`) use them without importing torch; `base` and `connector`
re-export them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.request import Request


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """On a prefill instance: compute the prompt and the first token, send the KV to `address`."""

    transfer_id: str
    address: str
    skip_tokens: int = 0  # leading prompt tokens the decode side already holds


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """On a decode instance: reserve blocks, receive the prompt's KV and first token, then decode."""

    transfer_id: str


@dataclass(slots=True)
class KVDone:
    """The prefill side computed the whole prompt and sampled the first token; no chunk follows."""

    transfer_id: str
    first_token: int
    logprobs: dict[int, float] | None


class TransferError(Exception):
    """A transport cannot start or continue a transfer (peer unknown, buffer gone, bad frame)."""


@dataclass(slots=True)
class TransferEvents:
    """What one `poll()` found, for the engine to apply."""

    sent: list[tuple[Request, bool, str | None]] = field(default_factory=list)  # (req, ok, error)
    received: list[tuple[Request, KVDone]] = field(default_factory=list)
    failed_receives: list[tuple[Request, str]] = field(default_factory=list)
