"""The prefill/decode router over real HTTP on 127.0.0.1, against fake prefill and decode instances.

The fakes are small FastAPI apps, each served by uvicorn in a thread, that speak the instance protocol
(`pdserve/router/app.py`): a fake decode instance answers with a KV reservation header and produces
its body only once the fake prefill instance it was paired with has "transferred" the KV (a set shared by
the fakes, keyed by transfer id). Each fake records the bodies it received and whether the router hung
up on it. Behaviours that fail (an error status, a dropped connection, a hang) are switched per test.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli import main as cli_main
from pdserve.router.app import RouterConfig, build_router_app
from pdserve.router.policies import (
    Instance,
    LeastKVUsage,
    LeastOutstandingTokens,
    RoundRobin,
    make_policy,
)
from pdserve.server import wire
from pdserve.server.launcher import free_port
from pdserve.server.wire import CLUSTER_HEADER, KV_RESERVATION_HEADER

HOST = "127.0.0.1"
TOKENS = ["Hello", ",", " world"]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll until `predicate()` is truthy or the timeout passes; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


# ---- fake instances ------------------------------------------------------------------------------


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    disconnected: threading.Event = field(default_factory=threading.Event)
    cluster_secret: str | None = None  # the x-pdserve-cluster-secret header it came with


@dataclass
class Cluster:
    """What the fakes share: the decode addresses that exist and the transfers that are done."""

    addresses: set[str] = field(default_factory=set)
    transferred: set[str] = field(default_factory=set)


class UvicornThread:
    """An ASGI app served by uvicorn in a daemon thread (no signal handlers off the main thread)."""

    def __init__(self, app: Any, port: int) -> None:
        self.app, self.port = app, port
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        config = uvicorn.Config(
            self.app, host=HOST, port=self.port, log_level="warning", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not wait_for(lambda: self.server.started or not self.thread.is_alive()) or not self.server.started:
            raise RuntimeError(f"uvicorn did not start on port {self.port}")

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
            self.server = self.thread = None

    @property
    def is_running(self) -> bool:
        return self.thread is not None


class FakeInstance(UvicornThread):
    """A fake prefill or decode instance.

    Prefill modes: ok (marks the transfer done, answers 200), fail (500 kv_transfer_failed), bad (400),
    hang (answers nothing until the router hangs up). Decode modes: ok, reject (400 before reserving),
    no_header (200 without a reservation), die (two events, half a third, then the connection drops),
    endless (an event every 20 ms until the router hangs up), empty (a stream without events)."""

    def __init__(self, name: str, role: str, cluster: Cluster) -> None:
        self.name, self.role, self.cluster = name, role, cluster
        self.address = f"fake-kv://{name}"
        cluster.addresses.add(self.address)
        super().__init__(self._build_app(), free_port())
        self.reset()

    def reset(self) -> None:
        self.mode = "ok"
        self.healthy = True
        self.kv_usage = 0.0
        self.received: list[Received] = []
        self.sent = bytearray()  # decode: every body byte sent, over all requests

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok" if self.healthy else "down"}, 200 if self.healthy else 503)

        @app.get("/load")
        async def load() -> Response:
            if self.mode == "bad_load":
                return JSONResponse({"role": self.role, "num_running": -5, "num_waiting": 2**70, "kv_cache_usage": 7})
            report = wire.LoadReport(role=self.role, num_running=0, num_waiting=0, kv_cache_usage=self.kv_usage)
            return Response(msgspec.json.encode(report), media_type="application/json")

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})

        async def generate(request: Request) -> Response:
            rec = Received(request.url.path, json.loads(await request.body()),
                           cluster_secret=request.headers.get(CLUSTER_HEADER))
            self.received.append(rec)
            if self.role == "prefill":
                return await self._prefill(request, rec)
            return self._decode(rec)

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
        return app

    async def _prefill(self, request: Request, rec: Received) -> Response:
        if self.mode == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            rec.disconnected.set()
            return Response(status_code=499)
        if self.mode == "bad":
            return JSONResponse(error_body("bad prompt", "invalid_request_error", None), 400)
        if self.mode == "fail":
            return JSONResponse(error_body("KV transfer failed", "server_error", "kv_transfer_failed"), 500)
        remote = msgspec.convert(rec.body["kv_transfer_params"], wire.KVTransferParams).remote_decode
        assert remote is not None
        if remote.address not in self.cluster.addresses:
            return JSONResponse(error_body(f"unknown address {remote.address}", "server_error", None), 500)
        self.cluster.transferred.add(remote.transfer_id)
        return JSONResponse({"id": "cmpl-prefill", "choices": [{"index": 0, "text": "x"}]})

    def _decode(self, rec: Received) -> Response:
        if self.mode == "reject":
            body = error_body("prompt too long", "invalid_request_error", "context_length_exceeded")
            return JSONResponse(body, 400)
        transfer_id = msgspec.convert(rec.body["kv_transfer_params"], wire.KVTransferParams).transfer_id
        assert transfer_id is not None
        headers = {}
        if self.mode != "no_header":
            reservation = wire.KVReservation(  # the constructor does not check bounds: -3 goes out as is
                transfer_id=transfer_id,
                address=self.address,
                backend="shm",
                skip_tokens=-3 if self.mode == "bad_header" else 3,
            )
            headers[KV_RESERVATION_HEADER] = msgspec.json.encode(reservation).decode()
        stream = rec.body.get("stream") is True
        return StreamingResponse(
            self._decode_body(rec, transfer_id, stream),
            media_type="text/event-stream" if stream else "application/json",
            headers=headers,
        )

    async def _decode_body(self, rec: Received, transfer_id: str, stream: bool) -> Any:
        finished = False
        try:
            while transfer_id not in self.cluster.transferred:  # the KV has not arrived
                await asyncio.sleep(0.002)
            if not stream and self.mode == "error_body":  # the engine failed after the reservation
                body = json.dumps(error_body("the request failed in the engine", "server_error", "engine_error"))
                self.sent += body.encode()
                finished = True
                yield body.encode()
                return
            if not stream:
                choices = [{"index": 0, "text": "".join(TOKENS)}]
                body = json.dumps({"id": "cmpl-d", "choices": choices, "by": self.name})
                self.sent += body.encode()
                finished = True
                yield body.encode()
                return
            events = [sse_event(self.name, i, t) for i, t in enumerate(TOKENS)]
            if self.mode == "die":
                for piece in (events[0] + events[1], events[2][:12]):
                    self.sent += piece
                    yield piece
                    await asyncio.sleep(0.01)
                finished = True
                raise RuntimeError("fake decode instance dies mid-stream")
            if self.mode == "empty":
                finished = True
                return
            if self.mode == "endless":
                i = 0
                while True:
                    piece = sse_event(self.name, i, "x")
                    self.sent += piece
                    yield piece
                    i += 1
                    await asyncio.sleep(0.02)
            # Irregular chunks: half an event, then the rest with a whole one, then the end.
            pieces = [events[0][:10], events[0][10:] + events[1], events[2] + b"data: [DONE]\n\n"]
            for piece in pieces:
                self.sent += piece
                yield piece
                await asyncio.sleep(0.005)
            finished = True
        finally:
            if not finished:
                rec.disconnected.set()


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return msgspec.to_builtins(wire.ErrorBody(error=wire.ErrorInfo(message=message, type=type_, code=code)))


def sse_event(name: str, index: int, text: str) -> bytes:
    choices = [{"index": 0, "text": text}]
    chunk = {"id": "cmpl-d", "object": "text_completion", "by": name, "n": index, "choices": choices}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, FakeInstance]]:
    shared = Cluster()
    fakes = {
        "p1": FakeInstance("p1", "prefill", shared),
        "p2": FakeInstance("p2", "prefill", shared),
        "d1": FakeInstance("d1", "decode", shared),
        "d2": FakeInstance("d2", "decode", shared),
    }
    for f in fakes.values():
        f.start()
    yield fakes
    for f in fakes.values():
        f.stop()


@pytest.fixture
def fakes(cluster: dict[str, FakeInstance]) -> Iterator[dict[str, FakeInstance]]:
    for f in cluster.values():
        f.reset()
        if not f.is_running:
            f.start()
    yield cluster


@contextmanager
def run_router(
    prefill: list[FakeInstance | str], decode: list[FakeInstance | str], **kw: Any
) -> Iterator[tuple[str, Any]]:
    """The router app served on a free port; yields (its URL, the Router object)."""
    kw.setdefault("load_interval_s", 0.2)
    config = RouterConfig(
        prefill_urls=tuple(p if isinstance(p, str) else p.url for p in prefill),
        decode_urls=tuple(d if isinstance(d, str) else d.url for d in decode),
        **kw,
    )
    app = build_router_app(config)
    server = UvicornThread(app, free_port())
    server.start()
    try:
        yield server.url, app.state.router
    finally:
        server.stop()


def client() -> httpx.Client:
    return httpx.Client(timeout=20, trust_env=False)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: {(name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def outcome(url: str, name: str) -> float:
    return scrape(url).get(("pdserve:router_requests_total", (("outcome", name),)), 0.0)


def raw_request(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST over a plain socket, so the test can hang up whenever it wants."""
    data = json.dumps(body).encode()
    s = socket.create_connection((HOST, port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}


def kv_params(rec: Received) -> dict[str, Any]:
    return rec.body["kv_transfer_params"]


# ---- routing -------------------------------------------------------------------------------------


def test_stream_is_passed_through_and_both_instances_get_their_bodies(fakes):
    p, d = fakes["p1"], fakes["d1"]
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "n": 1, "seed": 7}
    with run_router([p], [d]) as (url, _), client() as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            got = b"".join(r.iter_bytes())
        assert got == bytes(d.sent)
        assert got.endswith(b"data: [DONE]\n\n") and got.count(b"data: ") == len(TOKENS) + 1

        [d_rec], [p_rec] = d.received, p.received
        transfer_id = kv_params(d_rec)["transfer_id"]
        assert re.fullmatch(r"[0-9a-f]{32}", transfer_id)
        assert d_rec.path == p_rec.path == "/v1/completions"
        remote_prefill = {"remote_prefill": True, "transfer_id": transfer_id}
        assert d_rec.body == {**body, "kv_transfer_params": remote_prefill}
        expected_p = {k: v for k, v in body.items() if k not in ("n", "stream_options")}
        expected_p.update(stream=False, max_tokens=1)
        expected_p["kv_transfer_params"] = {
            "remote_decode": {
                "transfer_id": transfer_id,
                "address": d.address,
                "backend": "shm",
                "skip_tokens": 3,
            }
        }
        assert p_rec.body == expected_p
        assert not d_rec.disconnected.is_set()


def test_chat_without_stream_returns_the_decode_json_body(fakes):
    p, d = fakes["p2"], fakes["d2"]
    with run_router([p], [d]) as (url, _), client() as c:
        r = c.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert r.content == bytes(d.sent)
        assert r.json()["by"] == "d2"
        [p_rec], [d_rec] = p.received, d.received
        assert p_rec.path == d_rec.path == "/v1/chat/completions"
        assert p_rec.body["stream"] is False
        assert p_rec.body["max_tokens"] == 1 and p_rec.body["max_completion_tokens"] == 1
        assert p_rec.body["messages"] == CHAT["messages"]
        assert kv_params(p_rec)["remote_decode"]["transfer_id"] == kv_params(d_rec)["transfer_id"]
        assert d_rec.body == {**CHAT, "kv_transfer_params": kv_params(d_rec)}


def test_decode_failure_after_the_reservation_is_5xx_not_200(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "error_body"
    with run_router([p], [d]) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 502
        assert r.json() == error_body("the request failed in the engine", "server_error", "engine_error")
        assert outcome(url, "failed") == 1 and outcome(url, "ok") == 0


def test_api_key_and_cluster_secret(fakes):
    p, d = fakes["p1"], fakes["d1"]
    with run_router([p], [d], api_key="sk-router-key", cluster_secret="s3cret-s3cret") as (url, _), client() as c:
        for headers in ({}, {"authorization": "Bearer nope-nope"}):
            r = c.post(url + "/v1/completions", json=COMPLETION, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get(url + "/v1/models", headers=headers).status_code == 401
        assert p.received == [] and d.received == []
        assert c.post(url + "/v1/completions", content=b"{}", headers={"content-type": "text/plain",
                      "authorization": "Bearer sk-router-key"}).status_code == 415
        r = c.post(url + "/v1/completions", json=COMPLETION, headers={"authorization": "Bearer sk-router-key"})
        assert r.status_code == 200
        assert [rec.cluster_secret for rec in p.received + d.received] == ["s3cret-s3cret"] * 2


def test_models_come_from_a_decode_instance(fakes):
    with run_router([fakes["p1"]], [fakes["d2"]]) as (url, _), client() as c:
        r = c.get(url + "/v1/models")
        assert r.status_code == 200
        assert r.json()["data"][0]["id"] == "model-of-d2"


def test_decode_4xx_is_passed_to_the_client(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "reject"
    with run_router([p], [d]) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 400
        assert r.json() == error_body("prompt too long", "invalid_request_error", "context_length_exceeded")
        assert p.received == []  # no reservation, so no prefill
        assert outcome(url, "rejected") == 1


def test_prefill_4xx_is_passed_to_the_client_without_retry(fakes):
    p1, p2, d = fakes["p1"], fakes["p2"], fakes["d1"]
    p1.mode = "bad"
    with run_router([p1, p2], [d]) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "bad prompt"
        assert p2.received == []
        assert wait_for(lambda: d.received[0].disconnected.is_set())


def test_rejects_several_choices_and_several_prompts(fakes):
    with run_router([fakes["p1"]], [fakes["d1"]]) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json={**COMPLETION, "n": 2})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "n"
        assert "not supported through the router" in r.json()["error"]["message"]
        for prompt in (["a", "b"], [[1, 2], [3]]):
            r = c.post(url + "/v1/completions", json={**COMPLETION, "prompt": prompt})
            assert r.status_code == 400
            assert "2 prompts is not supported through the router" in r.json()["error"]["message"]
        r = c.post(url + "/v1/chat/completions", json={**CHAT, "n": 3})
        assert r.status_code == 400
        r = c.post(url + "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        assert fakes["p1"].received == [] and fakes["d1"].received == []
        # One prompt in a list is one prompt.
        r = c.post(url + "/v1/completions", json={**COMPLETION, "prompt": [[1, 2, 3]]})
        assert r.status_code == 200


# ---- failures ------------------------------------------------------------------------------------


def test_prefill_failure_retries_on_another_pair(fakes):
    p1, p2, d = fakes["p1"], fakes["p2"], fakes["d1"]
    p1.mode = "fail"
    with run_router([p1, p2], [d], prefill_policy="round-robin") as (url, _), client() as c:
        with c.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200
            got = b"".join(r.iter_bytes())
        first, second = d.received
        assert wait_for(first.disconnected.is_set)  # the failed attempt's reservation was released
        assert not second.disconnected.is_set()
        assert got == bytes(d.sent)
        [p1_rec], [p2_rec] = p1.received, p2.received
        assert kv_params(p1_rec)["remote_decode"]["transfer_id"] == kv_params(first)["transfer_id"]
        assert kv_params(p2_rec)["remote_decode"]["transfer_id"] == kv_params(second)["transfer_id"]
        assert kv_params(first)["transfer_id"] != kv_params(second)["transfer_id"]
        metrics = scrape(url)
        assert metrics[("pdserve:router_retries_total", ())] == 1
        assert metrics[("pdserve:router_requests_total", (("outcome", "ok"),))] == 1


@pytest.mark.parametrize("stream", [True, False])
def test_prefill_failure_without_another_pair_returns_the_error(fakes, stream):
    p, d = fakes["p1"], fakes["d1"]
    p.mode = "fail"
    with run_router([p], [d], max_retries=1) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json={**COMPLETION, "stream": stream})
        assert r.status_code == 500
        assert r.json() == error_body("KV transfer failed", "server_error", "kv_transfer_failed")
        [d_rec] = d.received
        assert wait_for(d_rec.disconnected.is_set)  # D's request was closed: it aborts and frees its blocks
        assert len(p.received) == 1
        assert outcome(url, "failed") == 1


def test_missing_reservation_is_an_error(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "no_header"
    with run_router([p], [d], max_retries=0) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "bad_kv_reservation"
        assert KV_RESERVATION_HEADER in r.json()["error"]["message"]
        assert p.received == []
        assert wait_for(d.received[0].disconnected.is_set)


def test_malformed_instance_answers_are_dropped_and_counted(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "bad_header"
    with run_router([p], [d], max_retries=0) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 502 and r.json()["error"]["code"] == "bad_kv_reservation"
        assert p.received == []
        d.mode = "bad_load"
        assert wait_for(lambda: scrape(url).get(("pdserve:router_dropped_messages_total", (("kind", "load"),)), 0) >= 1)
        metrics = scrape(url)
        assert metrics[("pdserve:router_dropped_messages_total", (("kind", "kv_reservation"),))] == 1


def test_empty_decode_stream_ends_the_response(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "empty"
    with run_router([p], [d]) as (url, _), client() as c:
        r = c.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
        assert (r.status_code, r.content) == (200, b"")
        assert wait_for(lambda: outcome(url, "ok") == 1)


def test_decode_dying_mid_stream_ends_with_an_error_event(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "die"
    with run_router([p], [d]) as (url, _), client() as c:
        with c.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200
            got = b"".join(r.iter_bytes())
    complete = sse_event("d1", 0, TOKENS[0]) + sse_event("d1", 1, TOKENS[1])
    assert got.startswith(complete)
    rest = got[len(complete) :]  # the half event D sent before dying is not passed on
    events = rest.split(b"\n\n")
    assert events[1:] == [b"data: [DONE]", b""]
    error = json.loads(events[0].removeprefix(b"data: "))["error"]
    assert error["code"] == "decode_failed" and d.url in error["message"]


def test_client_disconnect_before_first_token_cancels_both(fakes):
    p, d = fakes["p1"], fakes["d1"]
    p.mode = "hang"
    with run_router([p], [d]) as (url, router):
        sock = raw_request(int(url.rsplit(":", 1)[1]), "/v1/completions", {**COMPLETION, "stream": True})
        assert wait_for(lambda: p.received)
        sock.close()
        assert wait_for(p.received[0].disconnected.is_set)
        assert wait_for(d.received[0].disconnected.is_set)
        assert wait_for(lambda: outcome(url, "cancelled") == 1)
        insts = router.instances["prefill"] + router.instances["decode"]
        assert wait_for(lambda: all(i.num_in_flight == 0 and i.num_outstanding_tokens == 0 for i in insts))


def test_client_disconnect_mid_stream_cancels_decode(fakes):
    p, d = fakes["p1"], fakes["d1"]
    d.mode = "endless"
    with run_router([p], [d]) as (url, router):
        sock = raw_request(int(url.rsplit(":", 1)[1]), "/v1/completions", {**COMPLETION, "stream": True})
        seen = b""
        while b"data: " not in seen:
            seen += sock.recv(4096)
        assert seen.startswith(b"HTTP/1.1 200")
        sock.close()
        assert wait_for(d.received[0].disconnected.is_set)
        assert wait_for(lambda: outcome(url, "cancelled") == 1)
        assert wait_for(lambda: router.instances["decode"][0].num_in_flight == 0)


# ---- health --------------------------------------------------------------------------------------


def test_no_prefill_or_no_decode_is_503(fakes):
    nobody = f"http://{HOST}:{free_port()}"
    with run_router([nobody], [fakes["d1"]]) as (url, _), client() as c:
        r = c.get(url + "/health")
        assert r.status_code == 503
        assert r.json()["error"] == f"no prefill instance is up (configured: {nobody})"
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and "no prefill instance is up" in r.json()["error"]["message"]
        assert fakes["d1"].received == []
        assert outcome(url, "unavailable") == 1
    with run_router([fakes["p1"]], [nobody]) as (url, _), client() as c:
        assert c.get(url + "/health").status_code == 503
        r = c.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and "no decode instance is up" in r.json()["error"]["message"]
        assert c.get(url + "/v1/models").status_code == 503


def test_unhealthy_instance_is_marked_down_then_up(fakes):
    p, d = fakes["p1"], fakes["d1"]
    with run_router([p], [d], load_interval_s=0.05) as (url, _), client() as c:
        assert c.get(url + "/health").status_code == 200
        d.healthy = False
        assert wait_for(lambda: c.get(url + "/health").status_code == 503)
        assert scrape(url)[("pdserve:router_instance_up", (("role", "decode"), ("url", d.url)))] == 0
        r = c.post(url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 503
        assert d.received == []
        d.healthy = True
        assert wait_for(lambda: c.get(url + "/health").status_code == 200)
        assert c.post(url + "/v1/completions", json=COMPLETION).status_code == 200
        d.stop()  # refused connections: down; back on the same port: up
        assert wait_for(lambda: c.get(url + "/health").status_code == 503)
        assert "GET /health failed: ConnectError" in c.get(url + "/health").json()["decode"][0]["down_reason"]
        d.start()
        assert wait_for(lambda: c.get(url + "/health").status_code == 200)
        assert c.post(url + "/v1/completions", json=COMPLETION).status_code == 200


def test_connect_error_marks_decode_down_and_retries_on_another(fakes):
    p, d1, d2 = fakes["p1"], fakes["d1"], fakes["d2"]
    # No polling after startup: only the failed request can mark d1 down.
    with (
        run_router([p], [d1, d2], decode_policy="round-robin", load_interval_s=3600) as (url, router),
        client() as c,
    ):
        d1.stop()
        with c.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200
            got = b"".join(r.iter_bytes())
        assert got == bytes(d2.sent) and b'"by": "d2"' in got
        d1_state = router.instances["decode"][0]
        assert not d1_state.is_up and "connection failed" in d1_state.down_reason
        health = c.get(url + "/health").json()
        assert [i["up"] for i in health["decode"]] == [False, True]
        assert scrape(url)[("pdserve:router_retries_total", ())] == 1


# ---- policies ------------------------------------------------------------------------------------


def test_policies_pick_expected_instances():
    a, b, c = (Instance(f"http://{n}", "decode") for n in "abc")
    rr = RoundRobin()
    assert [rr.select([a, b, c]).url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]

    a.num_outstanding_tokens, b.num_outstanding_tokens, c.num_outstanding_tokens = 500, 20, 20
    b.num_in_flight, c.num_in_flight = 3, 1
    assert LeastOutstandingTokens().select([a, b, c]) is c  # fewest tokens, then fewest requests

    a.kv_cache_usage, b.kv_cache_usage, c.kv_cache_usage = 0.1, 0.1, 0.7
    a.num_in_flight = 5
    assert LeastKVUsage().select([a, b, c]) is b  # least KV usage, then the router's in-flight count
    c.kv_cache_usage = 0.0
    assert LeastKVUsage().select([a, b, c]) is c

    assert isinstance(make_policy("round-robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown instance policy 'fastest'"):
        make_policy("fastest")


def test_router_follows_kv_usage_and_outstanding_tokens(fakes):
    p1, p2, d1, d2 = fakes["p1"], fakes["p2"], fakes["d1"], fakes["d2"]
    d1.kv_usage, d2.kv_usage = 0.9, 0.1
    with run_router([p1, p2], [d1, d2], load_interval_s=0.05) as (url, router), client() as c:
        assert wait_for(lambda: router.instances["decode"][1].kv_cache_usage == 0.1)
        for _ in range(2):
            assert c.post(url + "/v1/completions", json=COMPLETION).status_code == 200
        assert (len(d1.received), len(d2.received)) == (0, 2)
        d1.kv_usage = 0.0
        assert wait_for(lambda: router.instances["decode"][0].kv_cache_usage == 0.0)
        assert c.post(url + "/v1/completions", json=COMPLETION).status_code == 200
        assert len(d1.received) == 1

        # A long prompt held on p1 makes p2 the prefill instance with the fewest outstanding tokens.
        p1.reset()
        p2.reset()
        p1.mode = "hang"
        long_prompt = {**COMPLETION, "prompt": "word " * 400}
        sock = raw_request(int(url.rsplit(":", 1)[1]), "/v1/completions", long_prompt)
        assert wait_for(lambda: p1.received)
        assert router.instances["prefill"][0].num_outstanding_tokens == len(long_prompt["prompt"]) // 4
        assert c.post(url + "/v1/completions", json=COMPLETION).status_code == 200
        assert len(p2.received) == 1 and len(p1.received) == 1
        sock.close()
        assert wait_for(lambda: router.instances["prefill"][0].num_outstanding_tokens == 0)


# ---- metrics, config, CLI ------------------------------------------------------------------------


def test_injected_transport_replaces_the_network():
    """build_router_app's transport: the instances here are an httpx.MockTransport, not servers."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/load":
            load = wire.LoadReport(role="both", num_running=0, num_waiting=0, kv_cache_usage=0)
            return httpx.Response(200, content=msgspec.json.encode(load))
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "d":
            transfer_id = body["kv_transfer_params"]["transfer_id"]
            reservation = wire.KVReservation(transfer_id=transfer_id, address="a", backend="tcp", skip_tokens=0)
            headers = {KV_RESERVATION_HEADER: msgspec.json.encode(reservation).decode()}
            return httpx.Response(200, json={"text": "from d"}, headers=headers)
        return httpx.Response(200, json={"text": "from p"})

    config = RouterConfig(prefill_urls=("http://p",), decode_urls=("http://d",))
    app = build_router_app(config, transport=httpx.MockTransport(handler))
    server = UvicornThread(app, free_port())
    server.start()
    try:
        r = httpx.post(server.url + "/v1/completions", json=COMPLETION, trust_env=False, timeout=20)
    finally:
        server.stop()
    assert (r.status_code, r.json()) == (200, {"text": "from d"})
    assert [host for host, _ in seen] == ["d", "p"]
    assert seen[1][1]["kv_transfer_params"]["remote_decode"]["backend"] == "tcp"


def test_metrics_describe_requests_and_instances(fakes):
    p, d = fakes["p1"], fakes["d1"]
    with run_router([p], [d]) as (url, _), client() as c:
        assert c.post(url + "/v1/completions", json={**COMPLETION, "stream": True}).status_code == 200
        m = scrape(url)
        assert m[("pdserve:router_requests_total", (("outcome", "ok"),))] == 1
        assert m[("pdserve:router_instance_up", (("role", "prefill"), ("url", p.url)))] == 1
        assert m[("pdserve:router_instance_up", (("role", "decode"), ("url", d.url)))] == 1
        assert m[("pdserve:router_requests_in_flight", (("role", "decode"), ("url", d.url)))] == 0
        for name in ("time_to_kv_reservation", "prefill_request", "time_to_first_byte"):
            assert m[(f"pdserve:router_{name}_seconds_count", ())] == 1


def test_config_is_validated():
    cfg = RouterConfig(prefill_urls=("http://a:1/",), decode_urls=["http://b:2"])  # type: ignore[arg-type]
    assert cfg.prefill_urls == ("http://a:1",) and cfg.decode_urls == ("http://b:2",)
    with pytest.raises(ValueError, match="at least one decode"):
        RouterConfig(prefill_urls=("http://a",), decode_urls=())
    with pytest.raises(ValueError, match="must start with http"):
        RouterConfig(prefill_urls=("a:1",), decode_urls=("http://b",))
    with pytest.raises(ValueError, match="must not repeat"):
        RouterConfig(prefill_urls=("http://a", "http://a/"), decode_urls=("http://b",))
    with pytest.raises(ValueError, match="unknown instance policy"):
        RouterConfig(prefill_urls=("http://a",), decode_urls=("http://b",), decode_policy="fastest")
    with pytest.raises(ValueError, match="max_retries"):
        RouterConfig(prefill_urls=("http://a",), decode_urls=("http://b",), max_retries=-1)


def test_cli_refuses_bad_urls(capsys):
    assert cli_main(["router", "--prefill", "http://a:1,ftp://b", "--decode", "http://c:2"]) == 2
    assert "ftp://b" in capsys.readouterr().err
