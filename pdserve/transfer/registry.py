"""Transfer backends by name, imported on first use (no torch here). `config.KV_TRANSFER_BACKENDS` spells
the same names for validation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.registry import Registry

if TYPE_CHECKING:
    from pdserve.transfer.base import KVTransport

TRANSPORTS: Registry[type[KVTransport]] = Registry(
    "KV transfer backend",
    {
        "inproc": "pdserve.transfer.inproc:InprocTransport",
        "shm": "pdserve.transfer.zmq_transport:ShmTransport",
        "tcp": "pdserve.transfer.zmq_transport:TcpTransport",
        "torch.distributed": "pdserve.transfer.torch_dist:TorchDistTransport",
    },
)


def transport_class(name: str) -> type[KVTransport]:
    return TRANSPORTS.load(name)
