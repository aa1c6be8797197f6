"""The engine core process: owns an `LLMEngine` and runs `step()` in a loop.

Between steps it drains whatever the front has sent (adds, aborts) without waiting when there is work,
and blocks briefly only when idle. After each step it sends one `EngineOutputs` message: the step's
per-request deltas and the engine's counters. A request the engine refuses, or that fails in a step,
comes back as a delta with `finish_reason="error"`; only its own client sees it.

The process exits on a `Shutdown` message, on SIGTERM, or when its parent (the front) is gone. SIGINT
is ignored here: Ctrl-C reaches the whole process group, and the front coordinates the shutdown.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from pdserve.disagg.connector import RemoteDecode, RemotePrefill
from pdserve.errors import InvalidRequestError, SLORejectedError
from pdserve.scheduler.policies import SLOAware
from pdserve.server.config import ServerConfig
from pdserve.server.messages import (
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

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100  # how long an idle core waits for input before checking its parent
_STALLED_POLL_MS = 2  # unfinished requests but nothing schedulable: do not spin at 100% CPU


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
    core = EngineCore(engine, addresses, parent_pid)
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
    def __init__(self, engine: LLMEngine, addresses: CoreAddresses, parent_pid: int) -> None:
        self.engine = engine
        self.parent_pid = parent_pid
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.connect(addresses.input)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.setsockopt(zmq.LINGER, 1000)
        self._output.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow front; it is local
        self._output.connect(addresses.output)
        self._decoder = msgspec.msgpack.Decoder(FrontMessage)
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[RequestDelta] = []  # refusals to send with the next message
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
        engine = self.engine
        poll_ms = _IDLE_POLL_MS
        while not self._stopping:
            changed = self._receive(poll_ms)
            if self._stopping or os.getppid() != self.parent_pid:
                break
            if not engine.has_unfinished_requests():
                if changed or self._pending:
                    self._send_outputs([], None)
                poll_ms = _IDLE_POLL_MS
                continue
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
            for req_id, skip in engine.take_kv_reservations():  # the front answers the router with these
                self._pending.append(RequestDelta(req_id, [], "", kv_skip_tokens=skip))
            if ran or outputs or changed or self._pending:
                self._send_outputs(outputs, step)
            poll_ms = 0 if ran or outputs else _STALLED_POLL_MS
        logger.info("engine core stopping")

    def close(self) -> None:
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
            except msgspec.DecodeError:  # the front validates everything it sends; never crash the loop
                logger.exception("dropping a message from the front that does not decode")
                continue
            self._handle(msg)

    def _handle(self, msg: FrontMessage) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(
                    msg.prompt_token_ids, msg.params, msg.req_id, msg.arrival_time, _kv_spec(msg.kv_transfer)
                )
            except InvalidRequestError as e:
                self._pending.append(RequestDelta(msg.req_id, [], "", "error", error=str(e), invalid=True))
            except SLORejectedError as e:
                self._pending.append(RequestDelta(msg.req_id, [], "", "error", error=str(e), rejected=True))
            except Exception as e:  # never let one request take the loop down
                logger.exception("adding request %s failed", msg.req_id)
                self._pending.append(RequestDelta(msg.req_id, [], "", "error", error=f"engine error: {e}"))
        elif isinstance(msg, AbortRequests):
            for req_id in msg.req_ids:
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
                )
            )
        engine = self.engine
        stats = engine_stats(engine)
        transfers = [
            TransferStats(r.direction, r.ok, r.num_tokens, r.num_bytes, r.duration)
            for r in (engine.connector.take_records() if engine.connector is not None else [])
        ]
        self._send(EngineOutputs(deltas, stats, step, transfers))

    def _send(self, msg: Ready | EngineOutputs) -> None:
        self._output.send(self._encoder.encode(msg), copy=False)


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The engine's gauges and cumulative counters as sent to the front with every output message."""
    sched, bm = engine.scheduler, engine.block_manager
    slo = sched.policy if isinstance(sched.policy, SLOAware) else None
    spec = engine.spec_decode_stats
    return EngineStats(
        sched.num_running,
        sched.num_waiting,
        bm.usage,
        sched.num_preemptions,
        bm.num_prefix_hit_tokens,
        bm.num_prefix_queried_tokens,
        slo.step_model.coefficients if slo is not None else None,
        slo.num_ttft_violations_predicted if slo is not None else 0,
        slo.num_rejected if slo is not None else 0,
        sched.num_swapped,
        sched.num_swapped_out_blocks,
        sched.num_swapped_in_blocks,
        spec.num_drafts if spec is not None else 0,
        spec.num_draft_tokens if spec is not None else 0,
        spec.num_accepted_tokens if spec is not None else 0,
        tuple(spec.accepted_per_pos) if spec is not None else (),
    )
