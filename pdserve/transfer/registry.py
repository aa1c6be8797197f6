"""Transfer backends by name, imported on first use (no torch here). `config.KV_TRANSFER_BACKENDS` spells
the same names for validation."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.transfer.base import KVTransport

# name -> "module:Class", imported on first use
TRANSPORTS: dict[str, str] = {
    "inproc": "pdserve.transfer.inproc:InprocTransport",
    "shm": "pdserve.transfer.zmq_transport:ShmTransport",
    "tcp": "pdserve.transfer.zmq_transport:TcpTransport",
    "torch.distributed": "pdserve.transfer.torch_dist:TorchDistTransport",
}


def transport_class(name: str) -> type[KVTransport]:
    try:
        module, cls = TRANSPORTS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose from {sorted(TRANSPORTS)}") from None
    return getattr(importlib.import_module(module), cls)
