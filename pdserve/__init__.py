"""pdserve: an LLM serving engine that schedules, batches, measures and places prefill and decode
differently."""

from pdserve.engine.llm import LLM
from pdserve.errors import InvalidRequestError, ModelLoadError, PdserveError
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.request import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "ModelLoadError",
    "PdserveError",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
