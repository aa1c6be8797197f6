"""The front's handle on the engine core process: starts it, sends it requests and aborts, and routes
its per-step deltas to the HTTP handlers waiting for them. It lives beside the core (`core.py`) and their
messages (`messages.py`): the server uses it, and gives it a `FrontObserver` (the server's metrics) to
report latencies and counts to, so nothing here imports the server.

Everything here runs on the front's event loop and never blocks it: sends are non-blocking, and one
task receives the core's messages. A handler passes an `asyncio.Queue` with each request; the client puts
`(index, RequestDelta)` on it for every delta, the last one with a `finish_reason`. Several requests
(n > 1, or several prompts) can share a queue, told apart by `index`.

The core process dying is noticed through its sentinel file descriptor the moment it happens: every
request in flight gets an error delta and new requests are refused with `EngineDeadError` until a new
core is ready. The client restarts it (`restart_engine`), waiting longer after each death that follows
soon after the last one, so a core that crashes at once does not spin. Every message from the core
(an idle one sends one every second) refreshes its heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from pdserve.errors import PdserveError
from pdserve.request import LatencyTargets, SamplingParams
from pdserve.config import ServerConfig
from pdserve.engine.process.core import CoreAddresses, run_engine_core
from pdserve.engine.process.messages import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    EngineOutputs,
    EngineStats,
    KVTransferParams,
    Ready,
    RequestDelta,
    Shutdown,
    StepStats,
    TransferStats,
)
from pdserve.transfer.wire import DroppedMessages

logger = logging.getLogger(__name__)

DeltaQueue = asyncio.Queue  # of tuple[int, RequestDelta]


class EngineDeadError(PdserveError):
    """The engine core process is not running; no request can be served."""


class OverloadedError(PdserveError):
    """Too many requests are waiting for their first token; the caller should retry later."""


class FrontObserver(Protocol):
    """What the client reports, as it happens (`server/metrics.py`'s `ServerMetrics` implements it).
    Times are seconds, measured where the HTTP client sees them."""

    def observe_engine(self, stats: EngineStats, step: StepStats | None) -> None: ...

    def observe_transfer(self, t: TransferStats) -> None: ...

    def observe_first_token(self, ttft: float, queue_time: float | None, num_prompt_tokens: int) -> None: ...

    def observe_tokens(self, num_tokens: int, itl: float | None) -> None: ...

    def observe_finished(self, reason: str, e2e: float, decode_time: float, num_output_tokens: int) -> None: ...

    def observe_slo(self, results: dict[str, bool]) -> None:
        """A finished request against its own latency targets (`LatencyTargets.results`)."""

    def observe_aborted(self, num_requests: int) -> None: ...

    def observe_failed(self, num_requests: int) -> None:
        """Requests failed because the core died."""

    def observe_dropped(self, channel: str) -> None:
        """A message from the core that did not decode (`channel`: "core_to_front")."""

    def observe_engine_restart(self) -> None:
        """A new core is ready after the previous one died (its counters start from zero)."""


@dataclass(slots=True)
class _Tracked:
    queue: DeltaQueue
    index: int
    arrival_time: float
    num_prompt_tokens: int
    targets: LatencyTargets = LatencyTargets()
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    max_itl: float | None = None  # the longest gap between two outputs so far


class EngineClient:
    def __init__(self, config: ServerConfig, metrics: FrontObserver) -> None:
        self.config = config
        self.metrics = metrics
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0)  # the core's latest (zero until it reports)
        self.ready: Ready | None = None
        self.dead_reason: str | None = None
        self._requests: dict[str, _Tracked] = {}
        self._num_waiting_first = 0  # tracked requests without a first token yet
        # The engine's targets (seconds) for requests that set none: TTFT and ITL are the `slo` policy's,
        # TPOT the slack speculation rule's; under another policy a request is judged only on its own.
        sc, spec = config.engine.scheduler, config.engine.speculative
        slo = sc.policy == "slo"
        self._default_targets = (
            sc.slo_ttft_ms / 1e3 if slo else None,
            sc.slo_itl_ms / 1e3 if slo else None,
            spec.slo_tpot_ms / 1e3 if spec is not None and spec.slo_tpot_ms is not None else None,
        )
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._push: zmq.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._output_task: asyncio.Task | None = None
        self._closing = False
        self._tokenizer: object | None = None
        self._addresses: CoreAddresses | None = None
        self.last_heard = time.monotonic()
        self.num_restarts = 0  # successful restarts of a core that died
        self._crashes: list[float] = []  # when recent cores died (for the backoff)
        self._restart_at: float | None = None
        self.restart_delay = 0.0  # the backoff of the latest restart
        self._restart_task: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._dropped = DroppedMessages("front's input from the engine core")

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self, tokenizer: object | None = None) -> Ready:
        """Spawn the core, wait until its engine is built. Raises EngineDeadError if it dies first.
        `tokenizer` is handed to a core that serves a random model (see `RandomModelSpec`)."""
        self._tokenizer = tokenizer
        self._open_channels()
        return await self._spawn()

    def _open_channels(self) -> None:
        """Fresh sockets (and socket files) for one core process: nothing a dead one left queued
        reaches its successor."""
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-")
        self._addresses = CoreAddresses(f"ipc://{self._tmpdir}/input", f"ipc://{self._tmpdir}/output")
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self._addresses.input)
        self._actx = zmq.asyncio.Context()
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._addresses.output)

    def _close_channels(self) -> None:
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._push = self._pull = self._ctx = self._actx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def _spawn(self) -> Ready:
        assert self._pull is not None and self._addresses is not None
        self.ready = None
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_engine_core,
            args=(self.config, self._addresses, os.getpid(), self._tokenizer),
            name="pdserve-engine-core",
            daemon=True,
        )
        self._proc.start()
        logger.info("engine core process %d starting", self._proc.pid)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while self.ready is None:
            if not self._proc.is_alive():
                raise EngineDeadError(
                    f"the engine core process exited with code {self._proc.exitcode} while starting "
                    "(its log above says why)"
                )
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineDeadError(
                    f"the engine core did not start within {self.config.startup_timeout_s:.0f} s"
                )
            if await self._pull.poll(200):
                try:
                    msg = self._decoder.decode(await self._pull.recv())
                except msgspec.DecodeError as e:
                    self._dropped.drop(e)
                    self.metrics.observe_dropped("core_to_front")
                    continue
                if isinstance(msg, Ready):
                    self.ready = msg
        self.last_heard = time.monotonic()
        asyncio.get_running_loop().add_reader(self._proc.sentinel, self._on_core_exit)
        self._output_task = asyncio.create_task(self._output_loop(), name="pdserve-engine-outputs")
        logger.info(
            "engine core ready: %s, context %d tokens, KV cache %d tokens, %d torch threads",
            self.ready.model_name,
            self.ready.max_model_len,
            self.ready.num_kv_tokens,
            self.ready.num_threads,
        )
        return self.ready

    async def shutdown(self) -> None:
        """Stop the core (politely, then by force) and fail whatever is still in flight."""
        self._closing = True
        proc = self._proc
        if proc is not None:
            try:
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            except (ValueError, OSError):
                pass
            if proc.is_alive():
                try:
                    self._send(Shutdown())
                except zmq.ZMQError:
                    pass  # SIGTERM below does the same
                for kill in (None, proc.terminate, proc.kill):
                    if kill is not None:
                        kill()
                    deadline = time.monotonic() + 5.0
                    while proc.is_alive() and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    if not proc.is_alive():
                        break
            proc.join(0)
            logger.info("engine core process exited with code %s", proc.exitcode)
        self._fail_all("the server is shutting down")
        for task in (self._output_task, self._restart_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._close_channels()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.ready is not None and not self._closing

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the core last said anything (an idle one speaks every second)."""
        return time.monotonic() - self.last_heard

    @property
    def is_stale(self) -> bool:
        """The core is running but its loop has not been heard from for too long (frozen, or one step
        that takes longer than `heartbeat_timeout_s`)."""
        return self.is_alive and self.heartbeat_age > self.config.heartbeat_timeout_s

    @property
    def restart_in(self) -> float | None:
        """Seconds until the next restart attempt of a dead core; None unless one is scheduled."""
        if self._restart_at is None:
            return None
        return max(0.0, self._restart_at - time.monotonic())

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def num_waiting_for_first_token(self) -> int:
        return self._num_waiting_first

    # ---- requests ------------------------------------------------------------------------------
    def check_capacity(self, num_requests: int) -> None:
        """Raise EngineDeadError or OverloadedError if `num_requests` more cannot be accepted now."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        limit = self.config.max_waiting
        if self._num_waiting_first + num_requests > limit:
            raise OverloadedError(
                f"the server is overloaded: {self._num_waiting_first} requests are already waiting for their "
                f"first token (limit {limit}, set by --max-waiting); retry later"
            )

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: DeltaQueue,
        index: int,
        kv_transfer: KVTransferParams | None = None,
    ) -> None:
        """Send a validated request to the core; its deltas will arrive on `queue` tagged with `index`."""
        self.check_capacity(1)
        now = time.monotonic()
        try:
            self._send(AddRequest(req_id, prompt_token_ids, params, now, kv_transfer))
        except zmq.Again:
            raise OverloadedError("the engine's input queue is full; retry later") from None
        targets = LatencyTargets.resolve(params, *self._default_targets)
        self._requests[req_id] = _Tracked(queue, index, now, len(prompt_token_ids), targets)
        self._num_waiting_first += 1

    def abort(self, req_ids: list[str]) -> None:
        """Stop requests still in flight (finished or unknown ids are skipped); their blocks are freed in
        the core before its next step."""
        live = [r for r in req_ids if r in self._requests]
        if not live:
            return
        for req_id in live:
            self._forget(req_id)
        self.metrics.observe_aborted(len(live))
        if self.is_alive:
            try:
                self._send(AbortRequests(live))
            except zmq.ZMQError:
                logger.warning("could not send the abort of %d requests to the engine core", len(live))

    def _forget(self, req_id: str) -> _Tracked:
        t = self._requests.pop(req_id)
        if t.first_token_time is None:
            self._num_waiting_first -= 1
        return t

    def _send(self, msg: AddRequest | AbortRequests | Shutdown) -> None:
        assert self._push is not None
        self._push.send(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    # ---- outputs -------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        assert self._pull is not None
        while True:
            frame = await self._pull.recv(copy=False)
            self.last_heard = time.monotonic()
            try:
                msg = self._decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:
                self._dropped.drop(e)
                self.metrics.observe_dropped("core_to_front")
                continue
            try:
                if isinstance(msg, EngineOutputs):
                    self._on_outputs(msg)
            except Exception:  # a bad message must not stop the routing of every other one
                logger.exception("could not handle a message from the engine core")

    def _on_outputs(self, msg: EngineOutputs) -> None:
        m = self.metrics
        self.stats = msg.stats
        m.observe_engine(msg.stats, msg.step)
        for tr in msg.transfers:
            m.observe_transfer(tr)
        now = time.monotonic()
        for d in msg.deltas:
            t = self._requests.get(d.req_id)
            if t is None:  # aborted by the front while this step ran
                continue
            n = len(d.new_token_ids)
            if n:
                if t.first_token_time is None:
                    t.first_token_time = now
                    self._num_waiting_first -= 1
                    queue_time = (
                        None if d.first_scheduled_time is None else d.first_scheduled_time - t.arrival_time
                    )
                    m.observe_first_token(now - t.arrival_time, queue_time, t.num_prompt_tokens)
                    m.observe_tokens(n, None)
                else:
                    gap = now - t.last_token_time
                    m.observe_tokens(n, gap)
                    t.max_itl = gap if t.max_itl is None else max(t.max_itl, gap)
                t.last_token_time = now
                t.num_output_tokens += n
            if d.finish_reason is not None:
                self._forget(d.req_id)
                if d.finish_reason == "abort":
                    m.observe_aborted(1)
                else:
                    first = t.first_token_time if t.first_token_time is not None else now
                    m.observe_finished(
                        d.finish_reason, now - t.arrival_time, now - first, t.num_output_tokens
                    )
                    if not t.targets.is_empty:
                        m.observe_slo(self._slo_results(t, d.finish_reason, now))
            t.queue.put_nowait((t.index, d))

    def _on_core_exit(self) -> None:
        assert self._proc is not None
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if self._closing:
            return
        self._proc.join(0)
        self.dead_reason = f"the engine core process died (exit code {self._proc.exitcode})"
        logger.error("%s; failing %d requests in flight", self.dead_reason, len(self._requests))
        self._fail_all(self.dead_reason)
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        if self.config.restart_engine:
            self._restart_task = asyncio.create_task(self._restart(), name="pdserve-engine-restart")

    def _backoff(self) -> float:
        """Seconds to wait before restarting: doubling with every death in the last `crash_window`."""
        c = self.config
        now = time.monotonic()
        self._crashes = [t for t in self._crashes if now - t < c.restart_window_s] + [now]
        return min(c.restart_backoff_max_s, c.restart_backoff_s * 2 ** (len(self._crashes) - 1))

    async def _restart(self) -> None:
        """Start a new core process until one is ready (in-flight requests were already failed; new ones
        get 503 meanwhile)."""
        while not self._closing:
            delay = self.restart_delay = self._backoff()
            self._restart_at = time.monotonic() + delay
            logger.warning("restarting the engine core in %.1f s", delay)
            await asyncio.sleep(delay)
            self._restart_at = None
            self._close_channels()
            self._open_channels()
            try:
                await self._spawn()
            except EngineDeadError as e:
                self.dead_reason = f"the engine core process died and its restart failed: {e}"
                logger.error("%s", self.dead_reason)
                continue
            self.stats = EngineStats(0, 0, 0.0, 0, 0, 0)  # the new core counts from zero
            self.num_restarts += 1
            self.metrics.observe_engine_restart()
            self.dead_reason = None
            logger.info("engine core restarted (%d restarts so far)", self.num_restarts)
            return

    @staticmethod
    def _slo_results(t: _Tracked, finish_reason: str, now: float) -> dict[str, bool]:
        """How a request that finished at `now` did against its targets; a failed one met none."""
        first = t.first_token_time
        if finish_reason == "error" or first is None:
            return {k: False for k in t.targets.results(0.0, None, None)}
        tpot = (now - first) / (t.num_output_tokens - 1) if t.num_output_tokens > 1 else None
        return t.targets.results(first - t.arrival_time, t.max_itl, tpot)

    def _fail_all(self, message: str) -> None:
        now = time.monotonic()
        for req_id in list(self._requests):
            t = self._forget(req_id)
            self.metrics.observe_failed(1)
            if not t.targets.is_empty:
                self.metrics.observe_slo(self._slo_results(t, "error", now))
            t.queue.put_nowait((t.index, RequestDelta(req_id, [], "", "error", error=message)))
