"""The HTTP front's state and its request-side logic: the model's names, the engine client, the tokenizer
(after startup); checks (model name, prompt against context and KV capacity, text length before
tokenizing, disaggregation parameters), tokenization off the event loop, and the all-or-nothing
submission of a request's engine requests (`Job`: one HTTP request, prompt-major then choice). The routes
that use it are in `api.py`, the responses it feeds in `responses.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from fastapi import Request

from pdserve.config import ServerConfig
from pdserve.errors import InvalidRequestError
from pdserve.engine.process.messages import KVTransferParams, Ready, RequestDelta
from pdserve.server import wire
from pdserve.server.chat import ChatEncoder
from pdserve.engine.process.client import EngineClient, EngineDeadError, OverloadedError
from pdserve.server.guards import check_api_key, check_cluster, check_json_content_type, read_body
from pdserve.server.metrics import ServerMetrics
from pdserve.server.protocol import APIError, LogprobFormatter, StreamOptions, bad_request, choice_seed
from pdserve.structured import GrammarCompiler
from pdserve.tools import ToolPlan

# A token is rarely more than a few characters: a text this many times longer than the context cannot
# fit, and is refused before it is tokenized.
_MAX_CHARS_PER_TOKEN = 32


def served_model_name(config: ServerConfig, model_path: str) -> str:
    if config.served_model_name:
        return config.served_model_name
    return os.path.basename(model_path.rstrip("/")).removesuffix(".gguf")


@dataclass(slots=True)
class Job:
    """One HTTP generation request: its engine requests (prompt-major, then choice) and their queue."""

    http_id: str
    created: int
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: list[str] | None = None  # completions with `echo`: each prompt's text, put before its choices'
    tools: ToolPlan | None = None  # chat with tools: how each choice's text becomes tool calls
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
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
        self.grammars: GrammarCompiler | None = None  # built at the first request with a constraint
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

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Template and tokenize the messages (and the tools the template shows) in a worker thread, after
        a cheap length check."""
        texts = [m["content"] for m in messages]
        texts += [json.dumps(m["tool_calls"]) for m in messages if m.get("tool_calls")]
        self.check_text_length(texts + ([json.dumps(tools)] if tools else []), "messages")

        encoder = self.chat_encoder
        assert encoder is not None

        def run() -> list[int]:
            try:  # message content is encoded as plain text: no special tokens typed by the user
                return encoder.encode(messages, add_generation_prompt, tools)
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

    def kv_transfer_of(self, req: Any, job: Job, request: Request) -> KVTransferParams | None:
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
    def submit(self, job: Job, params: list[Any], kv_transfer: KVTransferParams | None = None) -> None:
        """Send every engine request of `job` (params: one per prompt, before the per-choice seed)."""
        if job.num_choices > self.config.max_waiting:
            raise bad_request(
                f"this request asks for {job.num_choices} completions (prompts x n), more than the "
                f"server ever queues at once ({self.config.max_waiting}, set by --max-waiting)",
                param="n",
            )
        assert self.ready is not None
        for p in params:
            try:
                p.check_vocab(self.ready.vocab_size)
            except InvalidRequestError as e:
                raise bad_request(str(e), param="logit_bias") from None
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

    def new_job(self, prefix: str, prompts: list[list[int]], n: int, stream: bool,
                stream_options: StreamOptions | None, logprobs: int | None, echo: list[str] | None = None,
                tools: ToolPlan | None = None) -> Job:
        timeout = self.config.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        usage = bool(stream_options and stream_options.include_usage)
        continuous = usage and bool(stream_options and stream_options.continuous_usage_stats)
        return Job(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), prompts, n, stream, usage, logprobs,
                   echo, tools, continuous, deadline=deadline)

    async def check_structured(self, params: list[Any], param: str) -> None:
        """Compile the request's output constraint here (off the event loop) so that a bad one is a 400
        before anything reaches the engine, which compiles it again for its own use."""
        spec = params[0].structured_outputs if params else None
        if spec is None:
            return
        if self.grammars is None:
            self.grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.ready.vocab_size if self.ready else 0,
                                                          frozenset())
            if self.grammars is None:
                raise bad_request("structured outputs need the model's tokenizer", param=param)
        try:
            await asyncio.to_thread(self.grammars.compile, spec)
        except InvalidRequestError as e:
            raise bad_request(str(e), param=param) from None

    def prompt_texts(self, prompt: str | list[Any], ids: list[list[int]]) -> list[str]:
        """Each prompt's text as `echo` repeats it: as sent, or decoded where it came as token ids."""
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        assert self.tokenizer is not None
        return [self.tokenizer.decode(p, skip_special_tokens=False) for p in ids]

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
