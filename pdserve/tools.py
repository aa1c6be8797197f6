"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on chat requests. Torch-free.

`plan_tools` checks what a request sent and returns a `ToolPlan`, which says three things:

- which tools the chat template shows the model (`template_tools`: none with `tool_choice: "none"`);
- the output constraint, if any (`constraint`, a `StructuredOutputs` JSON schema, compiled and enforced
  like any structured output): a named function (`{"type": "function", "function": {"name": ...}}`)
  constrains the output to that function's `parameters` schema, and `"required"` to a JSON array of one
  or more `{"name": ..., "parameters": {...}}` objects, one of the tools each (vLLM's way; any model,
  whatever its template);
- how the output becomes tool calls (`parser`): for `"auto"` the model decides, in the format its chat
  template taught it. Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Qwen2.5, Hermes, many others) are parsed, and a reply that is only such an object without the tags;
  a template without that format cannot take `"auto"` (a 400 that says to ask for `"required"` or a
  named function instead).

A parser reads a choice's text as it arrives (`feed`, then `finish`) and returns the content to show
and the tool-call deltas (OpenAI's streaming shape: index, then id / name / a piece of the arguments).
A whole response is the same deltas merged (`ToolCallAccumulator`), so a streamed answer and a whole one
say the same thing. Text that cannot be parsed as a call stays content, never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pdserve.errors import InvalidRequestError
from pdserve.structured import MAX_SPEC_CHARS, StructuredOutputs

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"

ToolChoice = Literal["none", "auto", "required", "named"]


class ToolsError(InvalidRequestError):
    """A bad `tools` / `tool_choice` / tool message; `param` names the field (the server's 400 says it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call `index` (OpenAI's streaming shape): its first piece carries the id and name,
    every piece some of the arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            fn = {"name": self.name, **fn}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        out["function"] = fn
        return out


class ToolCallAccumulator:
    """Deltas merged into whole calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def add(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            if d.index == len(self.calls):
                self.calls.append({"id": d.id or new_call_id(), "type": "function",
                                   "function": {"name": d.name or "", "arguments": ""}})
            self.calls[d.index]["function"]["arguments"] += d.arguments


class ToolParser(Protocol):
    """Reads one choice's text as it arrives; returns (content to show, tool-call deltas)."""

    made_calls: bool
    forced: bool  # the calls were constrained (a named function): the finish reason stays "stop"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]: ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]: ...


@dataclass(frozen=True, slots=True)
class ToolPlan:
    choice: ToolChoice
    tools: tuple[dict[str, Any], ...]  # as checked, in OpenAI's shape (what the template renders)
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.choice == "none" or not self.tools else list(self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)

    def constraint(self) -> StructuredOutputs | None:
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutputs(json=self.parameters(self.name))
        if self.choice == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                   "parameters": self.parameters(t["function"]["name"])},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs(json=schema)
        return None

    def parser(self) -> ToolParser | None:
        if self.choice == "named":
            assert self.name is not None
            return NamedParser(self.name)
        if self.choice == "required":
            return RequiredParser()
        if self.choice == "auto":
            names = frozenset(t["function"]["name"] for t in self.tools)
            return HermesParser(names, max_calls=None if self.parallel else 1)
        return None


def plan_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None = None, chat_template: str | None = None
) -> ToolPlan | None:
    """The request's tool calling, checked (ToolsError otherwise); None when it asks for none. Defaults
    as OpenAI's: `tool_choice` "auto" with tools, "none" without."""
    if tools is not None and not isinstance(tools, list):
        raise ToolsError("tools must be a list", "tools")
    checked = tuple(_check_tool(t, i) for i, t in enumerate(tools or []))
    if len(checked) > MAX_TOOLS:
        raise ToolsError(f"at most {MAX_TOOLS} tools may be given, got {len(checked)}", "tools")
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise ToolsError("tool names must be unique", "tools")
    if sum(len(json.dumps(t)) for t in checked) > MAX_SPEC_CHARS:
        raise ToolsError(f"the tools' JSON must be at most {MAX_SPEC_CHARS} characters", "tools")
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    choice: ToolChoice
    name = None
    if tool_choice is None:
        choice = "auto" if checked else "none"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolsError('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in names:
            raise ToolsError(f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice")
        choice = "named"
    else:
        raise ToolsError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                         '"function": {"name": ...}}', "tool_choice")
    if choice in ("auto", "required") and not checked:
        raise ToolsError(f'tool_choice "{choice}" needs tools', "tool_choice")
    if choice == "none" and not checked:
        return None
    if choice == "auto" and HERMES_OPEN not in (chat_template or ""):
        raise ToolsError(
            'tool_choice "auto" needs a model whose chat template teaches a tool-call format pdserve parses '
            "(Hermes <tool_call> JSON, as Qwen2.5's); this model's does not. Ask for tool_choice \"required\" "
            "or a named function: the output is then constrained to the tools' schemas", "tool_choice")
    return ToolPlan(choice, checked, name, parallel)


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)):
        raise ToolsError(f'{where} must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ToolsError(f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _, . and -", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolsError(f"{where}.function.description must be a string", "tools")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolsError(f"{where}.function.parameters must be a JSON schema object", "tools")
    return {"type": "function", "function": dict(fn)}  # as sent (`strict` too): templates show what they get


def message_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates expect them: the arguments as an object
    (OpenAI sends them as JSON text; templates such as Qwen2.5's write them with `tojson`)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ToolsError(f"{where} must be a list", "messages")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if not (isinstance(name, str) and _NAME.fullmatch(name)) or not isinstance(args, str):
            raise ToolsError(f'{where}[{k}] must be {{"type": "function", "function": {{"name": ..., '
                             '"arguments": "<JSON text>"}}', "messages")
        try:
            parsed = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise ToolsError(f"{where}[{k}].function.arguments is not valid JSON", "messages") from None
        call_id = c.get("id")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": parsed}}
        if isinstance(call_id, str):
            entry["id"] = call_id
        out.append(entry)
    return out


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]], max_calls: int | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply to a chat with `tools` (as `LLM.chat(..., tools=...)` returns it), read as the
    server reads an `"auto"` reply: (content, or None when only calls; OpenAI's tool calls)."""
    parser = HermesParser(frozenset(t["function"]["name"] for t in tools), max_calls)
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    calls = ToolCallAccumulator()
    calls.add(deltas + more)
    return (content + rest) or (None if calls.calls else ""), calls.calls


def finish_reason(parser: ToolParser | None, reason: str | None) -> str | None:
    """OpenAI's finish reason: "tool_calls" where the model chose to call tools and stopped by itself."""
    if parser is not None and parser.made_calls and not parser.forced and reason == "stop":
        return "tool_calls"
    return reason


class NamedParser:
    """A named function: the whole output is its arguments, streamed as they come."""

    forced = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.made_calls = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.made_calls:
            return "", [ToolCallDelta(0, text)] if text else []
        self.made_calls = True
        return "", [ToolCallDelta(0, text, new_call_id(), self.name)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("") if not self.made_calls else ("", [])


class RequiredParser:
    """`"required"`: a JSON array of {"name", "parameters"} objects, read whole at the end (a cut-off
    array stays content, the finish reason then says "length")."""

    forced = False

    def __init__(self) -> None:
        self.text: list[str] = []
        self.made_calls = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.text.append(text)
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        text = "".join(self.text)
        try:
            calls = json.loads(text)
            deltas = [ToolCallDelta(k, json.dumps(c["parameters"], ensure_ascii=False), new_call_id(), c["name"])
                      for k, c in enumerate(calls)]
        except (ValueError, TypeError, KeyError, RecursionError):
            return text, []
        self.made_calls = bool(deltas)
        return "", deltas


class HermesParser:
    """`"auto"` for Hermes-style templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks become calls, the text around them content. Text that may be the start of a block, and
    whitespace before one, is held back until it is known; a block that is not such JSON stays content
    as written; whitespace around calls is dropped. `max_calls` (1 without parallel tool calls): blocks
    past it are dropped.

    Small models taught this format often answer with the bare object, without the tags, or in a
    Markdown code block (asked for the weather with a weather tool, greedy: Qwen2.5-Coder-0.5B-Instruct
    writes the bare object, the 1.5B a ```json block). So a reply that opens with `{` or `[`, or with a
    ```json (or bare ```) line followed by one of them, is held to its end, and is a call if it is
    such an object naming one of `tool_names` (or a list of them); otherwise it is content, sent then.
    Any other reply streams as it comes (a code block in another language once its first line is in)."""

    forced = False

    def __init__(self, tool_names: frozenset[str] = frozenset(), max_calls: int | None = None) -> None:
        self.tool_names = tool_names
        self.max_calls = max_calls
        self.buf = ""
        self.in_call = False
        self.num_calls = 0
        self.ws = ""  # the whitespace before the open block (dropped if it is a call)
        self.bare: bool | None = None  # whether the reply opens as a bare JSON value (None: not known yet)

    @property
    def made_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        if self.bare is None:
            self.bare = _opens_a_bare_call(self.buf)
        if self.bare is not False:  # held: a bare call may be coming (or nothing but whitespace yet)
            return "", []
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self.in_call:
                end = self.buf.find(HERMES_CLOSE)
                if end < 0:
                    break
                self._close(self.buf[:end], content, deltas)
                self.buf = self.buf[end + len(HERMES_CLOSE):]
                continue
            start = self.buf.find(HERMES_OPEN)
            if start >= 0:
                before = self.buf[:start]
                kept = before.rstrip()
                content.append(kept)
                self.ws = before[len(kept):]
                self.buf = self.buf[start + len(HERMES_OPEN):]
                self.in_call = True
                continue
            keep = _held_back(self.buf)
            content.append(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        out = "".join(content)
        if self.made_calls and out.isspace():
            out = ""
        return out, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self.bare:
            calls = self._bare_calls(self.buf)
            if calls is None:
                content.append(self.buf)
            for name, arguments in calls or []:
                self._add(name, arguments, deltas)
        elif self.in_call:  # cut off before its closing tag: parsed if whole, else content
            self._close(self.buf, content, deltas, closed=False)
        elif not (self.made_calls and self.buf.isspace()):
            content.append(self.buf)
        self.buf = ""
        return "".join(content), deltas

    def _close(self, body: str, content: list[str], deltas: list[ToolCallDelta], closed: bool = True) -> None:
        self.in_call = False
        call = _hermes_call(body)
        ws, self.ws = self.ws, ""
        if call is None:
            content.append(ws + HERMES_OPEN + body + (HERMES_CLOSE if closed else ""))
            return
        self._add(*call, deltas)

    def _add(self, name: str, arguments: str, deltas: list[ToolCallDelta]) -> None:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return
        deltas.append(ToolCallDelta(self.num_calls, arguments, new_call_id(), name))
        self.num_calls += 1

    def _bare_calls(self, text: str) -> list[tuple[str, str]] | None:
        """The calls of a reply that is one bare call object or a list of them, naming known tools."""
        body = text.strip()
        if body.startswith("```"):
            first, _, body = body.partition("\n")
            if first[3:].strip().lower() not in ("", "json") or not body.rstrip().endswith("```"):
                return None
            body = body.rstrip()[:-3]
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        items = value if isinstance(value, list) and value else [value]
        calls = [_call_of(item) for item in items]
        if any(c is None or c[0] not in self.tool_names for c in calls):
            return None
        return calls  # type: ignore[return-value]


def _opens_a_bare_call(text: str) -> bool | None:
    """Whether a reply beginning with `text` may be a bare call: a JSON value, or a ```json (or ```)
    line and then one; None while that is not known yet."""
    head = text.lstrip()
    if not head:
        return None
    if head[0] in "{[":
        return True
    if not head.startswith("```"):
        return None if "```".startswith(head) else False
    line, newline, rest = head.partition("\n")
    if not newline:
        return None if len(line) <= 16 else False  # (a fence's language is a short word)
    if line[3:].strip().lower() not in ("", "json"):
        return False
    rest = rest.lstrip()
    return (rest[0] in "{[") if rest else None


def _held_back(text: str) -> int:
    """How many trailing characters of `text` to hold: a proper prefix of the opening tag, and the
    whitespace before it or at the end (it is dropped if a call follows)."""
    keep = 0
    for k in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            keep = k
            break
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a block's JSON, or None if it is not such an object."""
    try:
        return _call_of(json.loads(body), strict=False)
    except (ValueError, RecursionError):
        return None


def _call_of(obj: Any, strict: bool = True) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of {"name": ..., "arguments" (or "parameters"): {...} or JSON text};
    `strict`: no other keys (a bare object, without the tags that say it is a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if strict and not set(obj) <= {"name", "arguments", "parameters"}:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
