"""Prefill/decode disaggregation. The router (`router.py`) is an OpenAI-compatible front that sends each
request's prompt to a prefill instance and its generation to a decode instance over HTTP, choosing the
instances with the policies in `policies.py`.

The router's names are imported lazily, so the instance side of this package does not pull in the
router's HTTP stack."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.disagg.router import RouterConfig, build_router_app, serve_router

_LAZY = {
    "RouterConfig": "pdserve.disagg.router",
    "build_router_app": "pdserve.disagg.router",
    "serve_router": "pdserve.disagg.router",
}

__all__ = ["RouterConfig", "build_router_app", "serve_router"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve.disagg' has no attribute {name!r}")
