"""pdserve: an LLM serving engine that schedules, batches, measures and places prefill and decode
differently.

The public names are imported lazily, so the control plane (request, scheduler, block manager) and the
HTTP front can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdserve.errors import InvalidRequestError, ModelLoadError, PdserveError
from pdserve.request import SamplingParams
from pdserve.structured import StructuredOutputs

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM
    from pdserve.outputs import CompletionOutput, RequestOutput

_LAZY = {
    "LLM": "pdserve.engine.llm",
    "CompletionOutput": "pdserve.outputs",
    "RequestOutput": "pdserve.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "ModelLoadError",
    "PdserveError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
