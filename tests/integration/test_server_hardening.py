"""A hostile client on the same host cannot crash, stall or read another's work: malformed messages on the
KV socket, hostile request bodies, a dying engine core. One decode-role instance (tcp KV) for the module:
it also serves ordinary requests."""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import msgspec
import pytest
import zmq

from pdserve.server.launcher import ServerProcess
from tests.support.server import MODEL, quiet_env, scrape, tiny_server_args, wait_for


API_KEY = "sk-test-0123456789"
SECRET = "cluster-secret-0123456789"
AUTH = {"authorization": f"Bearer {API_KEY}"}
ROUTER = {"x-pdserve-cluster-secret": SECRET}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        tiny_server_args(
            "--role", "decode", "--kv-transfer", "tcp", "--stats-interval", "0", "--request-timeout", "3",
            "--allowed-hosts", "127.0.0.1,localhost", "--read-timeout", "2",
        ),
        env={**quiet_env(), "PDSERVE_API_KEY": API_KEY, "PDSERVE_CLUSTER_SECRET": SECRET},
    )
    srv.start()
    try:
        yield srv.wait_ready()
    finally:
        srv.close()


def generate(url: str, **extra) -> httpx.Response:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)


def test_malformed_kv_messages_are_dropped_and_counted(server):
    address = httpx.get(server.url + "/load", headers=ROUTER).json()["kv_address"]
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


def post(url: str, content: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type, **AUTH} if content_type else dict(AUTH)
    return httpx.post(url + "/v1/completions", content=content, headers=headers, timeout=30)


def body(**fields) -> bytes:  # type: ignore[no-untyped-def]
    return json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**70}, "top_k"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"n": 2**70}, "n"),
        ({"logprobs": 2**70}, "logprobs"),
        ({"stop": ["x"] * 20_000}, "stop"),
        ({"stop": ["x" * 5000]}, "stop"),
        ({"stop_token_ids": list(range(1000))}, "stop_token_ids"),
        ({"prompt": [2**70]}, "prompt"),
    ],
)
def test_out_of_range_fields_are_400(server, fields, param):
    r = post(server.url, body(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_seeds_wrap_within_int64_so_n2_runs_both_choices(server):
    r = post(server.url, body(seed=2**63 - 1, n=2, temperature=1.0))
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    wait_for(lambda: httpx.get(server.url + "/health").json()["num_requests_in_flight"] == 0)
    assert httpx.get(server.url + "/health").json()["num_requests_in_flight"] == 0


def test_deeply_nested_json_is_400(server):
    r = post(server.url, b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}")
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_body_limit_is_413(server):
    r = post(server.url, body(prompt="x" * (32 * 2**20)))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_long_text_is_refused_before_tokenizing(server):
    r = post(server.url, body(prompt="word " * 200_000))  # 1 MB: under the body limit, far over 512 tokens
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_posts_are_415(server, content_type):
    r = post(server.url, body(), content_type)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert post(server.url, body(), "application/json; charset=utf-8").status_code == 200


def test_foreign_host_is_refused(server):
    r = httpx.get(server.url + "/v1/models", headers={"host": "attacker.example", **AUTH})
    assert r.status_code == 400
    ok = httpx.get(server.url + "/v1/models", headers={"host": f"localhost:{server.port}", **AUTH})
    assert ok.status_code == 200


def test_models_disclose_no_path(server):
    card = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert "/" not in json.dumps(card)


def test_request_timeout_aborts_the_request(server):
    (engine_pid,) = server.engine_pids()
    os.kill(engine_pid, signal.SIGSTOP)  # nothing will come from the engine
    try:
        r = post(server.url, body())
        with httpx.stream("POST", server.url + "/v1/completions", content=body(stream=True),
                          headers={"content-type": "application/json", **AUTH}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
    assert wait_for(lambda: httpx.get(server.url + "/health").json()["num_requests_in_flight"] == 0)
    assert post(server.url, body()).status_code == 200


def _read_all(sock: socket.socket, timeout: float = 15.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_half_sent_head_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
        assert _read_all(sock) == b""  # closed by the server (a timeout here would raise)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # an idle connection, no bytes at all
        assert _read_all(sock) == b""


def test_half_sent_body_is_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        sock.settimeout(15)
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong-key-000"}, {"authorization": API_KEY},
                                     {"x-pdserve-cluster-secret": "wrong-secret-000"}])
def test_api_key_is_required(server, headers):
    r = httpx.post(server.url + "/v1/completions", content=body(), timeout=30,
                   headers={"content-type": "application/json", **headers})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open


def test_kv_transfer_params_and_load_only_from_the_router(server):
    kv = {"remote_prefill": True, "transfer_id": "abc123"}
    r = post(server.url, body(kv_transfer_params=kv))  # a client with the API key, but not the router
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_the_router"
    assert "x-pdserve-kv-reservation" not in r.headers
    load = httpx.get(server.url + "/load", headers=AUTH)
    assert load.status_code == 403 and "kv_address" not in load.text
    # The router (it holds the cluster secret) gets its reservation.
    with httpx.stream("POST", server.url + "/v1/completions", content=body(kv_transfer_params=kv), timeout=30,
                      headers={"content-type": "application/json", **ROUTER}) as r:
        assert r.status_code == 200
        reservation = json.loads(r.headers["x-pdserve-kv-reservation"])
    assert reservation["transfer_id"] == "abc123"
    assert wait_for(lambda: httpx.get(server.url + "/health").json()["num_requests_in_flight"] == 0)
