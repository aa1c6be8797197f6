"""What every POST passes before a route reads it, shared by the server and the router: JSON only, and
a bounded body read within a deadline (the Host allow-list is starlette's TrustedHostMiddleware).

Why each exists: a web page the user visits can POST to a server on 127.0.0.1 with a "simple" request
(text/plain, a form, a Blob without a type: no CORS preflight), so only `application/json` is accepted;
DNS rebinding points a foreign name at 127.0.0.1, which the Host allow-list refuses; and a body is read
only up to a limit, within a deadline, so one client cannot make the front hold gigabytes or a
connection forever.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from pdserve.server.protocol import APIError
from pdserve.server.wire import CLUSTER_HEADER

JSON_TYPES = ("application/json",)


def check_json_content_type(request: Any) -> None:
    """415 unless the body is declared JSON (parameters such as charset are fine)."""
    declared = request.headers.get("content-type")
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    if media_type not in JSON_TYPES:
        what = f"Content-Type {declared!r}" if declared else "no Content-Type"
        raise APIError(415, f"the request has {what}; send application/json", "invalid_request_error", None,
                       "unsupported_media_type")


async def read_body(request: Any, max_bytes: int, timeout_s: float | None) -> bytes:
    """The whole body, refused with 413 past `max_bytes` (by its Content-Length, or as it arrives) and
    with 408 if it has not fully arrived within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", "invalid_request_error",
                       None, "request_timeout") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes} bytes", "invalid_request_error", None,
                    "request_too_large")


def guarded_h11(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all arrived
    within `header_timeout_s` of its opening or of the previous response (uvicorn has no such timer: a
    client that sends half a request, or one byte a minute, holds the connection for good)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        _header_timer: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole request head has arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's head (after keep-alive idling)
                self._arm(self.timeout_keep_alive)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, extra: float = 0.0) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s + extra, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11


# ---- authentication ------------------------------------------------------------------------------

def _same(given: str | None, expected: str) -> bool:
    """Constant-time comparison (timing must not tell how much of a guess was right)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def is_cluster_request(request: Any, cluster_secret: str | None) -> bool:
    """Whether the request carries the cluster's secret (comes from its router)."""
    return cluster_secret is not None and _same(request.headers.get(CLUSTER_HEADER), cluster_secret)


def check_api_key(request: Any, api_key: str | None, cluster_secret: str | None = None) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (OpenAI's convention), or comes
    from the cluster's router. No key configured: everything passes."""
    if api_key is None or is_cluster_request(request, cluster_secret):
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and _same(token.strip(), api_key):
        return
    raise APIError(401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>`",
                   "invalid_request_error", None, "invalid_api_key")


def check_cluster(request: Any, cluster_secret: str | None, what: str) -> None:
    """403 unless the request comes from the cluster's router (and a cluster secret is configured)."""
    if cluster_secret is None:
        raise APIError(403, f"{what} needs a cluster secret (--cluster-secret or PDSERVE_CLUSTER_SECRET), "
                       "which this instance does not have", "invalid_request_error", None, "no_cluster_secret")
    if not is_cluster_request(request, cluster_secret):
        raise APIError(403, f"{what} is accepted only from this cluster's router", "invalid_request_error", None,
                       "not_the_router")
