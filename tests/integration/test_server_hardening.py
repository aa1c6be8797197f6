"""A hostile client on the same host cannot crash, stall or read another's work: malformed messages on the
KV socket, hostile request bodies, a dying engine core. One decode-role instance (tcp KV) for the module:
it also serves ordinary requests."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq

from pdserve.server.launcher import ServerProcess
from tests.integration.test_server import MODEL, quiet_env, scrape, tiny_server_args, wait_for


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        tiny_server_args("--role", "decode", "--kv-transfer", "tcp", "--stats-interval", "0"), env=quiet_env()
    )
    srv.start()
    try:
        yield srv.wait_ready()
    finally:
        srv.close()


def generate(url: str, **extra) -> httpx.Response:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_malformed_kv_messages_are_dropped_and_counted(server):
    address = httpx.get(server.url + "/load").json()["kv_address"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        garbage = [[msgspec.msgpack.encode(["chunk", []])], [b"chunk", b"[]"], [b"\xc1"],
                   [msgspec.msgpack.encode(["done", "x", -1, None])], [msgspec.msgpack.encode(["hello", "", 0, 0])]]
        for frames in garbage:
            sock.send_multipart(frames)
        # The loop only polls its transport while a transfer is open or a step runs: give it work.
        assert generate(server.url).status_code == 200
        assert wait_for(lambda: scrape(server.url).get("pdserve:dropped_messages_total", 0) >= len(garbage))
    finally:
        sock.close()
        ctx.term()
    assert scrape(server.url)["pdserve:dropped_messages_total"] == len(garbage)
    assert httpx.get(server.url + "/health").status_code == 200
    assert generate(server.url).status_code == 200
