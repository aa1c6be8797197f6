"""The engine core process: owns an `LLMEngine` and runs `step()` in a loop.

Between steps it drains whatever the front has sent (adds, aborts) without waiting when there is work,
and blocks briefly only when idle. After each step it sends one `EngineOutputs` message: the step's
per-request deltas and the engine's counters. A request the engine refuses, or that fails in a step,
comes back as a delta with `finish_reason="error"`; only its own client sees it. An exception anywhere
else in an iteration (the forward is guarded inside the engine) fails the requests the core holds, and the
loop goes on; only an engine that cannot even abort them ends the process (the front restarts it). An
idle core sends empty outputs every `HEARTBEAT_INTERVAL_S`, so a frozen loop shows as a stale heartbeat.

The process exits on a `Shutdown` message, on SIGTERM, or when its parent (the front) is gone. SIGINT
is ignored here: Ctrl-C reaches the whole process group, and the front coordinates the shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from pdserve.transfer.connector import RemoteDecode, RemotePrefill
from pdserve.errors import InvalidRequestError, SLORejectedError
from pdserve.config import ServerConfig
from pdserve.engine.process.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineStats,
    FrontMessage,
    KVTransferParams,
    Ready,
    RequestDelta,
    Shutdown,
    StepStats,
    TransferStats,
)
from pdserve.transfer.wire import DroppedMessages

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100  # how long an idle core waits for input before checking its parent
_STALLED_POLL_MS = 2  # unfinished requests but nothing schedulable: do not spin at 100% CPU
# An idle core still sends (empty) outputs this often: the front's /health reads the loop's heartbeat.
HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class CoreAddresses:
    input: str  # front PUSH (bind) -> core PULL (connect)
    output: str  # core PUSH (connect) -> front PULL (bind)


def run_engine_core(
    config: ServerConfig, addresses: CoreAddresses, parent_pid: int, tokenizer: object | None = None
) -> None:
    """Process entry point (multiprocessing spawn). `tokenizer`: the front's, for a random model (saves
    loading it twice)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    core: EngineCore | None = None

    def on_sigterm(signum: int, frame: object) -> None:
        if core is not None:
            core.stop()
        else:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s"
    )
    engine = build_engine(config, tokenizer)
    if config.cluster_secret is not None and engine.connector is not None:  # every KV message is MACed
        engine.connector.transport.authenticate_with(config.cluster_secret.encode())
    core = EngineCore(engine, addresses, parent_pid, config.step_log)
    try:
        core.run()
    finally:
        core.close()


def build_engine(config: ServerConfig, tokenizer: object | None = None) -> LLMEngine:
    from pdserve.engine.llm_engine import LLMEngine

    spec = config.random_model
    if spec is None:
        return LLMEngine(config.engine)
    from pdserve.model.llama import random_weights
    from pdserve.model.loader import resolve_model_path
    from pdserve.model.tokenizer import load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model_path(config.engine.model))
    weights = random_weights(spec.model_config, seed=spec.seed, std=spec.std)
    return LLMEngine(config.engine, model_config=spec.model_config, weights=weights, tokenizer=tokenizer)


def _kv_spec(p: KVTransferParams | None) -> RemoteDecode | RemotePrefill | None:
    if p is None:
        return None
    if p.remote_decode:
        return RemoteDecode(p.transfer_id, p.address, p.skip_tokens)
    return RemotePrefill(p.transfer_id)


class EngineCore:
    def __init__(
        self, engine: LLMEngine, addresses: CoreAddresses, parent_pid: int, step_log: str | None = None
    ) -> None:
        self.engine = engine
        self._step_log = open(step_log, "a", encoding="utf-8") if step_log else None  # noqa: SIM115 - closed in close()
        self.parent_pid = parent_pid
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.connect(addresses.input)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.setsockopt(zmq.LINGER, 1000)
        self._output.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow front; it is local
        self._output.connect(addresses.output)
        self._decoder = msgspec.msgpack.Decoder(FrontMessage)
        self._dropped = DroppedMessages("engine core's input from the front")
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[RequestDelta] = []  # refusals to send with the next message
        self._live: set[str] = set()  # requests added and not finished yet
        self._last_sent = 0.0  # monotonic time of the last message to the front (the heartbeat)
        self._stopping = False
        bm = engine.block_manager
        import torch

        self._send(
            Ready(
                model_name=engine.model_name,
                max_model_len=engine.max_model_len,
                vocab_size=engine.model_config.vocab_size,
                num_kv_tokens=bm.num_blocks * bm.block_size,
                block_size=bm.block_size,
                num_threads=torch.get_num_threads(),
                role=engine.role,
                kv_backend=engine.connector.transport.name if engine.connector else None,
                kv_address=engine.connector.address if engine.connector else None,
            )
        )

    def stop(self) -> None:
        self._stopping = True

    def run(self) -> None:
        poll_ms = _IDLE_POLL_MS
        while not self._stopping:
            try:
                changed = self._receive(poll_ms)
                if self._stopping or os.getppid() != self.parent_pid:
                    break
                poll_ms = self._iterate(changed)
            except Exception as e:  # noqa: BLE001 - outside the forward (which the engine guards itself)
                logger.exception("engine loop iteration failed; failing the %d requests in flight", len(self._live))
                self._fail_live(f"engine error: {e}")  # raises if the engine cannot even do that: restart
                poll_ms = 0
        logger.info("engine core stopping")

    def _iterate(self, changed: bool) -> int:
        """One step (if there is work) and its outputs; returns how long the next receive may wait."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            if self._step_log is not None:
                self._step_log.flush()
            if changed or self._pending or self._heartbeat_due():
                self._send_outputs([], None)
            return _IDLE_POLL_MS
        last = engine.step_records[-1] if engine.step_records else None
        outputs = engine.step()
        record = engine.step_records[-1] if engine.step_records else None
        ran = record is not None and record is not last
        model = engine.scheduler.step_model
        step = (
            StepStats(
                record.duration, record.num_prefill_tokens, record.num_decode_tokens,
                model.last_predicted if model is not None else None,
            )
            if ran
            else None
        )
        if ran and self._step_log is not None:
            assert record is not None
            row = [round(record.duration, 6), round(record.forward_time, 6), record.num_prefill_tokens,
                   record.num_decode_tokens, record.num_seqs, record.num_context_tokens]
            self._step_log.write(json.dumps(row) + "\n")
        for req_id, skip in engine.take_kv_reservations():  # the front answers the router with these
            self._pending.append(RequestDelta(req_id, [], "", kv_skip_tokens=skip))
        if ran or outputs or changed or self._pending or self._heartbeat_due():
            self._send_outputs(outputs, step)
        return 0 if ran or outputs else _STALLED_POLL_MS

    def _heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S

    def _fail_live(self, message: str) -> None:
        """Finish every request this core holds with an error (their blocks are freed) and tell the front.
        Used when something outside the forward failed and which requests it concerns is unknown."""
        failed = sorted(self._live)
        for req_id in failed:
            self.engine.abort_request(req_id)
        self._live.clear()
        self._pending.extend(RequestDelta(r, [], "", "error", error=message) for r in failed)
        self._send_outputs([], None)

    def close(self) -> None:
        if self._step_log is not None:
            self._step_log.close()
        self.engine.close()
        self._input.close(linger=0)
        self._output.close()
        self._ctx.term()

    # ---- input ---------------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> bool:
        """Handle every message that is waiting (waiting up to `timeout_ms` for the first one). Returns
        whether any arrived."""
        if timeout_ms and not self._input.poll(timeout_ms):
            return False
        got = False
        while True:
            try:
                frame = self._input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            got = True
            try:
                msg = self._decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:  # the front validates what it sends; never crash the loop
                self._dropped.drop(e)
                continue
            self._handle(msg)

    def _handle(self, msg: FrontMessage) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(
                    msg.prompt_token_ids, msg.params, msg.req_id, msg.arrival_time, _kv_spec(msg.kv_transfer)
                )
                self._live.add(msg.req_id)
            except InvalidRequestError as e:
                self._pending.append(RequestDelta(msg.req_id, [], "", "error", error=str(e), invalid=True))
            except SLORejectedError as e:
                self._pending.append(RequestDelta(msg.req_id, [], "", "error", error=str(e), rejected=True))
            except Exception as e:  # never let one request take the loop down
                logger.exception("adding request %s failed", msg.req_id)
                self._pending.append(RequestDelta(msg.req_id, [], "", "error", error=f"engine error: {e}"))
        elif isinstance(msg, AbortRequests):
            for req_id in msg.req_ids:
                self._live.discard(req_id)
                self.engine.abort_request(req_id)
        elif isinstance(msg, Shutdown):
            self._stopping = True

    # ---- output --------------------------------------------------------------------------------
    def _send_outputs(self, outputs: list[RequestOutput], step: StepStats | None) -> None:
        deltas = self._pending
        self._pending = []
        for out in outputs:
            comp = out.outputs[0]
            new_ids = list(comp.new_token_ids)
            logprobs = comp.logprobs[-len(new_ids) :] if comp.logprobs and new_ids else None
            first = bool(new_ids) and len(comp.token_ids) == len(new_ids)
            m = out.metrics
            deltas.append(
                RequestDelta(
                    out.request_id,
                    new_ids,
                    comp.new_text,
                    comp.finish_reason,
                    comp.stop_reason,
                    logprobs,
                    out.error,
                    False,
                    m.first_scheduled_time if m is not None else None,
                    m.num_cached_tokens if m is not None else 0,
                    prompt_logprobs=out.prompt_logprobs if first else None,
                )
            )
        engine = self.engine
        stats = engine_stats(engine, self._dropped.count)
        transfers = [
            TransferStats(r.direction, r.ok, r.num_tokens, r.num_bytes, r.duration)
            for r in (engine.connector.take_records() if engine.connector is not None else [])
        ]
        self._send(EngineOutputs(deltas, stats, step, transfers))
        for d in deltas:  # only once sent: a request whose last delta was lost is failed by the loop
            if d.finish_reason is not None:
                self._live.discard(d.req_id)

    def _send(self, msg: Ready | EngineOutputs) -> None:
        self._output.send(self._encoder.encode(msg), copy=False)
        self._last_sent = time.monotonic()


def engine_stats(engine: LLMEngine, num_dropped_front_messages: int = 0) -> EngineStats:
    """The engine's gauges and cumulative counters as sent to the front with every output message."""
    sched, bm = engine.scheduler, engine.block_manager
    connector = engine.connector
    spec = engine.spec_decode_stats
    return EngineStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        kv_cache_usage=bm.usage,
        num_preemptions=sched.num_preemptions,
        num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
        num_prefix_queried_tokens=bm.num_prefix_queried_tokens,
        policy_stats=sched.policy.stats(),
        num_swapped=sched.num_swapped,
        num_swapped_out_blocks=sched.num_swapped_out_blocks,
        num_swapped_in_blocks=sched.num_swapped_in_blocks,
        num_dropped_kv_messages=connector.transport.dropped.count if connector is not None else 0,
        num_dropped_front_messages=num_dropped_front_messages,
        num_spec_drafts=spec.num_drafts if spec is not None else 0,
        num_spec_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        num_spec_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        spec_accepted_per_pos=tuple(spec.accepted_per_pos) if spec is not None else (),
        num_spec_length_choices=spec.num_length_choices if spec is not None else 0,
        num_spec_chosen_tokens=spec.num_chosen_tokens if spec is not None else 0,
    )
