"""The disaggregation router: an OpenAI-compatible front that runs each request's prompt on a prefill
instance and its generation on a decode instance, talking to both only over HTTP.

A generation request passes through it like this (one *attempt*; `_Exchange` owns it):
  1. pick a prefill instance P and a decode instance D (policies, `policies.py`) and a `transfer_id`;
  2. POST the client's body to D with `kv_transfer_params.remote_prefill`, streaming: D answers 200 once
     it has reserved KV blocks, with the receiver's address in the `x-pdserve-kv-reservation` header, and
     its body is the client's response (SSE or one JSON body), produced once the KV has arrived;
  3. POST the body to P as a one-token, non-streaming completion with `kv_transfer_params.remote_decode`
     (D's address): P answers when it has sent the KV to D;
  4. pass D's body through to the client (SSE event by event) while P's answer is awaited.
The client's status line is only sent once D has produced its first bytes, so an attempt that fails
before that (P failed, D unreachable, no reservation) is retried on another pair or answered with a
plain HTTP error; a failure after that ends the stream with an SSE error event and `[DONE]`. Closing an
upstream request (client gone, attempt failed) makes that instance abort its side and free its blocks.

A background task polls every instance's `GET /health` and `GET /load`; requests go only to instances
that are up. `build_router_app(RouterConfig)` builds the FastAPI app; `serve_router` runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pdserve.router.policies import (
    DEFAULT_DECODE_POLICY,
    DEFAULT_PREFILL_POLICY,
    ROLES,
    Instance,
    make_policy,
)
from pdserve.server import wire
from pdserve.server.guards import check_api_key, check_json_content_type, read_body
from pdserve.server.http import WatchedStream, make_app, run_uvicorn, wait_disconnect
from pdserve.server.protocol import APIError, bad_request
from pdserve.server.wire import CLUSTER_HEADER, KV_RESERVATION_HEADER, KVReservation, LoadReport

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "rejected", "failed", "unavailable", "cancelled")

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"
# Upstream bodies are passed on byte for byte (without a content-encoding): ask for them uncompressed.
_UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings. URLs are normalised (no trailing slash) and lists become tuples."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_policy: str = DEFAULT_PREFILL_POLICY
    decode_policy: str = DEFAULT_DECODE_POLICY
    max_retries: int = 1  # further attempts on another pair, only while nothing was sent to the client
    request_timeout_s: float = 600.0  # longest wait for an upstream answer or for the next bytes of one
    connect_timeout_s: float = 5.0
    load_interval_s: float = 0.5  # polling of /health and /load
    health_timeout_s: float = 2.0
    max_connections: int = 1024  # to all instances together; each request holds two while it runs
    access_log: bool = False
    api_key: str | None = None  # clients must send `Authorization: Bearer <api_key>` (None: no key)
    cluster_secret: str | None = None  # sent to the instances with every request (they require it)
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    allowed_hosts: tuple[str, ...] | None = None
    max_client_connections: int = 2048

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            urls = tuple(u.strip().rstrip("/") for u in getattr(self, name))
            role = name.split("_")[0]
            if not urls:
                raise ValueError(f"the router needs at least one {role} instance URL")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"{role} instance URL {u!r} must start with http:// or https://")
            if len(set(urls)) != len(urls):
                raise ValueError(f"{role} instance URLs must not repeat: {', '.join(urls)}")
            object.__setattr__(self, name, urls)
        make_policy(self.prefill_policy)  # raises ValueError for an unknown name
        make_policy(self.decode_policy)
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("request_timeout_s", "connect_timeout_s", "load_interval_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 2:
            raise ValueError(f"max_connections must be >= 2, got {self.max_connections}")


# What instances answer is decoded into the typed, bounded structs of pdserve/server/wire.py; one that
# does not decode is dropped (the last good /load stays; a bad reservation fails the attempt) and counted
# in /metrics.


# ---- metrics -------------------------------------------------------------------------------------

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    """Prometheus metrics of one router, in a registry of its own."""

    def __init__(self, instances: Sequence[Instance]) -> None:
        self.registry = r = CollectorRegistry()
        requests = Counter(
            "pdserve:router_requests",
            "Generation requests by outcome: ok (passed through), rejected (4xx), failed (upstream error "
            "returned), unavailable (no instance up), cancelled (the client left).",
            ["outcome"],
            registry=r,
        )
        self.requests = {outcome: requests.labels(outcome) for outcome in OUTCOMES}
        dropped = Counter(
            "pdserve:router_dropped_messages",
            "Instance answers dropped because they did not decode: load (GET /load bodies), kv_reservation "
            "(reservation headers; the attempt fails).",
            ["kind"],
            registry=r,
        )
        self.dropped = {kind: dropped.labels(kind) for kind in ("load", "kv_reservation")}
        self.retries = Counter(
            "pdserve:router_retries", "Attempts retried on another prefill/decode pair.", registry=r
        )
        up = Gauge("pdserve:router_instance_up", "1 while the instance is up.", ["url", "role"], registry=r)
        in_flight = Gauge(
            "pdserve:router_requests_in_flight",
            "Requests the router has in flight on the instance.",
            ["url", "role"],
            registry=r,
        )
        self.up = {(i.role, i.url): up.labels(i.url, i.role) for i in instances}
        self.in_flight = {(i.role, i.url): in_flight.labels(i.url, i.role) for i in instances}
        # The instances' own KV-transfer totals, as their last /load reported them.
        labels = ["url", "role", "direction"]
        self.kv_transfer_bytes = Gauge(
            "pdserve:router_instance_kv_transfer_bytes",
            "KV bytes the instance moved in finished transfers (its own total, from /load).",
            labels,
            registry=r,
        )
        self.kv_transfer_seconds = Gauge(
            "pdserve:router_instance_kv_transfer_seconds",
            "Summed durations of the instance's finished KV transfers (its own total, from /load).",
            labels,
            registry=r,
        )
        self.kv_transfers = Gauge(
            "pdserve:router_instance_kv_transfers",
            "Finished KV transfers of the instance, by outcome (its own total, from /load).",
            [*labels, "outcome"],
            registry=r,
        )
        self.time_to_reservation = Histogram(
            "pdserve:router_time_to_kv_reservation_seconds",
            "Request sent to the decode instance to its answer with a KV reservation.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "pdserve:router_prefill_request_seconds",
            "Prefill request sent to answered: the prompt's prefill plus the KV transfer.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "pdserve:router_time_to_first_byte_seconds",
            "Request arrival at the router to the first body bytes from the decode instance.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )


# ---- request bodies ------------------------------------------------------------------------------


def parse_generation_body(raw: bytes, chat: bool) -> tuple[dict[str, Any], int]:
    """The client's JSON body and an estimate of its prompt tokens (characters / 4, or the number of
    token ids). Raises a 400 for what the router cannot route; the instances validate everything else."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise bad_request(
            f"n > 1 (got {n}) is not supported through the router yet; send separate requests", param="n"
        )
    if chat:
        return body, _estimate_chat_tokens(body.get("messages"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise bad_request(
                f"a list of {len(prompt)} prompts is not supported through the router yet; "
                "send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return body, len(prompt) // 4
    if isinstance(prompt, list):
        return body, len(prompt)
    return body, 0


def _estimate_chat_tokens(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    num_chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            num_chars += len(content)
        elif isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            num_chars += sum(len(t) for t in texts if isinstance(t, str))
    return num_chars // 4


def decode_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """What D gets: the client's body plus the remote-prefill marker (replacing a client's own)."""
    return {**body, "kv_transfer_params": wire.KVTransferParams(remote_prefill=True, transfer_id=transfer_id)}


def prefill_body(body: dict[str, Any], chat: bool, reservation: KVReservation) -> dict[str, Any]:
    """What P gets: the client's body as one non-streaming token, plus where to send the KV."""
    out = {k: v for k, v in body.items() if k not in ("n", "stream_options")}
    out["stream"] = False
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = wire.KVTransferParams(
        remote_decode=wire.RemoteDecode(
            transfer_id=reservation.transfer_id,
            address=reservation.address,
            backend=reservation.backend,
            skip_tokens=reservation.skip_tokens,
        )
    )
    return out


def _status_of_whole_body(content: bytes) -> int | None:
    """None for a decode instance's whole (non-streaming) answer that is a result; the status to answer
    with if it is an OpenAI error body instead (its status line said 200: the error came after the
    reservation). 504 for a timeout, else 502: the upstream failed."""
    try:
        body = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return 502
    error = body.get("error") if isinstance(body, dict) else None
    if error is None:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return 504 if code == "request_timeout" else 502


def _last_event_end(buf: bytearray) -> int:
    """Index just past the last complete SSE event in `buf` (0 if none)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


# ---- one attempt ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Failure:
    """Why an attempt failed and what the client gets if no other attempt follows."""

    instance: Instance
    status: int
    content: bytes  # the HTTP body to answer with
    media_type: str
    error: dict[str, Any]  # the {"error": {...}} object, for an SSE error event
    retryable: bool  # False: the request itself was refused (4xx), another pair would refuse it too

    @staticmethod
    def of(instance: Instance, status: int, message: str, code: str) -> _Failure:
        error = APIError(status, message, "server_error", None, code).body()
        return _Failure(instance, status, _json.encode(error), "application/json", error, True)

    @staticmethod
    def answered(instance: Instance, status: int, content: bytes, media_type: str | None) -> _Failure:
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
        return _Failure(instance, status, content, media_type or "application/json", error, status >= 500)


class _AttemptFailed(Exception):
    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.error["error"].get("message"))
        self.failure = failure


# Events an attempt's two upstream tasks report, in order, on one queue.
_DATA, _END, _PREFILL_DONE, _FAILED = "data", "end", "prefill_done", "failed"


class _Exchange:
    """One attempt: a transfer id, the chosen (P, D) pair, D's streamed response and P's request.

    `open()` reserves on D, starts P, and returns D's first bytes for the client; `rest()` yields the
    remaining ones; `aclose()` cancels whatever still runs (each instance then aborts its side)."""

    def __init__(
        self,
        router: Router,
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
        """Raises _AttemptFailed if the attempt fails before D has sent anything for the client."""
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
            raise _AttemptFailed(self.router.upstream_error(self.decode, e)) from None
        self.d_resp = resp
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                raise _AttemptFailed(self.router.upstream_error(self.decode, e)) from None
            media_type = resp.headers.get("content-type")
            raise _AttemptFailed(_Failure.answered(self.decode, resp.status_code, content, media_type))
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
                raise _AttemptFailed(value)
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
                yield _DONE
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
        raise _AttemptFailed(_Failure.of(self.decode, 502, message, "bad_kv_reservation"))

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
            failure = _Failure.of(self.prefill, 500, f"router error: {e!r}", "router_error")
            self._events.put_nowait((_FAILED, failure))
            return
        finally:
            self._release_prefill()
        router.metrics.prefill_time.observe(time.monotonic() - started)
        if resp.status_code == 200:
            self._events.put_nowait((_PREFILL_DONE, None))
        else:
            media_type = resp.headers.get("content-type")
            failure = _Failure.answered(self.prefill, resp.status_code, resp.content, media_type)
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
                    end = _last_event_end(pending)
                    if end:
                        self._events.put_nowait((_DATA, bytes(pending[:end])))
                        del pending[:end]
        except httpx.HTTPError as e:
            failure = self.router.upstream_error(self.decode, e, while_answering=True)
            self._events.put_nowait((_FAILED, failure))
            return
        except Exception as e:  # a bug here must still end the request, not leave it waiting
            logger.exception("reading the decode answer of %s failed", self.transfer_id)
            failure = _Failure.of(self.decode, 500, f"router error: {e!r}", "router_error")
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


# ---- the router ----------------------------------------------------------------------------------


class Router:
    """The app's state: instances and their health, policies, the HTTP clients, metrics."""

    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.instances: dict[str, list[Instance]] = {
            "prefill": [Instance(u, "prefill") for u in config.prefill_urls],
            "decode": [Instance(u, "decode") for u in config.decode_urls],
        }
        self.policies = {
            "prefill": make_policy(config.prefill_policy),
            "decode": make_policy(config.decode_policy),
        }
        self.metrics = RouterMetrics([i for role in ROLES for i in self.instances[role]])
        # Polling has a client of its own, so that a pool full of long generations never delays it.
        headers = {CLUSTER_HEADER: config.cluster_secret} if config.cluster_secret else {}
        self.upstream_headers = {**_UPSTREAM_HEADERS, **headers}
        self.client = httpx.AsyncClient(
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=256),
            trust_env=False,  # instances are addressed directly, never through a proxy
        )
        self.poll_client = httpx.AsyncClient(
            transport=transport,
            headers=headers,
            timeout=httpx.Timeout(config.health_timeout_s),
            limits=httpx.Limits(max_connections=4 * len(self.metrics.up) + 4),
            trust_env=False,
        )
        self._poller: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Check every instance once (so that requests right after startup find the ones that are up),
        then keep polling."""
        await self.check_all()
        self._poller = asyncio.create_task(self._poll())
        logger.info(
            "router: prefill %s (%s), decode %s (%s)",
            ", ".join(self.config.prefill_urls),
            self.config.prefill_policy,
            ", ".join(self.config.decode_urls),
            self.config.decode_policy,
        )

    async def stop(self) -> None:
        tasks = [t for t in (self._poller, *self._probes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()
        await self.poll_client.aclose()

    # ---- health ---------------------------------------------------------------------------------
    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for role in ROLES for i in self.instances[role]))

    async def check(self, inst: Instance) -> None:
        """Up when GET /health answers 200; then read GET /load (a bad report keeps the last one)."""
        try:
            health = await self.poll_client.get(inst.url + "/health")
        except httpx.HTTPError as e:
            self.set_up(inst, False, f"GET /health failed: {type(e).__name__}: {e}")
            return
        if health.status_code != 200:
            self.set_up(inst, False, f"GET /health answered {health.status_code}")
            return
        self.set_up(inst, True)
        try:
            resp = await self.poll_client.get(inst.url + "/load")
            resp.raise_for_status()
            load = msgspec.json.decode(resp.content, type=LoadReport)
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as e:
            if isinstance(e, msgspec.DecodeError):  # ValidationError is one
                self.metrics.dropped["load"].inc()
                logger.warning("dropped a malformed GET %s/load answer: %s", inst.url, e)
            else:
                logger.debug("GET %s/load failed: %s", inst.url, e)
            return
        if load.role not in (inst.role, "both") and load.role != inst.reported_role:
            logger.warning(
                "%s is configured as a %s instance but reports the role %r", inst.url, inst.role, load.role
            )
        inst.reported_role = load.role
        inst.num_running, inst.num_waiting = load.num_running, load.num_waiting
        inst.kv_cache_usage = load.kv_cache_usage
        m = self.metrics
        for direction, t in load.kv_transfers.items():
            if direction not in ("send", "receive"):
                continue
            m.kv_transfer_bytes.labels(inst.url, inst.role, direction).set(t.bytes)
            m.kv_transfer_seconds.labels(inst.url, inst.role, direction).set(t.seconds)
            m.kv_transfers.labels(inst.url, inst.role, direction, "ok").set(t.ok)
            m.kv_transfers.labels(inst.url, inst.role, direction, "failed").set(t.failed)

    def set_up(self, inst: Instance, is_up: bool, reason: str | None = None) -> None:
        if is_up and not inst.is_up:
            logger.info("%s instance %s is up", inst.role, inst.url)
        elif not is_up and (inst.is_up or inst.down_reason is None):
            logger.warning("%s instance %s is down: %s", inst.role, inst.url, reason)
        inst.is_up = is_up
        inst.down_reason = None if is_up else reason
        self.metrics.up[(inst.role, inst.url)].set(1 if is_up else 0)

    def probe(self, inst: Instance) -> None:
        """Check `inst` now rather than at the next poll (it just failed a request)."""
        task = asyncio.create_task(self.check(inst))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def upstream_error(self, inst: Instance, e: httpx.HTTPError, while_answering: bool = False) -> _Failure:
        """The failure for an upstream request that raised: a connection that could not be made marks the
        instance down at once; anything else has it checked now."""
        what = f"the {inst.role} instance {inst.url}"
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            self.set_up(inst, False, f"connection failed: {detail}")
            message = f"{what} could not be reached ({detail})"
            return _Failure.of(inst, 502, message, f"{inst.role}_unavailable")
        self.probe(inst)
        if isinstance(e, httpx.TimeoutException):
            message = f"{what} did not answer within {self.config.request_timeout_s:g} s ({detail})"
            return _Failure.of(inst, 504, message, f"{inst.role}_timeout")
        doing = "while answering" if while_answering else "before answering"
        return _Failure.of(inst, 502, f"{what} failed {doing} ({detail})", f"{inst.role}_failed")

    # ---- bookkeeping ----------------------------------------------------------------------------
    def acquire(self, inst: Instance, num_tokens: int) -> None:
        inst.num_in_flight += 1
        inst.num_outstanding_tokens += num_tokens
        self.metrics.in_flight[(inst.role, inst.url)].set(inst.num_in_flight)

    def release(self, inst: Instance, num_tokens: int) -> None:
        inst.num_in_flight -= 1
        inst.num_outstanding_tokens -= num_tokens
        self.metrics.in_flight[(inst.role, inst.url)].set(inst.num_in_flight)

    def select(self, role: str, excluded: set[str]) -> Instance | None:
        candidates = [i for i in self.instances[role] if i.is_up and i.url not in excluded]
        return self.policies[role].select(candidates) if candidates else None

    def unavailable(self, role: str) -> APIError:
        urls = ", ".join(i.url for i in self.instances[role])
        message = f"no {role} instance is up (configured: {urls})"
        return APIError(503, message, "server_error", None, "no_instance")

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, request: Request, path: str) -> Response:
        arrival = time.monotonic()
        c = self.config
        try:
            check_api_key(request, c.api_key)
            check_json_content_type(request)
            chat = path.endswith("/chat/completions")
            raw = await read_body(request, c.max_body_bytes, c.body_timeout_s)
            body, num_tokens = parse_generation_body(raw, chat)
        except APIError:
            self.metrics.requests["rejected"].inc()
            raise
        work = asyncio.ensure_future(self._first_answer(path, body, num_tokens, arrival))
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait({work})
        if work.cancelled():
            self.metrics.requests["cancelled"].inc()
            return Response(status_code=499)  # nobody is listening any more
        answer = work.result()  # raises the 503 of no instance
        if isinstance(answer, Response):
            return answer
        ex, first = answer
        assert ex.d_resp is not None

        async def content() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for chunk in ex.rest():
                yield chunk

        async def on_close() -> None:
            await ex.aclose()
            self.metrics.requests[ex.outcome or "cancelled"].inc()

        media_type = ex.d_resp.headers.get("content-type")
        return WatchedStream(content(), ex.d_resp.status_code, media_type, on_close=on_close)

    async def _first_answer(
        self, path: str, body: dict[str, Any], num_tokens: int, arrival: float
    ) -> Response | tuple[_Exchange, bytes]:
        """Attempts until one gets D's first bytes: then an SSE stream (the exchange, still open, and those
        bytes) or the whole answer as a Response. Raises a 503 if no pair is up."""
        excluded: dict[str, set[str]] = {role: set() for role in ROLES}
        failure: _Failure | None = None
        for attempt in range(self.config.max_retries + 1):
            prefill = self.select("prefill", excluded["prefill"])
            decode = self.select("decode", excluded["decode"])
            if prefill is None or decode is None:
                if failure is not None:
                    break  # no other pair to retry on: the last failure is the answer
                self.metrics.requests["unavailable"].inc()
                raise self.unavailable("prefill" if prefill is None else "decode")
            if attempt:
                self.metrics.retries.inc()
            ex = _Exchange(self, path, body, num_tokens, prefill, decode, arrival)
            try:
                first = await ex.open()
            except _AttemptFailed as e:
                await ex.aclose()
                failure = e.failure
                if not failure.retryable:
                    break
                logger.warning("attempt %d of request %s failed: %s", attempt + 1, ex.transfer_id, e)
                excluded[failure.instance.role].add(failure.instance.url)
                continue
            except BaseException:  # cancelled: the client left
                await ex.aclose()
                raise
            assert ex.d_resp is not None
            if ex.d_resp.headers.get("content-type", "").startswith("text/event-stream"):
                return ex, first
            await ex.aclose()  # a whole body: the exchange is over
            status = _status_of_whole_body(first)
            if status is not None:  # D failed after its 200 went out: the client gets a real error status
                logger.warning("request %s failed on the decode instance %s", ex.transfer_id, decode.url)
                self.metrics.requests["failed"].inc()
                return Response(first, status, media_type="application/json")
            self.metrics.requests["ok"].inc()
            return Response(first, ex.d_resp.status_code, media_type=ex.d_resp.headers.get("content-type"))
        assert failure is not None
        self.metrics.requests["failed" if failure.retryable else "rejected"].inc()
        return Response(failure.content, failure.status, media_type=failure.media_type)

    async def models(self, request: Request) -> Response:
        """GET /v1/models of the first decode instance that answers."""
        check_api_key(request, self.config.api_key)
        for inst in self.instances["decode"]:
            if not inst.is_up:
                continue
            try:
                resp = await self.poll_client.get(inst.url + "/v1/models")
            except httpx.HTTPError as e:
                self.upstream_error(inst, e)
                continue
            return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
        raise self.unavailable("decode")

    def health(self) -> Response:
        def listing(role: str) -> list[dict[str, Any]]:
            return [
                {
                    "url": i.url,
                    "up": i.is_up,
                    "down_reason": i.down_reason,
                    "num_requests_in_flight": i.num_in_flight,
                    "kv_cache_usage": i.kv_cache_usage,
                }
                for i in self.instances[role]
            ]

        body: dict[str, Any] = {"status": "ok"}
        missing = [role for role in ROLES if not any(i.is_up for i in self.instances[role])]
        if missing:
            error = "; ".join(self.unavailable(role).message for role in missing)
            body = {"status": "unhealthy", "error": error}
        body.update(prefill=listing("prefill"), decode=listing("decode"))
        return Response(_json.encode(body), 503 if missing else 200, media_type="application/json")


def build_router_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router as an ASGI app. `transport` replaces the network for the upstream requests (tests).
    The router (instances, metrics) is `app.state.router`."""
    router = Router(config, transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        logger.info("router serving on http://%s:%d", config.host, config.port)
        try:
            yield
        finally:
            await router.stop()

    app = make_app("pdserve router", "router", config.allowed_hosts, lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        return router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.generate(request, "/v1/chat/completions")

    return app


def serve_router(config: RouterConfig) -> None:
    """Run the router with uvicorn until SIGINT/SIGTERM."""
    run_uvicorn(
        build_router_app(config),
        host=config.host,
        port=config.port,
        access_log=config.access_log,
        max_connections=config.max_client_connections,
        header_timeout_s=config.header_timeout_s,
    )
