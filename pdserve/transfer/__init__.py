"""KV-cache transfer between instances: `base.py` has the interface and the registry of backends.

The names below load on first use, so that `pdserve.transfer.types` (the torch-free types the engine loop
and the simulator use) imports without torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVAck": "base",
    "KVChunk": "base",
    "KVDone": "types",
    "KVFailed": "base",
    "KVLayout": "base",
    "KVTransport": "base",
    "TransferError": "types",
    "TransferState": "base",
    "TRANSPORTS": "registry",
    "transport_class": "registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdserve.transfer.{module}"), name)
