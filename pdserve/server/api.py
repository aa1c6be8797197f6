"""The HTTP front: OpenAI-compatible routes on FastAPI, served by uvicorn.

A generation request is decoded and checked (`protocol.py`), tokenized here, checked against the context
length and the KV-cache size, and only then sent to the engine core, one engine request per prompt and
choice. Its deltas come back on one queue and are either streamed as server-sent events or collected into
one JSON body. A client that goes away (mid-stream or while waiting for a whole response) has its engine
requests aborted at once, which frees their KV blocks before the engine's next step.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /load,
GET /metrics.

Disaggregation (`--role prefill|decode`, driven by `pdserve router`): a generation request may carry
`kv_transfer_params`. On a decode instance (`remote_prefill`) the response starts as soon as the engine
has reserved the prompt's blocks, with the header `x-pdserve-kv-reservation` telling the router where to
send the KV and how many prompt tokens are already here; its body is the usual stream or JSON. On a
prefill instance (`remote_decode`) the request computes the prompt and one token, and its response comes
once the decode instance has acknowledged the KV (an error if the transfer failed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.config import ServerConfig
from pdserve.engine.process.messages import KVTransferParams, Ready, RequestDelta
from pdserve.server import wire
from pdserve.server.chat import ChatEncoder
from pdserve.server.engine_client import EngineClient, EngineDeadError, OverloadedError
from pdserve.server.guards import (
    check_api_key,
    check_cluster,
    check_json_content_type,
    read_body,
)
from pdserve.server.http import WatchedStream, make_app, run_uvicorn, wait_disconnect
from pdserve.server.metrics import ServerMetrics, StatsLogger
from pdserve.server.protocol import (
    MAX_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LogprobFormatter,
    bad_request,
    chat_message_dicts,
    check_unsupported,
    choice_seed,
    decode_body,
    num_choices,
    sampling_params,
    usage,
)

logger = logging.getLogger(__name__)

# A token is rarely more than a few characters: a text this many times longer than the context cannot
# fit, and is refused before it is tokenized.
_MAX_CHARS_PER_TOKEN = 32

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


def _json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json", headers=headers)


def _sse(body: Any) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


def served_model_name(config: ServerConfig, model_path: str) -> str:
    if config.served_model_name:
        return config.served_model_name
    return os.path.basename(model_path.rstrip("/")).removesuffix(".gguf")


@dataclass(slots=True)
class _Job:
    """One HTTP generation request: its engine requests (prompt-major, then choice) and their queue."""

    http_id: str
    created: int
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    req_ids: list[str] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    deadline: float | None = None  # monotonic; past it the request is aborted (--request-timeout)

    def time_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def next_delta(self) -> tuple[int, RequestDelta]:
        """The next delta; asyncio.TimeoutError once the deadline has passed."""
        return await asyncio.wait_for(self.queue.get(), self.time_left())

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class Server:
    """The app's state: config, engine client, tokenizer (after startup), metrics."""

    def __init__(self, config: ServerConfig) -> None:
        from pdserve.model.loader import resolve_model_path

        self.config = config
        self.model_path = resolve_model_path(config.engine.model)
        self.model_name = served_model_name(config, self.model_path)
        self.model_names = {self.model_name, self.model_path}
        if config.engine.model:
            self.model_names.add(config.engine.model)
        self.metrics = ServerMetrics(self.model_name)
        self.client = EngineClient(config, self.metrics)
        self.tokenizer: Any = None
        self.ready: Ready | None = None
        self.logprob_formatter: LogprobFormatter | None = None
        self.chat_encoder: ChatEncoder | None = None
        self.started = int(time.time())

    async def start(self) -> None:
        from pdserve.model.tokenizer import load_tokenizer

        if self.config.random_model is not None:  # the core takes the front's tokenizer
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path)
            await self._start_engine(self.tokenizer)
        else:  # the tokenizer loads here while the core loads the model
            loading = asyncio.create_task(asyncio.to_thread(load_tokenizer, self.model_path))
            await self._start_engine(None)
            self.tokenizer = await loading
        self.logprob_formatter = LogprobFormatter(self.tokenizer)
        self.chat_encoder = ChatEncoder(self.tokenizer)

    async def _start_engine(self, tokenizer: object | None) -> None:
        try:
            self.ready = await self.client.start(tokenizer)
            self.metrics.observe_kv_cache(self.ready.num_kv_tokens // self.ready.block_size)
        except BaseException:
            await self.client.shutdown()
            raise

    # ---- checks --------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """Raise a 400 unless the prompt and its completion fit; return the completion's max_tokens
        (None: whatever the context leaves)."""
        assert self.ready is not None
        r = self.ready
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if any(not 0 <= t < r.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must be integers in [0, {r.vocab_size})", param=param)
        limit = min(r.max_model_len, r.num_kv_tokens)
        what = "context length" if limit == r.max_model_len else "KV-cache capacity"
        if len(ids) >= limit:
            raise bad_request(
                f"This model's maximum {what} is {limit} tokens. However, the prompt has {len(ids)} tokens, "
                "and at least one generated token must fit as well. Please shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - len(ids)
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens}", param="max_tokens")
        if len(ids) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum {what} is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                "completion). Please reduce the length of the prompt or of the completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    async def body(self, request: Request) -> bytes:
        """The POST body of an authenticated request: declared JSON, bounded, arrived in time."""
        check_api_key(request, self.config.api_key, self.config.cluster_secret)
        check_json_content_type(request)
        c = self.config
        return await read_body(request, c.max_body_bytes, c.body_timeout_s)

    def check_text_length(self, texts: list[str], param: str) -> None:
        """A cheap bound before tokenizing: text far longer than the context cannot fit in it."""
        assert self.ready is not None
        limit = min(self.ready.max_model_len, self.ready.num_kv_tokens)
        num_chars = sum(len(t) for t in texts)
        if num_chars > limit * _MAX_CHARS_PER_TOKEN:
            raise bad_request(
                f"the {param} has {num_chars} characters, far more than this model's {limit}-token context "
                "can hold. Please shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    async def tokenize_prompts(self, prompt: str | list[Any]) -> list[list[int]]:
        """`completion_prompts` in a worker thread (a long prompt must not stall the event loop)."""
        if isinstance(prompt, str):
            self.check_text_length([prompt], "prompt")
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            self.check_text_length(prompt, "prompt")
        elif isinstance(prompt, list) and len(prompt) > 4096:
            raise bad_request("prompt must not hold more than 4096 prompts", param="prompt")
        return await asyncio.to_thread(self.completion_prompts, prompt)

    async def tokenize_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """Template and tokenize the messages in a worker thread, after a cheap length check."""
        self.check_text_length([m["content"] for m in messages], "messages")

        encoder = self.chat_encoder
        assert encoder is not None

        def run() -> list[int]:
            try:  # message content is encoded as plain text: no special tokens typed by the user
                return encoder.encode(messages, add_generation_prompt)
            except (ValueError, TypeError) as e:  # InvalidRequestError: no template, or it refused them
                raise bad_request(str(e), param="messages") from None

        return await asyncio.to_thread(run)

    def completion_prompts(self, prompt: str | list[Any]) -> list[list[int]]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            return [tok.encode(prompt)]
        if not prompt:
            raise bad_request("prompt must not be an empty list", param="prompt")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [tok.encode(p) for p in prompt]
        if all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return [list(p) for p in prompt]
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            param="prompt",
        )

    def kv_transfer_of(self, req: Any, job: _Job, request: Request) -> KVTransferParams | None:
        """The request's disaggregation part, checked; None for an ordinary request. Only the cluster's
        router may send one: it names where KV goes and reserves blocks."""
        p = req.kv_transfer_params
        if p is None:
            return None
        check_cluster(request, self.config.cluster_secret, "kv_transfer_params")
        if self.ready is None or self.ready.kv_backend is None:
            raise bad_request("this instance has no KV transfer backend (--kv-transfer)", param="kv_transfer_params")
        if job.num_choices != 1:
            raise bad_request("kv_transfer_params needs exactly one prompt and n = 1", param="kv_transfer_params")
        tid = p.get("transfer_id") if "transfer_id" in p else (p.get("remote_decode") or {}).get("transfer_id")
        if not (isinstance(tid, str) and re.fullmatch(r"[0-9A-Za-z_-]{1,64}", tid)):
            raise bad_request("kv_transfer_params: transfer_id must be 1-64 of [0-9A-Za-z_-]", param="kv_transfer_params")
        try:
            params: wire.KVTransferParams | None = msgspec.convert(p, wire.KVTransferParams)
        except msgspec.ValidationError:
            params = None
        if params is not None and params.remote_prefill and params.transfer_id is not None:
            return KVTransferParams(params.transfer_id, remote_decode=False)
        if params is not None and (d := params.remote_decode) is not None:
            return KVTransferParams(d.transfer_id, True, d.address, d.skip_tokens)
        raise bad_request(
            'kv_transfer_params must be {"remote_prefill": true, "transfer_id": str} or '
            '{"remote_decode": {"transfer_id": str, "address": str, "skip_tokens": int}}',
            param="kv_transfer_params",
        )

    # ---- submitting ----------------------------------------------------------------------------
    def submit(self, job: _Job, params: list[Any], kv_transfer: KVTransferParams | None = None) -> None:
        """Send every engine request of `job` (params: one per prompt, before the per-choice seed)."""
        if job.num_choices > self.config.max_waiting:
            raise bad_request(
                f"this request asks for {job.num_choices} completions (prompts x n), more than the "
                f"server ever queues at once ({self.config.max_waiting}, set by --max-waiting)",
                param="n",
            )
        # Every choice's parameters first, then the sends: a submission is all or nothing.
        choices = []
        for p_idx, ids in enumerate(job.prompts):
            for i in range(job.n):
                p = params[p_idx]
                if p.seed is not None and i:  # choices of one prompt must differ
                    p = replace(p, seed=choice_seed(p.seed, i))
                choices.append((f"{job.http_id}-{p_idx * job.n + i}", ids, p))
        try:
            self.client.check_capacity(job.num_choices)
            for index, (req_id, ids, p) in enumerate(choices):
                self.client.add_request(req_id, ids, p, job.queue, index, kv_transfer)
                job.req_ids.append(req_id)
        except BaseException as e:
            self.client.abort(job.req_ids)  # the choices already sent: none of them may run unseen
            if not isinstance(e, (OverloadedError, EngineDeadError)):
                raise
            self.metrics.rejected.inc()
            if isinstance(e, OverloadedError):
                raise APIError(503, str(e), "server_error", None, "overloaded") from None
            raise APIError(
                503, f"the engine is not available: {e}", "server_error", None, "engine_unavailable"
            ) from None

    def timed_out(self) -> APIError:
        return APIError(
            504,
            f"the request did not finish within the server's limit of {self.config.request_timeout_s:g} s",
            "server_error",
            None,
            "request_timeout",
        )

    def new_job(self, prefix: str, prompts: list[list[int]], n: int, stream: bool, usage: bool,
                logprobs: int | None) -> _Job:
        timeout = self.config.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        return _Job(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), prompts, n, stream, usage, logprobs,
                    deadline=deadline)

    def error_of(self, d: RequestDelta) -> APIError:
        if d.invalid:
            return bad_request(d.error or "invalid request")
        if d.rejected:  # the `slo` policy predicts it would miss its targets now
            self.metrics.rejected.inc()
            message = d.error or "the server cannot meet its latency targets now"
            return APIError(503, message, "server_error", None, "slo_rejected")
        if not self.client.is_alive:
            return APIError(
                503, d.error or "the engine is not available", "server_error", None, "engine_unavailable"
            )
        return APIError(
            500, d.error or "the request failed in the engine", "server_error", None, "engine_error"
        )


async def _collect(job: _Job, request: Request, server: Server, on_delta: Any) -> bool:
    """Feed every delta of `job` to `on_delta` until all choices finish. Returns False if the client left
    first (its requests are then aborted). Raises APIError if a request failed."""
    remaining = job.num_choices

    async def drain() -> None:
        nonlocal remaining
        while remaining:
            index, d = await job.queue.get()
            if d.finish_reason == "error":
                raise server.error_of(d)
            on_delta(index, d)
            if d.finish_reason is not None:
                remaining -= 1

    drainer = asyncio.ensure_future(drain())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({drainer, watcher}, timeout=job.time_left(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (drainer, watcher):
            task.cancel()
        server.client.abort(job.req_ids)  # skips those that finished
    if drainer.done() and not drainer.cancelled():
        drainer.result()  # raises the APIError of a failed request
        return True
    if not watcher.done():
        raise server.timed_out()
    return False


def build_app(config: ServerConfig) -> FastAPI:
    server = Server(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        stats_task = None
        if config.stats_interval_s > 0:
            stats_task = asyncio.create_task(_log_stats(server.metrics, config.stats_interval_s))
        logger.info("serving %s on http://%s:%d", server.model_name, config.host, config.port)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await server.client.shutdown()

    app = make_app("pdserve", "server", config.allowed_hosts, lifespan)
    app.state.server = server

    @app.get("/health")
    async def health() -> Response:
        client = server.client
        if not client.is_alive:
            body: dict[str, Any] = {"status": "unhealthy", "error": client.dead_reason or "shutting down"}
            if client.dead_reason is not None and config.restart_engine:
                restart_in = client.restart_in
                body.update(
                    status="restarting",
                    num_engine_restarts=client.num_restarts,
                    restart_delay_s=client.restart_delay,
                )
                if restart_in is not None:  # else: the new core is loading
                    body["restart_in_s"] = round(restart_in, 3)
            return _json_response(body, 503)
        if client.is_stale:
            error = (
                f"the engine loop has not been heard from for {client.heartbeat_age:.1f} s "
                f"(limit {config.heartbeat_timeout_s:g} s): it is frozen or in a very long step"
            )
            return _json_response({"status": "unhealthy", "error": error}, 503)
        s = client.stats
        return _json_response(
            {
                "status": "ok",
                "num_requests_in_flight": client.num_in_flight,
                "num_requests_running": s.num_running,
                "num_requests_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "heartbeat_age_s": round(client.heartbeat_age, 3),
                "num_engine_restarts": client.num_restarts,
            }
        )

    @app.get("/load")
    async def load(request: Request) -> Response:
        """What a router needs to pick this instance (only the cluster's router, when there is a secret:
        it shows where this instance receives KV)."""
        if config.cluster_secret is not None:
            check_cluster(request, config.cluster_secret, "GET /load")
        s = server.client.stats
        r = server.ready
        return _json_response(
            wire.LoadReport(
                role=r.role if r else "both",
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                kv_cache_usage=s.kv_cache_usage,
                num_in_flight=server.client.num_in_flight,
                kv_backend=r.kv_backend if r else None,
                kv_address=r.kv_address if r else None,
                kv_transfers={d: wire.TransferTotals(**t) for d, t in server.metrics.transfer_totals.items()},
            ),
            503 if not server.client.is_alive else 200,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request, config.api_key, config.cluster_secret)
        assert server.ready is not None
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.started,
            "owned_by": "pdserve",
            "root": server.model_name,  # never the absolute path of the model on this host
            "max_model_len": server.ready.max_model_len,
        }
        return _json_response({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = decode_body(await server.body(request), CompletionRequest)
        server.check_model(req.model)
        check_unsupported(req)
        n = num_choices(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="logprobs")
        prompts = await server.tokenize_prompts(req.prompt)
        wanted = 16 if req.max_tokens is None else req.max_tokens
        params = [
            sampling_params(req, server.check_prompt(ids, wanted, "prompt"), req.logprobs) for ids in prompts
        ]
        job = server.new_job(
            "cmpl",
            prompts,
            n,
            bool(req.stream),
            bool(req.stream_options and req.stream_options.include_usage),
            req.logprobs,
        )
        kv = server.kv_transfer_of(req, job, request)
        server.submit(job, params, kv)
        if kv is not None and not kv.remote_decode:
            return await _after_reservation(server, job, kv, request, chat=False)
        if job.stream:
            return WatchedStream(_stream(server, job, chat=False), media_type="text/event-stream")
        return await _respond(server, job, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = decode_body(await server.body(request), ChatCompletionRequest)
        server.check_model(req.model)
        check_unsupported(req)
        n = num_choices(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs"
                )
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        messages = chat_message_dicts(req.messages)
        add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        ids = await server.tokenize_chat(messages, add_generation_prompt)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = [sampling_params(req, server.check_prompt(ids, wanted, "messages"), num_logprobs)]
        job = server.new_job(
            "chatcmpl",
            [ids],
            n,
            bool(req.stream),
            bool(req.stream_options and req.stream_options.include_usage),
            num_logprobs,
        )
        kv = server.kv_transfer_of(req, job, request)
        server.submit(job, params, kv)
        if kv is not None and not kv.remote_decode:
            return await _after_reservation(server, job, kv, request, chat=True)
        if job.stream:
            return WatchedStream(_stream(server, job, chat=True), media_type="text/event-stream")
        return await _respond(server, job, request, chat=True)

    return app


async def _log_stats(metrics: ServerMetrics, interval: float) -> None:
    stats = StatsLogger(metrics)
    while True:
        await asyncio.sleep(interval)
        stats.log()


# ---- responses -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far (all of it for a whole response, counts for a stream)."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)  # only when logprobs are wanted
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text_offset: int = 0
    sent_role: bool = False


class _Format:
    """How one endpoint spells its objects; the rest of the response logic is shared."""

    def __init__(self, server: Server, job: _Job, chat: bool) -> None:
        self.server, self.job, self.chat = server, job, chat
        self.logprobs = server.logprob_formatter if job.logprobs is not None else None

    def head(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.job.http_id,
            "object": kind,
            "created": self.job.created,
            "model": self.server.model_name,
        }

    def whole(self, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        lp = self.logprobs
        if self.chat:
            logprobs = {"content": lp.chat(c.token_ids, c.logprobs, self.job.logprobs or 0)} if lp else None
            return {"message": {"role": "assistant", "content": text}, "logprobs": logprobs}
        return {"text": text, "logprobs": lp.completion(c.token_ids, c.logprobs, 0)[0] if lp else None}

    def delta(self, c: _Choice, d: RequestDelta) -> dict[str, Any]:
        lp = self.logprobs if d.logprobs else None
        if not self.chat:
            logprobs = None
            if lp is not None:
                logprobs, c.text_offset = lp.completion(d.new_token_ids, d.logprobs or [], c.text_offset)
            return {"text": d.new_text, "logprobs": logprobs}
        delta: dict[str, Any] = {}
        if not c.sent_role:  # the role rides on the first chunk that carries text, not ahead of it
            delta["role"] = "assistant"
            c.sent_role = True
        if d.new_text or "role" in delta:
            delta["content"] = d.new_text
        logprobs = None
        if lp is not None:
            logprobs = {"content": lp.chat(d.new_token_ids, d.logprobs or [], self.job.logprobs or 0)}
        return {"delta": delta, "logprobs": logprobs}


async def _respond(server: Server, job: _Job, request: Request, chat: bool) -> Response:
    """Collect every choice of `job` into one JSON body."""
    fmt = _Format(server, job, chat)
    choices = [_Choice() for _ in range(job.num_choices)]

    def add(index: int, d: RequestDelta) -> None:
        _add_delta(fmt, choices[index], d)

    if not await _collect(job, request, server, add):
        return Response(status_code=499)  # nobody is listening any more
    return _json_response(_whole_body(fmt, job, choices))


def _add_delta(fmt: _Format, c: _Choice, d: RequestDelta) -> None:
    c.text.append(d.new_text)
    c.num_tokens += len(d.new_token_ids)
    if fmt.logprobs is not None and d.logprobs:
        c.token_ids.extend(d.new_token_ids)
        c.logprobs.extend(d.logprobs)
    if d.finish_reason is not None:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason


def _whole_body(fmt: _Format, job: _Job, choices: list[_Choice]) -> dict[str, Any]:
    body = fmt.head(stream=False)
    body["choices"] = [
        {"index": i, **fmt.whole(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for i, c in enumerate(choices)
    ]
    body["usage"] = usage(job.num_prompt_tokens, sum(c.num_tokens for c in choices))
    return body


async def _after_reservation(
    server: Server, job: _Job, kv: KVTransferParams, request: Request, chat: bool
) -> Response:
    """A decode instance's answer to a remote-prefill request: headers as soon as its blocks are
    reserved (the router then starts the prefill), then the usual body."""
    got = asyncio.ensure_future(job.queue.get())
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({got, gone}, timeout=job.time_left(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not got.done():
            got.cancel()
            server.client.abort(job.req_ids)
    if not got.done() or got.cancelled():
        if not gone.done():
            raise server.timed_out()
        return Response(status_code=499)  # the router went away before the blocks were reserved
    _, d = got.result()
    if d.finish_reason == "error":
        raise server.error_of(d)
    if d.kv_skip_tokens is None or d.finish_reason is not None:  # nothing else comes first
        server.client.abort(job.req_ids)
        raise APIError(500, "the engine did not reserve KV blocks for this request", "server_error")
    r = server.ready
    assert r is not None
    reservation = wire.KVReservation(
        transfer_id=kv.transfer_id, address=r.kv_address, backend=r.kv_backend, skip_tokens=d.kv_skip_tokens
    )
    headers = {wire.KV_RESERVATION_HEADER: _json.encode(reservation).decode()}
    if job.stream:
        body = _stream(server, job, chat)
        return WatchedStream(body, media_type="text/event-stream", headers=headers)
    return WatchedStream(_json_when_done(server, job, chat), media_type="application/json", headers=headers)


async def _json_when_done(server: Server, job: _Job, chat: bool) -> AsyncIterator[bytes]:
    """A whole (non-streaming) body sent as a stream, so that headers can go out before it is ready.
    An error after the headers is the body (status 200 is gone by then)."""
    fmt = _Format(server, job, chat)
    choices = [_Choice() for _ in range(job.num_choices)]
    remaining = job.num_choices
    try:
        while remaining:
            try:
                index, d = await job.next_delta()
            except asyncio.TimeoutError:
                yield _json.encode(server.timed_out().body())
                return
            if d.finish_reason == "error":
                yield _json.encode(server.error_of(d).body())
                return
            _add_delta(fmt, choices[index], d)
            if d.finish_reason is not None:
                remaining -= 1
        yield _json.encode(_whole_body(fmt, job, choices))
    finally:
        server.client.abort(job.req_ids)


async def _stream(server: Server, job: _Job, chat: bool) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per delta that shows something, an optional usage chunk, [DONE].
    Leaving early (the client went away) aborts the requests still running."""
    fmt = _Format(server, job, chat)
    head = fmt.head(stream=True)
    choices = [_Choice() for _ in range(job.num_choices)]
    remaining = job.num_choices
    try:
        while remaining:
            try:
                index, d = await job.next_delta()
            except asyncio.TimeoutError:
                yield _sse(server.timed_out().body())
                break
            if d.finish_reason == "error":
                yield _sse(server.error_of(d).body())
                break
            c = choices[index]
            c.num_tokens += len(d.new_token_ids)
            if d.finish_reason is not None:
                remaining -= 1
            if not (d.new_text or d.finish_reason or (fmt.logprobs and d.logprobs)):
                continue  # text held back (partial character, possible stop string): nothing to show yet
            choice = {"index": index, **fmt.delta(c, d), "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            chunk = {**head, "choices": [choice]}
            if job.include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
        else:
            if job.include_usage:
                total = sum(c.num_tokens for c in choices)
                yield _sse({**head, "choices": [], "usage": usage(job.num_prompt_tokens, total)})
        yield _DONE
    finally:
        server.client.abort(job.req_ids)


# ---- running -------------------------------------------------------------------------------------


def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT/SIGTERM; both processes are gone when this returns."""
    run_uvicorn(
        build_app(config),
        host=config.host,
        port=config.port,
        access_log=config.access_log,
        max_connections=config.max_connections,
        header_timeout_s=config.header_timeout_s,
        graceful_shutdown_s=max(1, int(config.shutdown_timeout_s)),
    )
