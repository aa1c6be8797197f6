"""The server when things go wrong: overload, and the engine core process dying (the front restarts it,
backing off when it dies again soon). Shutdown by SIGINT is the last test of test_server.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from pdserve.server.launcher import ServerProcess
from tests.support.server import MODEL, quiet_env, scrape, tiny_server_args, wait_for


@pytest.fixture(scope="module")
def server():
    """One server for the module; the last test kills its engine core."""
    srv = ServerProcess(
        tiny_server_args("--max-waiting", "1", "--stats-interval", "0", "--heartbeat-timeout", "2"), env=quiet_env()
    )
    srv.start()
    try:
        yield srv.wait_ready()
    finally:
        srv.close()


def test_overload_is_503_then_serves_again(server):
    srv = server
    prompt = " ".join(f"token{i}" for i in range(120))  # a few hundred tokens: each prefill takes a while
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as c:
            return await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body) for _ in range(24)))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1, codes
    assert codes.count(200) >= 1, codes
    refused = next(r for r in responses if r.status_code == 503)
    err = refused.json()["error"]
    assert err["code"] == "overloaded" and err["type"] == "server_error" and "--max-waiting" in err["message"]
    assert refused.headers.get("retry-after") == "1"
    ok = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert ok.status_code == 200
    too_many = httpx.post(srv.url + "/v1/completions", json={**body, "n": 2}, timeout=30)  # can never fit
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    metrics = scrape(srv.url)
    assert metrics["pdserve:request_rejected_total"] == codes.count(503)
    health = wait_for(
        lambda: (h := httpx.get(srv.url + "/health").json())["num_requests_in_flight"] == 0 and h
    )
    assert health and health["status"] == "ok"


def test_a_frozen_engine_loop_is_unhealthy(server):
    (engine_pid,) = server.engine_pids()
    assert httpx.get(server.url + "/health").status_code == 200
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        stale = wait_for(lambda: (r := httpx.get(server.url + "/health")).status_code == 503 and r, timeout=15)
        assert stale and "not been heard from" in stale.json()["error"]
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, timeout=10)


def test_engine_death_fails_requests_and_health(server):
    srv = server
    (engine_pid,) = srv.engine_pids()
    long = {"model": MODEL, "prompt": "Go on and on", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    whole: dict[str, httpx.Response] = {}
    waiter = threading.Thread(
        target=lambda: whole.setdefault("r", httpx.post(srv.url + "/v1/completions", json=long, timeout=30))
    )
    with httpx.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        waiter.start()
        assert wait_for(
            lambda: httpx.get(srv.url + "/health").json()["num_requests_in_flight"] == 2, timeout=10
        )
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    # A liveness bound, not a speed figure: the streams end on the engine's death, long before the
    # client's 30 s timeout that a hang would run into.
    assert time.monotonic() - killed < 20
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: ") :])["error"]
    assert "died" in err["message"] and err["code"] == "engine_unavailable"
    waiter.join(10)
    assert whole["r"].status_code == 503 and "died" in whole["r"].json()["error"]["message"]

    health = httpx.get(srv.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "restarting"
    # Refused at once (a request queued for a dead engine would run into the 10 s timeout instead).
    refused = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"

    # A new core comes up and serves; the old one's requests are not resurrected.
    assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=60)
    h = httpx.get(srv.url + "/health").json()
    assert h["num_engine_restarts"] == 1 and h["num_requests_in_flight"] == 0
    (new_pid,) = srv.engine_pids()
    assert new_pid != engine_pid
    ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert scrape(srv.url)["pdserve:engine_restarts_total"] == 1

    # Dying again soon after: the next restart waits longer (0.5 s, then 1 s, ...).
    os.kill(new_pid, signal.SIGKILL)
    assert wait_for(lambda: "restart_in_s" in httpx.get(srv.url + "/health").json(), timeout=5)
    assert httpx.get(srv.url + "/health").json()["restart_delay_s"] == 1.0
    assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=60)
    assert srv.stop(signal.SIGTERM, timeout=20) == 0  # the front still shuts down cleanly
