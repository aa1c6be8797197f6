"""Tool calling with `tool_choice: "auto"` over HTTP: a tiny random model served with Qwen2.5's tokenizer
and chat template (which teaches the Hermes `<tool_call>` format). The model's words are forced with a
one-string `choice` constraint, so what is checked is the server's side: the tools reach the template,
and each kind of reply (tagged calls, a bare call object, plain text) comes back as OpenAI's tool calls
or content, whole and streamed alike. (The real Qwen2.5 calling a tool: tests/integration/test_real_qwen2.py.)"""

from __future__ import annotations

import dataclasses
import os

import openai
import pytest

from pdserve.model.loader import resolve_model_path
from pdserve.model.registry import get_model
from pdserve.server.launcher import ServerProcess
from tests.support.server import MAX_MODEL_LEN, MODEL, quiet_env, random_weights_arg
from tests.support.tiny import TINY

pytestmark = pytest.mark.real_model  # Qwen2.5's GGUF, for its tokenizer

QWEN = "qwen2.5-coder-0.5b-instruct"
TINY_QWEN = dataclasses.replace(TINY, vocab_size=151_936, eos_token_ids=(151_645,))
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def client():
    if not get_model(QWEN).is_installed():
        pytest.skip(f"{QWEN} is not installed: {get_model(QWEN).install_command}")
    args = ["--model", QWEN, "--random-weights", random_weights_arg(TINY_QWEN), "--served-model-name", MODEL,
            "--dtype", "float32", "--device", "cpu", "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-gb", "0.05"]
    srv = ServerProcess(args, env=quiet_env()).start()
    try:
        srv.wait_ready(timeout=180)
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        srv.close()


def ask(client, reply: str, stream: bool = False, **kw):  # type: ignore[no-untyped-def]
    """The chat with tools, the model made to say `reply`."""
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0, stream=stream,
        extra_body={"structured_outputs": {"choice": [reply]}}, **kw)


def streamed(client, reply: str, **kw):  # type: ignore[no-untyped-def]
    """(content, [(index, name, arguments)] merged from the deltas, finish reason) of a streamed answer."""
    chunks = [c for c in ask(client, reply, stream=True, **kw) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for t in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(t.index, ["", ""])
            entry[0] += t.function.name or ""
            entry[1] += t.function.arguments or ""
    return content, [(i, *calls[i]) for i in sorted(calls)], chunks[-1].choices[0].finish_reason


TAGGED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("reply", "content", "calls"),
    [
        (TAGGED, "Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        (BARE, None, [("get_weather", '{"city": "Paris"}')]),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON that is no call: content
    ],
)
def test_auto_turns_the_models_calls_into_tool_calls(client, reply, content, calls):
    resp = ask(client, reply)
    choice = resp.choices[0]
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got == calls and choice.message.content == content
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
    s_content, s_calls, s_finish = streamed(client, reply)
    assert (s_content or None) == content and s_finish == choice.finish_reason
    assert s_calls == [(i, *c) for i, c in enumerate(calls)]


def test_auto_without_parallel_calls_keeps_the_first(client):
    resp = ask(client, TAGGED, parallel_tool_calls=False)
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather"]
    assert [c[1] for c in streamed(client, TAGGED, parallel_tool_calls=False)[1]] == ["get_weather"]


def test_the_tools_reach_the_template(client):
    """The prompt with tools is the template's rendering with them (counted against transformers')."""
    transformers = pytest.importorskip("transformers")
    path = resolve_model_path(QWEN)
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))

    def hf_len(tools) -> int:  # type: ignore[no-untyped-def]
        text = hf.apply_chat_template(ASK, tools=tools, add_generation_prompt=True, tokenize=False)
        return len(hf.encode(text, add_special_tokens=False))

    for tools in ([WEATHER, TIME], [WEATHER]):
        resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=1, temperature=0)
        assert resp.usage.prompt_tokens == hf_len(tools) > hf_len(None)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=1, temperature=0)
    assert none.usage.prompt_tokens == hf_len(None)  # "none": the tools are not shown


def test_each_choice_has_its_own_parser(client):
    """n = 2, streamed: both choices' calls arrive under their own index, whole."""
    chunks = [c for c in ask(client, TAGGED, stream=True, n=2) if c.choices]
    calls: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks:
        for t in c.choices[0].delta.tool_calls or []:
            if t.function.name:
                calls[c.choices[0].index].append(t.function.name)
    assert calls == {0: ["get_weather", "get_time"], 1: ["get_weather", "get_time"]}
    whole = ask(client, TAGGED, n=2)
    assert [[t.function.name for t in ch.message.tool_calls] for ch in whole.choices] == [["get_weather", "get_time"]] * 2
