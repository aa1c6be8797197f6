"""The HTTP plumbing the server and the router share: OpenAI-style error handlers, streaming responses
that notice a client leaving at once, and uvicorn run with the hardened limits.

Starlette leaves watching for the disconnect to the ASGI server (2.4), so a stream that is waiting for
the engine (or an upstream instance) would only notice at its next write. Here the body and a watcher
run side by side and whichever ends first cancels the other. No torch: the router uses this too.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.config import KEEP_ALIVE_S
from pdserve.server.guards import guarded_h11
from pdserve.server.protocol import APIError



class WatchedStream(StreamingResponse):
    """Stops as soon as the client leaves, then always runs `on_close` (if given)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status_code: int = 200,
        media_type: str | None = None,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away between two events
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if self._on_close is not None:
                await self._on_close()


async def wait_disconnect(request: Request) -> None:
    """Returns once the client of a (non-streaming) request has gone."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def add_error_handlers(app: Any, component: str) -> None:
    """Answer every error a route raises with an OpenAI-style body: an `APIError` as itself (503s with
    `Retry-After`), HTTP errors (404, 405, ...) in the same shape, anything else as a logged 500.
    `component` names the process in the 500 message ("server", "router")."""
    log = logging.getLogger(f"pdserve.{component}")
    encode = msgspec.json.Encoder().encode

    def respond(body: Any, status: int, headers: dict[str, str] | None = None) -> Response:
        return Response(encode(body), status_code=status, media_type="application/json", headers=headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> Response:
        return respond(e.body(), e.status, {"Retry-After": "1"} if e.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return respond(APIError(e.status_code, str(e.detail), kind).body(), e.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error in %s", request.url.path)
        return respond(APIError(500, f"internal {component} error: {e}", "server_error").body(), 500)


def make_app(title: str, component: str, allowed_hosts: tuple[str, ...] | None, lifespan: Any) -> FastAPI:
    """The FastAPI app of a server or router: no docs routes, OpenAI-style errors (`add_error_handlers`)
    and, when `allowed_hosts` is set, a 400 for any other Host header (a web page cannot drive a local
    server through DNS rebinding)."""
    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app, component)
    if allowed_hosts is not None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    return app


def run_uvicorn(
    app: FastAPI,
    *,
    host: str,
    port: int,
    access_log: bool,
    max_connections: int,
    header_timeout_s: float,
    graceful_shutdown_s: int | None = None,
) -> None:
    """Serve `app` until SIGINT/SIGTERM with the limits both fronts need: idle keep-alive connections
    outlive the clients' pool timeouts (with uvicorn's 5 s default, a client reusing a connection being
    closed gets "connection reset": 1 of 200 requests from vLLM's benchmark client at 1 req/s), at most
    `max_connections` at once (beyond it 503 at once, not a growing backlog), and a connection whose
    request head has not arrived within `header_timeout_s` closed."""
    import uvicorn

    # uvicorn handles SIGINT/SIGTERM while it runs, shuts down gracefully, and then raises the signal
    # again for the handler that was there before it; that one only has to let the process exit with 0.
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=access_log,
        timeout_graceful_shutdown=graceful_shutdown_s,
        timeout_keep_alive=KEEP_ALIVE_S,
        limit_concurrency=max_connections,
        http=guarded_h11(header_timeout_s),
        lifespan="on",
    )
    try:
        uvicorn.Server(uv).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _after_shutdown(signum: int, frame: object) -> None:
    """The signal uvicorn re-raises once it has shut down: nothing is left to do."""
