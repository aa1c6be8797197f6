"""Disaggregation with real processes: prefill and decode instances (`pdserve serve --role ...`) behind
`pdserve router`, on a tiny random model with the real tokenizer.

- Greedy output through 1P1D equals colocated output on every backend (shm, tcp, torch.distributed).
- `pdserve serve --disagg 1p1d` brings a working cluster up in one command.
- Faults, on every backend and with non-streaming requests beside the streams: kill -9 a decode instance
  mid-stream and mid-transfer, a prefill instance mid-prefill; and abort 100 streams at random moments. After each: every client got an answer or an error within a bound,
  block usage is back to zero on every surviving instance, and the router keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time

import httpx
import pytest

from pdserve.server.launcher import ServerProcess
from tests.support.server import MODEL, quiet_env, scrape, tiny_server_args, wait_for

PROMPTS = [
    "The capital of France is",
    "Write a poem about the sea. " * 6,
    "1, 2, 3, 4, 5,",
    "A very long story begins like this: " * 12,
]


SECRET = "disagg-test-cluster-secret"
ROUTER = {"x-pdserve-cluster-secret": SECRET}  # what the router sends: /load needs it


def cluster_env() -> dict[str, str]:
    return {**quiet_env(), "PDSERVE_CLUSTER_SECRET": SECRET}


def instance(role: str, backend: str, *extra: str) -> ServerProcess:
    return ServerProcess(
        tiny_server_args("--role", role, "--kv-transfer", backend, "--kv-ack-timeout", "3", "--kv-lease", "20", *extra),
        env=cluster_env(),
    )


def router(prefills: list[ServerProcess], decodes: list[ServerProcess]) -> ServerProcess:
    args = ["--prefill", ",".join(p.url for p in prefills), "--decode", ",".join(d.url for d in decodes),
            "--load-interval", "0.2", "--request-timeout", "30"]
    return ServerProcess(args, env=cluster_env(), command="router")


class Cluster:
    def __init__(self, backend: str, num_prefill: int = 1, num_decode: int = 1) -> None:
        self.prefills = [instance("prefill", backend) for _ in range(num_prefill)]
        self.decodes = [instance("decode", backend) for _ in range(num_decode)]
        for s in self.prefills + self.decodes:
            s.start()
        for s in self.prefills + self.decodes:
            s.wait_ready()
        self.router = router(self.prefills, self.decodes).start().wait_ready()
        self.url = self.router.url

    def close(self) -> None:
        for s in [self.router, *self.prefills, *self.decodes]:
            s.close()

    def alive_instances(self) -> list[ServerProcess]:
        return [s for s in self.prefills + self.decodes if s.proc is not None and s.proc.poll() is None]

    def assert_idle(self, timeout: float = 15.0) -> None:
        """Every surviving instance holds no request and no block."""
        for s in self.alive_instances():
            def idle(s: ServerProcess = s) -> bool:
                load = httpx.get(s.url + "/load", headers=ROUTER, timeout=5).json()
                return load["num_running"] == 0 and load["num_waiting"] == 0 and load["kv_cache_usage"] == 0.0 \
                    and load["num_in_flight"] == 0
            assert wait_for(idle, timeout), (s.url, httpx.get(s.url + "/load", headers=ROUTER).json())


def completion(url: str, prompt: str, max_tokens: int = 12, stream: bool = False, timeout: float = 60) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


def chat(url: str, content: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def colocated():
    with ServerProcess(tiny_server_args(), env=quiet_env()) as s:
        yield s.url


@pytest.mark.parametrize("backend", ["shm", "tcp", "torch.distributed"])
def test_1p1d_greedy_equals_colocated(colocated, backend):
    c = Cluster(backend)
    try:
        for prompt in PROMPTS:
            want = completion(colocated, prompt)
            assert completion(c.url, prompt) == want
            assert completion(c.url, prompt, stream=True) == want  # the second time: a prefix-cache hit on D
        assert chat(c.url, "Hello! Who are you?") == chat(colocated, "Hello! Who are you?")
        c.assert_idle()
        metrics = httpx.get(c.prefills[0].url + "/metrics").text
        assert 'pdserve:kv_transfers_total{direction="send",model_name="tiny",outcome="ok"} 9.0' in metrics
        # The router shows every instance's transfer figures (from their /load).
        p_url, d_url = c.prefills[0].url, c.decodes[0].url
        want = f'pdserve:router_instance_kv_transfers{{direction="send",outcome="ok",role="prefill",url="{p_url}"}} 9.0'
        assert wait_for(lambda: want in httpx.get(c.url + "/metrics").text), httpx.get(c.url + "/metrics").text
        router_metrics = httpx.get(c.url + "/metrics").text
        received = re.search(
            rf'pdserve:router_instance_kv_transfer_bytes{{direction="receive",role="decode",url="{d_url}"}} (\S+)',
            router_metrics,
        )
        assert received and float(received.group(1)) > 0
    finally:
        c.close()


def test_serve_disagg_one_command(colocated):
    with ServerProcess(tiny_server_args("--disagg", "1p1d"), env=quiet_env()) as s:
        assert completion(s.url, PROMPTS[0], stream=True) == completion(colocated, PROMPTS[0])
        assert httpx.get(s.url + "/health").status_code == 200
        # structured outputs: the prefill instance's first token and the decode instance's rest under one
        # constraint each compiles for itself
        schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                  "required": ["a", "b"]}
        for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                      {"structured_outputs": {"regex": "[a-z]{3,8}-[0-9]{3}"}}):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in the format."}],
                    "max_tokens": 24, "temperature": 0, **extra}
            got = [httpx.post(url + "/v1/chat/completions", json=body, timeout=60) for url in (s.url, colocated)]
            assert [r.status_code for r in got] == [200, 200], got[0].text
            texts = [r.json()["choices"][0]["message"]["content"] for r in got]
            assert texts[0] == texts[1] and texts[0]
        # `pdserve top` on the router: the router's row, then each instance it names, with its role
        from pdserve.dashboard import Poller

        poller = Poller([s.url])
        try:
            rows = poller.poll()
        finally:
            poller.close()
        assert (rows[0].role, rows[0].up) == ("router", True)
        assert sorted((w.role, w.up) for w in rows[1:]) == [("decode", True), ("prefill", True)]
        # tool calling: a named function's arguments under its schema, through the router
        tool = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Look it up."}], "max_tokens": 24,
                "temperature": 0, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
        got = [httpx.post(url + "/v1/chat/completions", json=body, timeout=60) for url in (s.url, colocated)]
        assert [r.status_code for r in got] == [200, 200], got[0].text
        calls = [r.json()["choices"][0]["message"]["tool_calls"] for r in got]
        assert [[(c["function"]["name"], c["function"]["arguments"]) for c in cs] for cs in calls] == [
            [("lookup", calls[1][0]["function"]["arguments"])]] * 2


async def _stream_until_cut(url: str, prompt: str, max_tokens: int, cut_after: float | None) -> str:
    """Stream one completion; give up after `cut_after` seconds (client abort). Returns how it ended."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async def run() -> str:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"http {r.status_code}"
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and "error" in json.loads(line[6:]):
                        return "error event"
                    if line == "data: [DONE]":
                        return "done"
            return "closed"

        try:
            return await asyncio.wait_for(run(), cut_after) if cut_after is not None else await run()
        except asyncio.TimeoutError:
            return "aborted"


def test_abort_100_streams_at_random_moments():
    c = Cluster("shm")
    try:
        rng = random.Random(0)

        async def all_streams() -> list[str]:
            return await asyncio.gather(*(
                _stream_until_cut(c.url, rng.choice(PROMPTS), 40, rng.uniform(0.0, 1.5)) for _ in range(100)
            ))

        t0 = time.monotonic()
        ends = asyncio.run(all_streams())
        assert time.monotonic() - t0 < 60
        assert ends.count("aborted") > 10 and all(e in ("aborted", "done") for e in ends), ends
        c.assert_idle()
        assert completion(c.url, PROMPTS[0])  # still serving
    finally:
        c.close()


async def _whole(url: str, prompt: str, max_tokens: int) -> str:
    """One non-streaming completion: "ok", or "http <status>" for an error answer (never a 200 that
    carries an error: a failure after the decode side's reservation is a 5xx too)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        try:
            r = await client.post(url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}"
    if r.status_code == 200:
        assert "error" not in r.json() and r.json()["choices"][0]["text"], r.text
        return "ok"
    assert "error" in r.json(), r.text
    return f"http {r.status_code}"


def _kill(s: ServerProcess) -> None:
    """kill -9 the instance: its HTTP front and its engine core."""
    for pid in s.engine_pids() + [s.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert s.proc is not None
    s.proc.wait(10)


BACKENDS = ["shm", "tcp", "torch.distributed"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_decode_mid_stream_and_mid_transfer(backend):
    c = Cluster(backend, num_prefill=1, num_decode=2)
    try:
        # Mid-stream: a long generation on some decode instance, and a whole (non-streaming) one beside it;
        # kill whichever decode instance holds a request.
        async def one() -> str:
            return await _stream_until_cut(c.url, PROMPTS[1], 400, None)

        async def kill_busy_decode() -> tuple[str, str]:
            task = asyncio.ensure_future(one())
            whole = asyncio.ensure_future(_whole(c.url, PROMPTS[0], 300))
            busy = None
            for _ in range(200):
                await asyncio.sleep(0.05)
                loads = [httpx.get(d.url + "/load", headers=ROUTER).json() for d in c.decodes]
                busy = next((d for d, l in zip(c.decodes, loads) if l["num_running"]), None)
                if busy is not None:
                    break
            assert busy is not None
            _kill(busy)
            return await asyncio.wait_for(task, 30), await asyncio.wait_for(whole, 30)

        t0 = time.monotonic()
        streamed, whole = asyncio.run(kill_busy_decode())
        assert streamed in ("error event", "closed", "done"), streamed  # done: it was on the other one
        assert whole in ("ok", "http 502", "http 500"), whole
        # The killed instance held one of them at least: that one was cut, or, when nothing of it had
        # reached its client yet (still prefilling or in transfer), the router retried it on the other pair.
        assert not (streamed == "done" and whole == "ok") or scrape(c.url)["pdserve:router_retries_total"] >= 1
        assert time.monotonic() - t0 < 30
        survivor = next(d for d in c.decodes if d.proc is not None and d.proc.poll() is None)
        # Mid-transfer: freeze the surviving decode instance after it reserved blocks, then kill it. The
        # prefill side's ack times out and frees its blocks; the client gets an error.
        os.kill(survivor.engine_pids()[0], signal.SIGSTOP)
        try:
            with pytest.raises((httpx.HTTPError, AssertionError)):
                completion(c.url, PROMPTS[3], timeout=8)
        finally:
            _kill(survivor)
        c.assert_idle()  # the prefill instance let go of everything
        # No decode instance left: the router says so clearly.
        assert wait_for(lambda: httpx.get(c.url + "/health").status_code == 503, 10)
        r = httpx.post(c.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
    finally:
        c.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_prefill_mid_prefill_router_retries_on_the_other(backend):
    c = Cluster(backend, num_prefill=2, num_decode=1)
    try:
        victim = c.prefills[0]
        os.kill(victim.engine_pids()[0], signal.SIGSTOP)  # requests sent to it now hang mid-prefill

        async def run() -> list[str]:
            tasks = [asyncio.ensure_future(_stream_until_cut(c.url, p, 8, None)) for p in PROMPTS]
            tasks += [asyncio.ensure_future(_whole(c.url, p, 8)) for p in PROMPTS]  # and whole ones
            await asyncio.sleep(1.0)
            _kill(victim)
            return await asyncio.wait_for(asyncio.gather(*tasks), 40)

        ends = asyncio.run(run())
        assert all(e in ("done", "ok", "http 500", "http 502", "error event") for e in ends), ends
        assert sum(e in ("done", "ok") for e in ends) >= len(ends) // 2
        c.assert_idle()
        assert completion(c.url, PROMPTS[2])  # the other prefill instance keeps serving
    finally:
        c.close()
