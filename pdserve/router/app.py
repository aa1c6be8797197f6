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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.config import RouterConfig
from pdserve.router.bodies import parse_generation_body, status_of_whole_body
from pdserve.router.exchange import AttemptFailed, Exchange, Failure
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import ROLES, Instance, make_policy
from pdserve.server.guards import check_api_key, check_json_content_type, read_body
from pdserve.server.http import WatchedStream, make_app, run_uvicorn, wait_disconnect
from pdserve.server.protocol import APIError
from pdserve.server.wire import CLUSTER_HEADER, LoadReport

logger = logging.getLogger(__name__)

__all__ = ["Router", "RouterConfig", "build_router_app", "serve_router"]

_json = msgspec.json.Encoder()
# Upstream bodies are passed on byte for byte (without a content-encoding): ask for them uncompressed.
_UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
# What instances answer is decoded into the typed, bounded structs of pdserve/server/wire.py; one that
# does not decode is dropped (the last good /load stays; a bad reservation fails the attempt) and counted
# in /metrics.


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

    def upstream_error(self, inst: Instance, e: httpx.HTTPError, while_answering: bool = False) -> Failure:
        """The failure for an upstream request that raised: a connection that could not be made marks the
        instance down at once; anything else has it checked now."""
        what = f"the {inst.role} instance {inst.url}"
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            self.set_up(inst, False, f"connection failed: {detail}")
            message = f"{what} could not be reached ({detail})"
            return Failure.of(inst, 502, message, f"{inst.role}_unavailable")
        self.probe(inst)
        if isinstance(e, httpx.TimeoutException):
            message = f"{what} did not answer within {self.config.request_timeout_s:g} s ({detail})"
            return Failure.of(inst, 504, message, f"{inst.role}_timeout")
        doing = "while answering" if while_answering else "before answering"
        return Failure.of(inst, 502, f"{what} failed {doing} ({detail})", f"{inst.role}_failed")

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
    ) -> Response | tuple[Exchange, bytes]:
        """Attempts until one gets D's first bytes: then an SSE stream (the exchange, still open, and those
        bytes) or the whole answer as a Response. Raises a 503 if no pair is up."""
        excluded: dict[str, set[str]] = {role: set() for role in ROLES}
        failure: Failure | None = None
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
            ex = Exchange(self, path, body, num_tokens, prefill, decode, arrival)
            try:
                first = await ex.open()
            except AttemptFailed as e:
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
            status = status_of_whole_body(first)
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
