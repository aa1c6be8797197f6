"""Prefill/decode disaggregation. The router (`app.py`) is an OpenAI-compatible front that sends each
request's prompt to a prefill instance and its generation to a decode instance over HTTP, choosing the
instances with the policies in `policies.py`.

The router's names are imported lazily, so the instance side of this package does not pull in the
router's HTTP stack."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.router.app import RouterConfig, build_router_app, serve_router

_LAZY = {
    "RouterConfig": "pdserve.router.app",
    "build_router_app": "pdserve.router.app",
    "serve_router": "pdserve.router.app",
}

__all__ = ["RouterConfig", "build_router_app", "serve_router"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve.router' has no attribute {name!r}")
