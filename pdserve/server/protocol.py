"""The OpenAI request bodies as typed msgspec structs, their translation into `SamplingParams`, and the
pieces of responses that both endpoints share (errors, usage, logprobs).

Bodies are decoded strictly (a string where a number belongs is a 400, not a coercion); fields a client
may send that pdserve does not implement are accepted at their neutral values and refused otherwise, so
no request silently gets behaviour it did not ask for. Unknown fields are ignored, as OpenAI's own
clients send fields this server has no use for. `ignore_eos`, `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `include_stop_str_in_output` and `skip_special_tokens` are extensions with
vLLM's names; `slo_ttft_ms`, `slo_itl_ms` and `slo_tpot_ms` (per-request latency targets, positive
milliseconds) are pdserve's own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from pdserve.errors import InvalidRequestError
from pdserve.request import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from pdserve.server.wire import ErrorBody, ErrorInfo
from pdserve.structured import StructuredOutputs
from pdserve.tools import ToolPlan, ToolsError, message_tool_calls, plan_tools

MAX_N = 128
MAX_STOP_STRINGS = 16  # each one is matched against the text after every token
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256  # each one is compared with every sampled token, inside the shared step
# Integers a request may carry: what the engine's int64 tensors and msgpack hold. A seed is any int64
# (choices of one prompt use seed, seed + 1, ... wrapping around within int64).
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
StopStrings = str | Annotated[
    list[Annotated[str, msgspec.Meta(max_length=MAX_STOP_STRING_CHARS)]], msgspec.Meta(max_length=MAX_STOP_STRINGS)
]
StopTokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return msgspec.to_builtins(ErrorBody(error=info))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _GenerationRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: Int32 | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: Int32 | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Per-request latency targets in ms (SamplingParams' names; None: the engine's), acted on by the
    # `slo` policy and the slack speculation-length rule, and judged in `pdserve:request_slo_*_total`.
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Structured outputs: OpenAI's {"type": "json_object"} / {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}}, or vLLM's {"json" | "json_object" | "regex" | "choice" | "grammar": ...}.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Disaggregation (set by `pdserve router`, see docs/disaggregation.md):
    # {"remote_prefill": true, "transfer_id": T} on a decode instance,
    # {"remote_decode": {"transfer_id": T, "address": A, "skip_tokens": N}} on a prefill instance.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list[Any]
    max_tokens: Int32 | None = None  # OpenAI's default for completions is 16
    logprobs: Int32 | None = None
    echo: bool | None = None
    best_of: Int32 | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls (`pdserve.tools.message_tool_calls`)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: Int32 | None = None  # None: whatever the context leaves
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    tools: list[Any] | None = None  # checked by `pdserve.tools.plan_tools`
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /tokenize: a prompt, or chat messages (templated as /v1/chat/completions would)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # (a prompt: BOS where the model wants one)
    add_generation_prompt: bool = True  # (messages)
    tools: list[Any] | None = None  # (messages: shown by the template)
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


_PATH_IN_ERROR = re.compile(r"`\$\.([A-Za-z_]+)")  # "... - at `$.messages[0]`": the top-level field
_MISSING_FIELD = re.compile(r"field `([A-Za-z_]+)`")  # "Object missing required field `prompt`"


def decode_body(body: bytes, type_: type[msgspec.Struct]) -> Any:
    """Decode a JSON request body into `type_`, mapping every failure to a 400."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        m = _PATH_IN_ERROR.search(str(e)) or _MISSING_FIELD.search(str(e))
        raise bad_request(f"invalid request: {e}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec's own depth limit: deeply nested arrays or objects
        raise bad_request("the request body is nested too deeply") from None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a prompt: seed + index, wrapped around within int64."""
    return (seed + index + 2**63) % 2**64 - 2**63


def check_unsupported(req: _GenerationRequest) -> None:
    """Refuse parameters that would change the output in ways this server does not implement."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of is not supported (only equal to n)", param="best_of")


def num_choices(req: _GenerationRequest) -> int:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n}", param="n")
    return n


def sampling_params(
    req: _GenerationRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    tools: ToolPlan | None = None,
) -> SamplingParams:
    """The engine's parameters for one choice of `req` (the caller offsets `seed` per choice); `tools`'
    constraint (a named function or "required") in place of the request's own."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias),
            min_tokens=0 if req.min_tokens is None else req.min_tokens,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
            slo_ttft_ms=req.slo_ttft_ms,
            slo_itl_ms=req.slo_itl_ms,
            slo_tpot_ms=req.slo_tpot_ms,
            structured_outputs=_tools_constraint(tools) or structured_outputs_of(req),
        )
    except InvalidRequestError as e:
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=name if name in type(req).__struct_fields__ else None) from None


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs_of(req: _GenerationRequest) -> StructuredOutputs | None:
    """The request's output constraint, from `response_format` or `structured_outputs` (not both); only
    the shapes are checked here (`Front.check_structured` compiles it)."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.get("type", "text") == "text":
        rf = None
    if rf is not None and so is not None:
        raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                return StructuredOutputs(json_object=True)
            if kind != "json_schema":
                raise bad_request(
                    f"response_format.type must be text, json_object or json_schema, got {str(kind)[:32]!r}",
                    param="response_format",
                )
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                    param="response_format",
                )
            return _checked(StructuredOutputs(json=schema), "response_format")
        if so is None:
            return None
        unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
        if unknown:
            raise bad_request(
                f"structured_outputs: unsupported key {unknown[0][:32]!r} (supported: {', '.join(_STRUCTURED_KEYS)})",
                param="structured_outputs",
            )
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        return _checked(StructuredOutputs(**given), "structured_outputs")
    except TypeError:  # (a value of the wrong type in a dataclass field is caught by validate())
        raise bad_request("structured_outputs is malformed", param="structured_outputs") from None


def tool_plan(req: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
    """The request's tool calling (`pdserve.tools`), checked; a constrained tool choice excludes a
    response format of the request's own."""
    try:
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, chat_template)
    except ToolsError as e:
        raise bad_request(str(e), param=e.param) from None
    if plan is not None and plan.choice in ("named", "required"):
        rf = req.response_format
        if (rf is not None and rf.get("type", "text") != "text") or req.structured_outputs is not None:
            raise bad_request(f'tool_choice "{plan.choice}" constrains the output itself: give no '
                              "response_format or structured_outputs with it", param="tool_choice")
    return plan


def _tools_constraint(tools: ToolPlan | None) -> StructuredOutputs | None:
    spec = tools.constraint() if tools is not None else None
    return None if spec is None else _checked(spec, "tools")


def _checked(so: StructuredOutputs, param: str) -> StructuredOutputs:
    try:
        so.validate()
    except InvalidRequestError as e:
        raise bad_request(str(e), param=param) from None
    return so


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings, keyed by ints."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:32]!r}", param="logit_bias")
        out[int(key)] = value
    return out


def chat_message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content, an assistant's tool calls with their
    arguments as objects, a tool message's `tool_call_id`."""
    if not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(
                f"messages[{i}].role {m.role!r} is not one of system, user, assistant, tool", param="messages"
            )
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}]: only text content parts are supported", param="messages"
                    )
                parts.append(part.text)
            content = "".join(parts)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
            try:
                d["tool_calls"] = message_tool_calls(m.tool_calls, i)
            except ToolsError as e:
                raise bad_request(str(e), param=e.param) from None
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `num_cached_tokens` (known once the request finished) its
    `prompt_tokens_details.cached_tokens`: prompt tokens found in the prefix cache."""
    out: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


class LogprobFormatter:
    """Turns the engine's per-token {token_id: logprob} dicts (sampled token first) into OpenAI's two
    formats. Token strings are decoded one id at a time, special tokens included."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: list[int], logprobs: Sequence[dict[int, float] | None], text_offset: int
    ) -> tuple[dict[str, list[Any]], int]:
        """The completions `logprobs` object for these tokens, and the text offset after them. An entry
        of None (an echoed prompt's first token: nothing before it) is null in both lists."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            text = self.token(token_id)
            tokens.append(text)
            token_logprobs.append(None if entry is None else entry.get(token_id))
            top.append(None if entry is None else {self.token(t): lp for t, lp in entry.items()})
            offsets.append(text_offset)
            text_offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
        return body, text_offset

    def chat(
        self, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int
    ) -> list[dict[str, Any]]:
        """The chat `logprobs.content` entries for these tokens."""
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(
                {
                    **self._chat_entry(token_id, entry.get(token_id, float("-inf"))),
                    "top_logprobs": [self._chat_entry(t, lp) for t, lp in best],
                }
            )
        return content

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}
