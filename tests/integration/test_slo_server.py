"""The `slo` policy through the server's plumbing: the engine core (a thread, real ZMQ sockets, tiny
random model) answers a refused request with a `rejected` delta and sends the step-time model's state
with its stats; the front turns such a delta into HTTP 503 with code `slo_rejected`."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import msgspec
import zmq

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from pdserve.scheduler.step_model import TERMS
from pdserve.engine.process.core import CoreAddresses, EngineCore
from pdserve.engine.process.messages import AddRequest, CoreMessage, EngineOutputs, Ready, RequestDelta, Shutdown
from tests.support.tiny import TINY


def test_engine_core_sends_rejections_and_model_state(tiny_weights) -> None:
    sc = SchedulerConfig(policy="slo", slo_reject=True, slo_ttft_ms=0.001)
    config = EngineConfig(
        dtype="float32", device="cpu", num_threads=1, cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=sc,
    )
    engine = LLMEngine(config, model_config=TINY, weights=tiny_weights)
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

    def recv() -> Ready | EngineOutputs:
        assert pull.poll(10_000), "no message from the core"
        return decoder.decode(pull.recv())

    try:
        assert isinstance(recv(), Ready)
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        push.send(encoder.encode(AddRequest("long", [1, 2, 3, 4, 5], params, time.monotonic())))
        finished: dict[str, RequestDelta] = {}
        sent_second = False
        stats, steps = None, []
        deadline = time.monotonic() + 30
        while "long" not in finished and time.monotonic() < deadline:
            msg = recv()
            assert isinstance(msg, EngineOutputs)
            stats = msg.stats
            if msg.step is not None:
                steps.append(msg.step)
            for d in msg.deltas:
                if d.finish_reason is not None:
                    finished[d.req_id] = d
            if not sent_second and any(d.req_id == "long" and d.new_token_ids for d in msg.deltas):
                push.send(encoder.encode(AddRequest("late", [6] * 30, params, time.monotonic())))
                sent_second = True
        refused = finished["late"]
        assert refused.finish_reason == "error" and refused.rejected and not refused.invalid
        assert "time-to-first-token" in (refused.error or "")
        assert finished["long"].finish_reason == "length"
        assert stats is not None and stats.policy_stats["slo_rejected_requests_total"] == 1
        model = engine.scheduler.step_model
        coefficients = tuple(stats.policy_stats[f'step_model_coefficient_seconds{{term="{t}"}}'] for t in TERMS)
        assert model is not None and coefficients == model.coefficients
        assert steps and all(s.predicted_duration is not None and s.predicted_duration >= 0 for s in steps)
    finally:
        push.send(encoder.encode(Shutdown()))
        thread.join(10)
        core.close()
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_front_answers_503_slo_rejected() -> None:
    from prometheus_client import generate_latest

    from pdserve.server.api import Server
    from pdserve.config import ServerConfig

    server = Server(ServerConfig())
    err = server.error_of(RequestDelta("r", [], "", "error", error="predicted 900 ms", rejected=True))
    assert err.status == 503 and err.code == "slo_rejected" and err.type == "server_error"
    assert err.body()["error"]["message"] == "predicted 900 ms"
    text = generate_latest(server.metrics.registry).decode()
    assert 'pdserve:request_rejected_total{model_name="' in text
    line = next(x for x in text.splitlines() if x.startswith("pdserve:request_rejected_total{"))
    assert float(line.rsplit(" ", 1)[1]) == 1.0
    invalid = server.error_of(RequestDelta("r", [], "", "error", error="bad", invalid=True))
    assert invalid.status == 400
