"""One attempt of a generation request on a (prefill, decode) pair, as the router's module docstring
(`app.py`) describes it: reserve on D, run P, pass D's bytes on. What an attempt needs of the router
(its HTTP client, metrics, bookkeeping) is the `Upstreams` protocol, so this module does not import it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import httpx
import msgspec

from pdserve.router.bodies import decode_body, last_event_end, prefill_body
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import Instance
from pdserve.server import wire
from pdserve.server.protocol import APIError
from pdserve.server.wire import KV_RESERVATION_HEADER, KVReservation

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


class Upstreams(Protocol):
    """The router's side of an attempt (`app.Router`)."""

    client: httpx.AsyncClient
    upstream_headers: dict[str, str]
    metrics: RouterMetrics

    def upstream_error(self, inst: Instance, e: httpx.HTTPError, while_answering: bool = False) -> Failure: ...

    def acquire(self, inst: Instance, num_tokens: int) -> None: ...

    def release(self, inst: Instance, num_tokens: int) -> None: ...


@dataclass(slots=True)
class Failure:
    """Why an attempt failed and what the client gets if no other attempt follows."""

    instance: Instance
    status: int
    content: bytes  # the HTTP body to answer with
    media_type: str
    error: dict[str, Any]  # the {"error": {...}} object, for an SSE error event
    retryable: bool  # False: the request itself was refused (4xx), another pair would refuse it too

    @staticmethod
    def of(instance: Instance, status: int, message: str, code: str) -> Failure:
        error = APIError(status, message, "server_error", None, code).body()
        return Failure(instance, status, _json.encode(error), "application/json", error, True)

    @staticmethod
    def answered(instance: Instance, status: int, content: bytes, media_type: str | None) -> Failure:
        """An instance's own error answer, passed on as it is."""
        try:
            msgspec.json.decode(content, type=wire.ErrorBody)  # the shape is checked, the body kept whole
            error = msgspec.json.decode(content)
        except msgspec.DecodeError:  # ValidationError is one
            error = None
        if error is None:
            text = content.decode("utf-8", "replace")[:500]
            message = f"the {instance.role} instance {instance.url} answered {status}: {text}"
            error = APIError(status, message, "server_error", None, "upstream_error").body()
        return Failure(instance, status, content, media_type or "application/json", error, status >= 500)


class AttemptFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.error["error"].get("message"))
        self.failure = failure


# Events an attempt's two upstream tasks report, in order, on one queue.
_DATA, _END, _PREFILL_DONE, _FAILED = "data", "end", "prefill_done", "failed"


class Exchange:
    """One attempt: a transfer id, the chosen (P, D) pair, D's streamed response and P's request.

    `open()` reserves on D, starts P, and returns D's first bytes for the client; `rest()` yields the
    remaining ones; `aclose()` cancels whatever still runs (each instance then aborts its side)."""

    def __init__(
        self,
        router: Upstreams,
        path: str,
        body: dict[str, Any],
        num_tokens: int,
        prefill: Instance,
        decode: Instance,
        arrival: float,
    ) -> None:
        self.router = router
        self.path = path
        self.body = body
        self.num_tokens = num_tokens
        self.prefill = prefill
        self.decode = decode
        self.arrival = arrival
        self.transfer_id = uuid.uuid4().hex
        self.d_resp: httpx.Response | None = None
        self.outcome: str | None = None  # set when the client got everything it will get
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._holds_prefill = self._holds_decode = True
        self._closed = False
        router.acquire(prefill, num_tokens)
        router.acquire(decode, 0)

    @property
    def is_chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    async def open(self) -> bytes:
        """Raises AttemptFailed if the attempt fails before D has sent anything for the client."""
        client = self.router.client
        request = client.build_request(
            "POST",
            self.decode.url + self.path,
            content=_json.encode(decode_body(self.body, self.transfer_id)),
            headers=self.router.upstream_headers,
        )
        started = time.monotonic()
        try:
            resp = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise AttemptFailed(self.router.upstream_error(self.decode, e)) from None
        self.d_resp = resp
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                raise AttemptFailed(self.router.upstream_error(self.decode, e)) from None
            media_type = resp.headers.get("content-type")
            raise AttemptFailed(Failure.answered(self.decode, resp.status_code, content, media_type))
        self.router.metrics.time_to_reservation.observe(time.monotonic() - started)
        reservation = self._reservation(resp)
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        p_body = prefill_body(self.body, self.is_chat, reservation)
        self._tasks = [
            asyncio.create_task(self._run_prefill(p_body)),
            asyncio.create_task(self._pump_decode(resp, is_sse)),
        ]
        while True:
            kind, value = await self._events.get()
            if kind == _DATA:
                return value
            if kind == _END:  # an empty body
                self.outcome = "ok"
                return b""
            if kind == _FAILED:
                raise AttemptFailed(value)
            # _PREFILL_DONE: the KV is on D; its first bytes follow

    async def rest(self) -> AsyncIterator[bytes]:
        """D's bytes after the first, then the end; a failure ends an SSE stream with an error event."""
        while self.outcome is None:
            kind, value = await self._events.get()
            if kind == _DATA:
                yield value
            elif kind == _END:
                self.outcome = "ok"
                return
            elif kind == _FAILED:
                self.outcome = "failed"
                error = value.error["error"]
                logger.warning("request %s failed while streaming: %s", self.transfer_id, error)
                yield b"data: " + _json.encode(value.error) + b"\n\n"
                yield DONE
                return

    def _reservation(self, resp: httpx.Response) -> KVReservation:
        header = resp.headers.get(KV_RESERVATION_HEADER)
        problem = None
        if header is None:
            problem = f"no {KV_RESERVATION_HEADER} header"
        else:
            try:
                reservation = msgspec.json.decode(header, type=KVReservation)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.router.metrics.dropped["kv_reservation"].inc()
                problem = f"an invalid {KV_RESERVATION_HEADER} header ({e}): {header[:200]}"
            else:
                if reservation.transfer_id != self.transfer_id:
                    problem = f"a reservation for transfer {reservation.transfer_id}, not {self.transfer_id}"
                elif reservation.skip_tokens < 0:
                    problem = f"a reservation with skip_tokens {reservation.skip_tokens} < 0"
                else:
                    return reservation
        message = f"the decode instance {self.decode.url} answered 200 with {problem}"
        raise AttemptFailed(Failure.of(self.decode, 502, message, "bad_kv_reservation"))

    async def _run_prefill(self, p_body: dict[str, Any]) -> None:
        router = self.router
        started = time.monotonic()
        try:
            resp = await router.client.post(
                self.prefill.url + self.path, content=_json.encode(p_body), headers=router.upstream_headers
            )
        except httpx.HTTPError as e:
            self._events.put_nowait((_FAILED, router.upstream_error(self.prefill, e)))
            return
        except Exception as e:  # a bug here must still end the request, not leave it waiting
            logger.exception("prefill request %s failed", self.transfer_id)
            failure = Failure.of(self.prefill, 500, f"router error: {e!r}", "router_error")
            self._events.put_nowait((_FAILED, failure))
            return
        finally:
            self._release_prefill()
        router.metrics.prefill_time.observe(time.monotonic() - started)
        if resp.status_code == 200:
            self._events.put_nowait((_PREFILL_DONE, None))
        else:
            media_type = resp.headers.get("content-type")
            failure = Failure.answered(self.prefill, resp.status_code, resp.content, media_type)
            self._events.put_nowait((_FAILED, failure))

    async def _pump_decode(self, resp: httpx.Response, is_sse: bool) -> None:
        """D's body onto the queue: whole SSE events as they complete, or the whole body at its end."""
        pending = bytearray()
        first = True
        try:
            async for chunk in resp.aiter_bytes():
                if first and chunk:
                    self.router.metrics.time_to_first_byte.observe(time.monotonic() - self.arrival)
                    first = False
                pending += chunk
                if is_sse:
                    end = last_event_end(pending)
                    if end:
                        self._events.put_nowait((_DATA, bytes(pending[:end])))
                        del pending[:end]
        except httpx.HTTPError as e:
            failure = self.router.upstream_error(self.decode, e, while_answering=True)
            self._events.put_nowait((_FAILED, failure))
            return
        except Exception as e:  # a bug here must still end the request, not leave it waiting
            logger.exception("reading the decode answer of %s failed", self.transfer_id)
            failure = Failure.of(self.decode, 500, f"router error: {e!r}", "router_error")
            self._events.put_nowait((_FAILED, failure))
            return
        if pending:
            self._events.put_nowait((_DATA, bytes(pending)))
        self._events.put_nowait((_END, None))

    def _release_prefill(self) -> None:
        if self._holds_prefill:  # once: when P answered or when the attempt ends, whichever is first
            self._holds_prefill = False
            self.router.release(self.prefill, self.num_tokens)

    async def aclose(self) -> None:
        """Cancel both upstream requests (closing their connections) and give the instances back."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.d_resp is not None:
                await self.d_resp.aclose()
        self._release_prefill()
        if self._holds_decode:
            self._holds_decode = False
            self.router.release(self.decode, 0)
