"""How a job's deltas become an HTTP answer: one JSON body (`respond`), server-sent events (`stream`),
a decode instance's early headers once its KV blocks are reserved (`after_reservation`, then either).
`Format` is where the completions and chat endpoints differ; the rest is shared. Every path aborts the
job's engine requests when it ends, so a client that leaves frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from pdserve.engine.process.messages import KVTransferParams, RequestDelta
from pdserve.server import wire
from pdserve.server.front import Job, Server
from pdserve.server.http import WatchedStream, wait_disconnect
from pdserve.server.protocol import APIError, usage
from pdserve.tools import ToolCallAccumulator, ToolParser, finish_reason

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json", headers=headers)


def sse(body: Any) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


async def collect(job: Job, request: Request, server: Server, on_delta: Any) -> bool:
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



@dataclass(slots=True)
class Choice:
    """What one choice has produced so far (all of it for a whole response, counts for a stream)."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache (known at the end)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)  # only when logprobs are wanted
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # echo with logprobs
    text_offset: int = 0
    sent_role: bool = False
    sent_echo: bool = False
    tools: ToolParser | None = None  # a chat with tools: what turns this choice's text into tool calls


class Format:
    """How one endpoint spells its objects; the rest of the response logic is shared."""

    def __init__(self, server: Server, job: Job, chat: bool) -> None:
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

    def new_choice(self) -> Choice:
        tools = self.job.tools
        return Choice(tools=tools.parser() if tools is not None and self.chat else None)

    def finish_reason(self, c: Choice, reason: str | None) -> str | None:
        return finish_reason(c.tools, reason)

    def whole(self, c: Choice, index: int) -> dict[str, Any]:
        text = "".join(c.text)
        lp = self.logprobs
        if self.chat:
            logprobs = {"content": lp.chat(c.token_ids, c.logprobs, self.job.logprobs or 0)} if lp else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if c.tools is not None:  # the same parser as a stream's, fed the text at once
                calls = ToolCallAccumulator()
                content, deltas = c.tools.feed(text)
                rest, more = c.tools.finish()
                calls.add(deltas + more)
                message["content"] = (content + rest) or (None if calls.calls else "")
                if calls.calls:
                    message["tool_calls"] = calls.calls
            return {"message": message, "logprobs": logprobs}
        prefix, prompt_lp = self._echo(c, index, c.prompt_logprobs)
        logprobs = self._completion_logprobs(c, index, prompt_lp, c.token_ids, c.logprobs) if lp else None
        return {"text": prefix + text, "logprobs": logprobs}

    def echo_pending(self, c: Choice) -> bool:
        """Whether this completion choice still owes its echoed prompt (sent with its first chunk)."""
        return self.job.echo is not None and not c.sent_echo

    def delta(self, c: Choice, d: RequestDelta, index: int) -> dict[str, Any]:
        lp = self.logprobs if d.logprobs else None
        if not self.chat:
            prefix, prompt_lp = self._echo(c, index, d.prompt_logprobs)
            logprobs = None
            if lp is not None or prompt_lp is not None:
                logprobs = self._completion_logprobs(c, index, prompt_lp, d.new_token_ids, d.logprobs or [])
            return {"text": prefix + d.new_text, "logprobs": logprobs}
        delta: dict[str, Any] = {}
        if not c.sent_role:  # the role rides on the first chunk that carries text, not ahead of it
            delta["role"] = "assistant"
            c.sent_role = True
        text, calls = d.new_text, []
        if c.tools is not None:
            text, calls = c.tools.feed(d.new_text)
            if d.finish_reason is not None:
                rest, more = c.tools.finish()
                text, calls = text + rest, calls + more
        if text or "role" in delta:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [call.as_openai() for call in calls]
        logprobs = None
        if lp is not None:
            logprobs = {"content": lp.chat(d.new_token_ids, d.logprobs or [], self.job.logprobs or 0)}
        return {"delta": delta, "logprobs": logprobs}

    def _echo(
        self, c: Choice, index: int, prompt_logprobs: list[dict[int, float] | None] | None
    ) -> tuple[str, list[dict[int, float] | None] | None]:
        """The prompt text to put before this choice's text, and its tokens' logprobs (with logprobs),
        the first time the choice is written (`echo`); nothing after that or without echo."""
        if not self.echo_pending(c):
            return "", None
        assert self.job.echo is not None
        c.sent_echo = True
        return self.job.echo[index // self.job.n], prompt_logprobs if self.logprobs is not None else None

    def _completion_logprobs(
        self,
        c: Choice,
        index: int,
        prompt_lp: list[dict[int, float] | None] | None,
        token_ids: list[int],
        entries: list[dict[int, float]],
    ) -> dict[str, list[Any]]:
        """The completions `logprobs` object for these tokens, after the echoed prompt's tokens if given;
        the choice's text offset carried on."""
        lp = self.logprobs
        assert lp is not None
        if prompt_lp is not None:
            ids, all_entries = self.job.prompts[index // self.job.n] + token_ids, [*prompt_lp, *entries]
        else:
            ids, all_entries = token_ids, list(entries)
        body, c.text_offset = lp.completion(ids, all_entries, c.text_offset)
        return body


async def respond(server: Server, job: Job, request: Request, chat: bool) -> Response:
    """Collect every choice of `job` into one JSON body."""
    fmt = Format(server, job, chat)
    choices = [fmt.new_choice() for _ in range(job.num_choices)]

    def add(index: int, d: RequestDelta) -> None:
        add_delta(fmt, choices[index], d)

    if not await collect(job, request, server, add):
        return Response(status_code=499)  # nobody is listening any more
    return json_response(whole_body(fmt, job, choices))


def add_delta(fmt: Format, c: Choice, d: RequestDelta) -> None:
    c.text.append(d.new_text)
    c.num_tokens += len(d.new_token_ids)
    if fmt.logprobs is not None and d.logprobs:
        c.token_ids.extend(d.new_token_ids)
        c.logprobs.extend(d.logprobs)
    if d.prompt_logprobs is not None:
        c.prompt_logprobs = d.prompt_logprobs
    if d.finish_reason is not None:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        c.num_cached_tokens = d.num_cached_tokens


def whole_body(fmt: Format, job: Job, choices: list[Choice]) -> dict[str, Any]:
    body = fmt.head(stream=False)
    body["choices"] = [
        {"index": i, **fmt.whole(c, i), "finish_reason": fmt.finish_reason(c, c.finish_reason),
         "stop_reason": c.stop_reason}
        for i, c in enumerate(choices)
    ]
    body["usage"] = usage(job.num_prompt_tokens, sum(c.num_tokens for c in choices), cached_tokens(job, choices))
    return body


def cached_tokens(job: Job, choices: list[Choice]) -> int:
    """Prompt tokens found in the prefix cache, each prompt counted once (by its first choice), as
    `usage.prompt_tokens` counts each prompt once."""
    return sum(choices[p * job.n].num_cached_tokens for p in range(len(job.prompts)))


async def after_reservation(
    server: Server, job: Job, kv: KVTransferParams, request: Request, chat: bool
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
        body = stream(server, job, chat)
        return WatchedStream(body, media_type="text/event-stream", headers=headers)
    return WatchedStream(json_when_done(server, job, chat), media_type="application/json", headers=headers)


async def json_when_done(server: Server, job: Job, chat: bool) -> AsyncIterator[bytes]:
    """A whole (non-streaming) body sent as a stream, so that headers can go out before it is ready.
    An error after the headers is the body (status 200 is gone by then)."""
    fmt = Format(server, job, chat)
    choices = [fmt.new_choice() for _ in range(job.num_choices)]
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
            add_delta(fmt, choices[index], d)
            if d.finish_reason is not None:
                remaining -= 1
        yield _json.encode(whole_body(fmt, job, choices))
    finally:
        server.client.abort(job.req_ids)


async def stream(server: Server, job: Job, chat: bool) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per delta that shows something, an optional usage chunk, [DONE].
    Leaving early (the client went away) aborts the requests still running."""
    fmt = Format(server, job, chat)
    head = fmt.head(stream=True)
    choices = [fmt.new_choice() for _ in range(job.num_choices)]
    remaining = job.num_choices
    try:
        while remaining:
            try:
                index, d = await job.next_delta()
            except asyncio.TimeoutError:
                yield sse(server.timed_out().body())
                break
            if d.finish_reason == "error":
                yield sse(server.error_of(d).body())
                break
            c = choices[index]
            c.num_tokens += len(d.new_token_ids)
            if d.finish_reason is not None:
                remaining -= 1
                c.num_cached_tokens = d.num_cached_tokens
            if not (d.new_text or d.finish_reason or (fmt.logprobs and d.logprobs) or fmt.echo_pending(c)):
                continue  # text held back (partial character, possible stop string): nothing to show yet
            body = fmt.delta(c, d, index)
            if not (body.get("delta", True) or d.finish_reason or body.get("logprobs")):
                continue  # a tool parser holds the text back (a call may be starting)
            choice = {"index": index, **body, "finish_reason": fmt.finish_reason(c, d.finish_reason)}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            chunk = {**head, "choices": [choice]}
            if job.include_usage:  # the counts so far with continuous_usage_stats, else only at the end
                running = job.continuous_usage
                chunk["usage"] = usage(job.num_prompt_tokens, sum(c.num_tokens for c in choices)) if running else None
            yield sse(chunk)
        else:
            if job.include_usage:
                total = sum(c.num_tokens for c in choices)
                last = usage(job.num_prompt_tokens, total, cached_tokens(job, choices))
                yield sse({**head, "choices": [], "usage": last})
        yield DONE
    finally:
        server.client.abort(job.req_ids)
