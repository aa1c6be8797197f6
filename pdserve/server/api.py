"""The HTTP front: OpenAI-compatible routes on FastAPI, served by uvicorn.

A generation request is decoded and checked (`protocol.py`), tokenized here, checked against the context
length and the KV-cache size, and only then sent to the engine core, one engine request per prompt and
choice. Its deltas come back on one queue and are either streamed as server-sent events or collected into
one JSON body. A client that goes away (mid-stream or while waiting for a whole response) has its engine
requests aborted at once, which frees their KV blocks before the engine's next step.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize and
/detokenize (vLLM's), GET /health, GET /load, GET /metrics. The routes are here; the state and the
request-side checks are `front.Server`, the answers (JSON, SSE, the reservation's early headers)
`responses.py`.

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.config import ServerConfig
from pdserve.server import wire
from pdserve.server.front import Server
from pdserve.server.guards import check_api_key, check_cluster
from pdserve.server.http import WatchedStream, make_app, run_uvicorn
from pdserve.server.metrics import ServerMetrics, StatsLogger
from pdserve.server.protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    chat_message_dicts,
    check_unsupported,
    decode_body,
    num_choices,
    sampling_params,
    tool_plan,
)
from pdserve.server.responses import after_reservation, json_response, respond, stream
from pdserve.tools import ToolsError, plan_tools

logger = logging.getLogger(__name__)

__all__ = ["Server", "build_app", "serve"]


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
            return json_response(body, 503)
        if client.is_stale:
            error = (
                f"the engine loop has not been heard from for {client.heartbeat_age:.1f} s "
                f"(limit {config.heartbeat_timeout_s:g} s): it is frozen or in a very long step"
            )
            return json_response({"status": "unhealthy", "error": error}, 503)
        s = client.stats
        return json_response(
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
        return json_response(
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
        return json_response({"object": "list", "data": [card]})

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
        prompt_logprobs = req.logprobs if req.echo else None  # echo with logprobs rates the prompt's tokens
        params = [
            sampling_params(req, server.check_prompt(ids, wanted, "prompt"), req.logprobs, prompt_logprobs)
            for ids in prompts
        ]
        await server.check_structured(params, "response_format" if req.response_format else "structured_outputs")
        job = server.new_job(
            "cmpl",
            prompts,
            n,
            bool(req.stream),
            req.stream_options,
            req.logprobs,
            server.prompt_texts(req.prompt, prompts) if req.echo else None,
        )
        kv = server.kv_transfer_of(req, job, request)
        server.submit(job, params, kv)
        if kv is not None and not kv.remote_decode:
            return await after_reservation(server, job, kv, request, chat=False)
        if job.stream:
            return WatchedStream(stream(server, job, chat=False), media_type="text/event-stream")
        return await respond(server, job, request, chat=False)

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
        tools = tool_plan(req, server.tokenizer.chat_template)
        messages = chat_message_dicts(req.messages)
        add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        ids = await server.tokenize_chat(messages, add_generation_prompt, tools.template_tools if tools else None)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = [sampling_params(req, server.check_prompt(ids, wanted, "messages"), num_logprobs, tools=tools)]
        constrained_by = "tools" if tools is not None and tools.constraint() is not None else (
            "response_format" if req.response_format else "structured_outputs")
        await server.check_structured(params, constrained_by)
        job = server.new_job(
            "chatcmpl",
            [ids],
            n,
            bool(req.stream),
            req.stream_options,
            num_logprobs,
            tools=tools,
        )
        kv = server.kv_transfer_of(req, job, request)
        server.submit(job, params, kv)
        if kv is not None and not kv.remote_decode:
            return await after_reservation(server, job, kv, request, chat=True)
        if job.stream:
            return WatchedStream(stream(server, job, chat=True), media_type="text/event-stream")
        return await respond(server, job, request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's: the token ids of a prompt, or of chat messages as the chat endpoint templates them."""
        req: TokenizeRequest = decode_body(await server.body(request), TokenizeRequest)
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        if req.messages is not None:
            tools = tool_plan_of(req.tools, server.tokenizer.chat_template)
            ids = await server.tokenize_chat(chat_message_dicts(req.messages), req.add_generation_prompt, tools)
        else:
            assert req.prompt is not None
            server.check_text_length([req.prompt], "prompt")
            tok, text, special = server.tokenizer, req.prompt, req.add_special_tokens
            ids = await asyncio.to_thread(lambda: tok.encode(text, add_special_tokens=special))
        assert server.ready is not None
        body: dict[str, Any] = {"count": len(ids), "max_model_len": server.ready.max_model_len, "tokens": ids,
                                "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = [server.tokenizer.id_to_token(t) for t in ids]
        return json_response(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = decode_body(await server.body(request), DetokenizeRequest)
        server.check_model(req.model)
        assert server.ready is not None
        vocab = server.ready.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise bad_request(f"tokens must be integers in [0, {vocab})", param="tokens")
        tok, ids = server.tokenizer, req.tokens
        return json_response({"prompt": await asyncio.to_thread(lambda: tok.decode(ids, skip_special_tokens=False))})

    return app


def tool_plan_of(tools: Any, chat_template: str | None) -> list[dict[str, Any]] | None:
    """The tools a /tokenize request's template shows (checked as the chat endpoint checks them)."""
    if not tools:
        return None
    try:  # (any choice but "none" shows them; "required" asks nothing of the template)
        plan = plan_tools(tools, "required")
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None
    return plan.template_tools if plan is not None else None


async def _log_stats(metrics: ServerMetrics, interval: float) -> None:
    stats = StatsLogger(metrics)
    while True:
        await asyncio.sleep(interval)
        stats.log()


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
