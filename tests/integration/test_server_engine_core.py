"""The engine core loop in-process (a thread instead of a process, real ZMQ sockets): a request that fails
in the engine, or that the engine refuses, errors for itself only, and the loop keeps serving the rest."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import msgspec
import pytest
import zmq

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from pdserve.engine.process.core import CoreAddresses, EngineCore
from pdserve.engine.process.messages import AbortRequests, AddRequest, CoreMessage, EngineOutputs, Ready, Shutdown
from tests.support.tiny import TINY

POISON = 7  # a prompt holding this token id makes the model runner raise


class FailingRunner:
    """Wraps the engine's runner: any step that schedules a poisoned prompt fails."""

    def __init__(self, runner) -> None:  # type: ignore[no-untyped-def]
        self.runner = runner

    def execute(self, sched, after_layer=None):  # type: ignore[no-untyped-def]
        if any(POISON in s.req.prompt_token_ids for s in sched.scheduled):
            raise RuntimeError("injected failure")
        return self.runner.execute(sched)

    def release(self, req_id: str) -> None:
        self.runner.release(req_id)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.runner, name)  # the rest of the executor interface (swaps, draws)


@pytest.fixture
def core(tiny_weights):
    # The default policy (`chunked`): the poisoned prompt shares its step with the running decode, and
    # the engine replays that step request by request to fail only the prompt.
    config = EngineConfig(
        dtype="float32", device="cpu", num_threads=1, cache=CacheConfig(block_size=4, num_blocks=128)
    )
    engine = LLMEngine(config, model_config=TINY, weights=tiny_weights)
    engine.runner = FailingRunner(engine.runner)
    tmp = tempfile.mkdtemp(prefix="pdserve-test-")
    addresses = CoreAddresses(f"ipc://{tmp}/in", f"ipc://{tmp}/out")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(addresses.input)
    pull.bind(addresses.output)
    core = EngineCore(engine, addresses, os.getppid())
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreMessage)

    class Front:
        def send(self, msg) -> None:  # type: ignore[no-untyped-def]
            push.send(encoder.encode(msg))

        def recv(self, timeout_s: float = 10.0) -> Ready | EngineOutputs:
            assert pull.poll(int(timeout_s * 1000)), "no message from the core"
            return decoder.decode(pull.recv())

    front = Front()
    front.engine = engine  # type: ignore[attr-defined]
    front.push = push  # type: ignore[attr-defined]
    assert isinstance(front.recv(), Ready)
    try:
        yield front
    finally:
        front.send(Shutdown())
        thread.join(10)
        core.close()
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _add(front, req_id: str, prompt: list[int], max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    front.send(AddRequest(req_id, prompt, params, time.monotonic()))


def test_failures_stay_with_their_request(core):
    _add(core, "good", [1, 2, 3, 4, 5], 30)
    tokens: dict[str, int] = {}
    finished: dict[str, object] = {}
    deadline = time.monotonic() + 20
    sent_bad = False
    while "good" not in finished and time.monotonic() < deadline:
        msg = core.recv()
        assert isinstance(msg, EngineOutputs)
        for d in msg.deltas:
            tokens[d.req_id] = tokens.get(d.req_id, 0) + len(d.new_token_ids)
            if d.finish_reason is not None:
                finished[d.req_id] = d
        if not sent_bad and tokens.get("good", 0) >= 3:
            _add(core, "poisoned", [1, POISON, 3], 10)  # fails, in a step it shares with "good"
            _add(core, "too-long", [1] * 600, 10)  # past the context: refused by the engine
            _add(core, "out-of-vocab", [1, 10_000], 10)
            sent_bad = True
    good = finished["good"]
    assert good.finish_reason == "length" and tokens["good"] == 30
    poisoned = finished["poisoned"]
    assert poisoned.finish_reason == "error" and "injected failure" in poisoned.error and not poisoned.invalid
    for req_id in ("too-long", "out-of-vocab"):
        assert finished[req_id].finish_reason == "error" and finished[req_id].invalid
    assert msg.stats.kv_cache_usage == 0.0 and msg.stats.num_running == 0


def test_abort_frees_blocks_before_the_next_step(core):
    _add(core, "long", [1, 2, 3, 4, 5], 400)
    while True:
        msg = core.recv()
        if msg.stats.kv_cache_usage > 0:
            break
    core.send(AbortRequests(["long"]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        msg = core.recv()
        assert all(d.req_id != "long" or d.finish_reason is None for d in msg.deltas)  # no output after abort
        if msg.stats.kv_cache_usage == 0.0 and msg.stats.num_running == 0:
            break
    assert msg.stats.kv_cache_usage == 0.0 and msg.stats.num_running == 0


class StepFailsOnce:
    """Wraps `engine.step`: the next call raises outside the forward (as a bug in the scheduler would)."""

    def __init__(self, step) -> None:  # type: ignore[no-untyped-def]
        self.step = step
        self.armed = False

    def __call__(self):  # type: ignore[no-untyped-def]
        if self.armed:
            self.armed = False
            raise KeyError("injected failure outside the forward")
        return self.step()


def _until_finished(core, req_id: str, timeout: float = 20.0) -> tuple[object, EngineOutputs]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = core.recv()
        for d in msg.deltas:
            if d.req_id == req_id and d.finish_reason is not None:
                return d, msg
    raise AssertionError(f"{req_id} did not finish")


def test_an_exception_outside_the_forward_fails_its_requests_and_the_loop_goes_on(core):
    flaky = core.engine.step = StepFailsOnce(core.engine.step)
    _add(core, "victim", [1, 2, 3, 4, 5], 200)
    while not core.recv().stats.num_running:
        pass
    flaky.armed = True
    d, msg = _until_finished(core, "victim")
    assert d.finish_reason == "error" and "injected failure" in d.error and not d.invalid
    assert msg.stats.kv_cache_usage == 0.0 and msg.stats.num_running == 0  # its blocks are freed
    _add(core, "after", [1, 2, 3], 5)
    d, _ = _until_finished(core, "after")
    assert d.finish_reason == "length" and not d.error


def test_undecodable_front_messages_are_dropped_and_counted(core):
    for raw in (b"\xc1", msgspec.msgpack.encode(["add", "x", "not a list"]), msgspec.msgpack.encode(["nope"])):
        core.push.send(raw)
    _add(core, "ok", [1, 2, 3], 3)
    d, msg = _until_finished(core, "ok")
    assert d.finish_reason == "length" and msg.stats.num_dropped_front_messages == 3


def test_an_idle_core_sends_a_heartbeat(core):
    msg = core.recv(timeout_s=5.0)  # nothing was sent to it
    assert isinstance(msg, EngineOutputs) and msg.deltas == []
