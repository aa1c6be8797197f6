"""Streaming responses that notice a client leaving at once, for the server and the router alike.

Starlette leaves watching for the disconnect to the ASGI server (2.4), so a stream that is waiting for
the engine (or an upstream instance) would only notice at its next write. Here the body and a watcher
run side by side and whichever ends first cancels the other. No torch: the router uses this too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse


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
