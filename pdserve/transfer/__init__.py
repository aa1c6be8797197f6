"""KV-cache transfer between instances: `base.py` has the interface and the registry of backends."""

from pdserve.transfer.base import (
    KVAck,
    KVChunk,
    KVDone,
    KVFailed,
    KVLayout,
    KVTransport,
    TransferError,
    TransferState,
)
from pdserve.transfer.registry import TRANSPORTS, transport_class

__all__ = [
    "TRANSPORTS",
    "KVAck",
    "KVChunk",
    "KVDone",
    "KVFailed",
    "KVLayout",
    "KVTransport",
    "TransferError",
    "TransferState",
    "transport_class",
]
