"""Prefill/decode disaggregation. The router (`app.py`: its state, health polling and the HTTP app) is an
OpenAI-compatible front that sends each request's prompt to a prefill instance and its generation to a
decode instance over HTTP (`exchange.py`: one attempt on a pair; `bodies.py`: the bodies it reads and
rewrites), choosing the instances with the policies in `policies.py`; `metrics.py` has its Prometheus
series and `cluster.py` starts a local cluster (`serve --disagg`). Its settings are
`config.RouterConfig`.

The router's names are imported lazily, so the instance side of this package does not pull in the
router's HTTP stack."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config import RouterConfig
    from pdserve.router.app import build_router_app, serve_router

_LAZY = {
    "RouterConfig": "pdserve.config",
    "build_router_app": "pdserve.router.app",
    "serve_router": "pdserve.router.app",
}

__all__ = ["RouterConfig", "build_router_app", "serve_router"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve.router' has no attribute {name!r}")
