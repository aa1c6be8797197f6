"""Typed errors. User input problems are `InvalidRequestError` (HTTP 400 in the server); everything
else that the user can cause and fix gets its own type so callers never parse messages."""


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """A request (prompt or sampling parameters) that the engine refuses; nothing was allocated for it."""


class ModelLoadError(PdserveError):
    """A model path, architecture or tensor type that pdserve cannot load."""


class SLORejectedError(PdserveError):
    """The `slo` policy (with `slo_reject`) refuses a request that it predicts would miss its TTFT target or
    push running requests past the ITL target; nothing was allocated. The server answers 503."""


class UnsupportedConfigError(PdserveError, ValueError):
    """A combination of options that pdserve does not support (yet), refused when the config is built."""
