"""Tool calling's request checks, constraints and output parsers (`pdserve.tools`), without a model."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.tools import (
    HermesParser,
    NamedParser,
    RequiredParser,
    ToolCallAccumulator,
    ToolsError,
    finish_reason,
    message_tool_calls,
    plan_tools,
)

HERMES_TEMPLATE = "... <tool_call> ..."  # plan_tools only asks whether the template teaches the format
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def run(parser, text: str, pieces: list[int] | None = None):
    """Feed `text` in pieces of the given sizes (whole by default); (content, merged calls)."""
    content, acc = [], ToolCallAccumulator()
    at = 0
    for size in pieces or [len(text)]:
        c, d = parser.feed(text[at : at + size])
        content.append(c)
        acc.add(d)
        at += size
    c, d = parser.feed(text[at:])
    content.append(c)
    acc.add(d)
    c, d = parser.finish()
    content.append(c)
    acc.add(d)
    return "".join(content), [(x["function"]["name"], x["function"]["arguments"]) for x in acc.calls]


def random_pieces(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out = []
    while sum(out) < n:
        out.append(rng.randint(1, 5))
    return out


CASES = [
    # (model text, content, calls)
    ("Paris is sunny.", "Paris is sunny.", []),
    ("Trailing space and newline \n", "Trailing space and newline \n", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
     "Let me look.", [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")]),
    # not a call: stays content exactly as written
    ("Use <tool_call>not json</tool_call> tags.", "Use <tool_call>not json</tool_call> tags.", []),
    ("x <tool_ca", "x <tool_ca", []),
    ("a < b and <tool> c", "a < b and <tool> c", []),
    # cut off before the closing tag: a whole JSON object is still a call
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
    # arguments given as a JSON string are passed on as they are
    ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', None,
     [("get_time", '{"tz": "UTC"}')]),
]


CASES += [
    # a bare call object (or a list of them) naming a known tool, as small models answer
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('\n[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]', None,
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    # bare JSON that is not such a call is content, as written
    ('{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    ('{"name": "get_time", "arguments": {}, "extra": 1}', '{"name": "get_time", "arguments": {}, "extra": 1}', []),
    ('{"name": "get_time", "arguments": [1]}', '{"name": "get_time", "arguments": [1]}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("[1, 2]", "[1, 2]", []),
    ('{"name": "get_time", "arguments": {}} and more', '{"name": "get_time", "arguments": {}} and more', []),
    ("  \n", "  \n", []),
    # ... or one in a ```json block (Qwen2.5-Coder-1.5B's way)
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('```\n[{"name": "get_time", "arguments": {}}]\n```\n', None, [("get_time", "{}")]),
    ('```JSON\n{"name": "get_time", "arguments": {}}\n```', None, [("get_time", "{}")]),
    ('```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    ('```python\nprint({"name": "get_time"})\n```', '```python\nprint({"name": "get_time"})\n```', []),
    ('```json\n{"name": "get_time", "arguments": {}}\n``` done', '```json\n{"name": "get_time", "arguments": {}}\n``` done', []),
    ("``", "``", []),
]
NAMES = frozenset({"get_weather", "get_time"})


@pytest.mark.parametrize("text,content,calls", CASES)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_hermes_parser_streamed_in_any_pieces_says_what_it_says_whole(text, content, calls, seed):
    pieces = None if seed is None else random_pieces(len(text), seed)
    got_content, got_calls = run(HermesParser(NAMES), text, pieces)
    assert got_calls == calls
    assert (got_content or None) == (content or None)


def test_hermes_parser_holds_back_only_what_may_start_a_call():
    p = HermesParser(NAMES)
    assert p.feed("  ") == ("", [])  # (whether the reply is a bare call is not known yet)
    assert p.feed("Hello <tool") == ("  Hello", [])
    assert p.feed("s> and more") == (" <tools> and more", [])
    assert p.feed("\n\n") == ("", [])  # trailing whitespace waits: a call may follow
    assert p.finish() == ("\n\n", [])  # none did: it is content
    bare = HermesParser(NAMES)
    assert bare.feed('{"name": "get_time",') == ("", [])  # a bare call may be coming: held to the end
    assert bare.feed(' "arguments": {}}')[0] == ""
    assert [d.name for d in bare.finish()[1]] == ["get_time"]
    code = HermesParser(NAMES)
    assert code.feed("```py") == ("", [])  # the fence's language is not known yet
    assert code.feed("thon\nprint(1)") == ("```python\nprint(1)", [])  # code: streamed from its first line


def test_hermes_parser_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert run(HermesParser(max_calls=1), text)[1] == [("a", "{}")]
    bare = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert run(HermesParser(frozenset("ab"), max_calls=1), bare)[1] == [("a", "{}")]


def test_named_parser_streams_the_arguments_under_one_call():
    p = NamedParser("get_weather")
    c0, d0 = p.feed('{"ci')
    c1, d1 = p.feed('ty": "Oslo"}')
    assert (c0, c1) == ("", "") and p.forced
    assert d0[0].name == "get_weather" and d0[0].id and d0[0].index == 0
    assert d1[0].name is None and d1[0].id is None
    assert d0[0].as_openai()["type"] == "function" and "type" not in d1[0].as_openai()
    acc = ToolCallAccumulator()
    acc.add(d0 + d1 + p.finish()[1])
    assert acc.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert finish_reason(p, "stop") == "stop"  # a forced call: as OpenAI, "stop"


def test_required_parser_reads_the_array_and_keeps_a_cut_off_one_as_content():
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    p = RequiredParser()
    assert run(p, text, random_pieces(len(text), 3)) == ("", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    assert finish_reason(p, "stop") == "tool_calls"
    p = RequiredParser()
    assert run(p, text[:30]) == (text[:30], [])
    assert finish_reason(p, "length") == "length"


def test_finish_reason_is_tool_calls_only_when_the_model_called_and_stopped():
    p = HermesParser()
    run(p, '<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert finish_reason(p, "stop") == "tool_calls"
    assert finish_reason(p, "length") == "length"
    q = HermesParser()
    run(q, "no call")
    assert finish_reason(q, "stop") == "stop" and finish_reason(None, "stop") == "stop"


def test_plan_defaults_and_template_tools():
    assert plan_tools(None, None) is None
    assert plan_tools(None, "none") is None
    plan = plan_tools([WEATHER, TIME], None, chat_template=HERMES_TEMPLATE)
    assert plan is not None and plan.choice == "auto" and plan.constraint() is None
    assert plan.template_tools == [WEATHER, TIME]
    assert isinstance(plan.parser(), HermesParser)
    none = plan_tools([WEATHER], "none")
    assert none is not None and none.template_tools is None and none.parser() is None


def test_named_choice_constrains_to_the_functions_parameters():
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert plan is not None and plan.choice == "named"
    assert plan.constraint().json == WEATHER["function"]["parameters"]
    only_name = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert only_name.constraint().json == {"type": "object", "properties": {}}  # no parameters: {}


def test_required_choice_constrains_to_an_array_of_the_tools():
    plan = plan_tools([WEATHER, TIME], "required")
    schema = plan.constraint().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert plan_tools([WEATHER], "required", parallel_tool_calls=False).constraint().json["maxItems"] == 1


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ({"type": "function"}, None, "tools"),
        ([{"type": "retrieval"}], None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], "required", "tools"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "required", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "required", "tools"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "required", "tools"),
        ([WEATHER, WEATHER], "required", "tools"),
        ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "required", "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        (None, "auto", "tool_choice"),
        ([WEATHER], "auto", "tool_choice"),  # no template with a tool-call format
        ([WEATHER], None, "tool_choice"),  # (auto by default)
    ],
)
def test_bad_tools_are_refused_with_the_field_named(tools, choice, param):
    with pytest.raises(ToolsError) as e:
        plan_tools(tools, choice, chat_template="{{ messages }}")
    assert e.value.param == param and isinstance(e.value, InvalidRequestError)


def test_earlier_tool_calls_reach_the_template_with_their_arguments_as_objects():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert message_tool_calls(calls, 0) == [
        {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    for bad in ([{"function": {"name": "f", "arguments": "{not json"}}], [{"function": {"name": 3}}], "x",
                [{"function": {"name": "f", "arguments": {"city": "Oslo"}}}]):
        with pytest.raises(ToolsError):
            message_tool_calls(bad, 0)


def test_required_schema_is_json_serialisable():
    json.dumps(plan_tools([WEATHER, TIME], "required").constraint().json)


def test_parse_tool_calls_reads_a_whole_reply_as_the_server_does():
    from pdserve.tools import parse_tool_calls

    content, calls = parse_tool_calls('Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                                      [WEATHER, TIME])
    assert content == "Sure." and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert parse_tool_calls("Just text.", [WEATHER]) == ("Just text.", [])
    assert parse_tool_calls('{"name": "get_time", "arguments": {}}', [WEATHER])[1] == []  # not a given tool
