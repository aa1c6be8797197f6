"""The OpenAI-compatible server over real HTTP on 127.0.0.1: a tiny random model served with the real
SmolLM2 tokenizer (so text, chat templates and stop strings are real while steps take milliseconds),
checked against the offline API on the same weights, with the `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM, SamplingParams
from pdserve.model.llama import random_weights
from pdserve.model.loader import default_model_path
from pdserve.model.tokenizer import load_tokenizer
from pdserve.server.launcher import ServerProcess
from tests.support.server import (
    MAX_MODEL_LEN,
    MODEL,
    SEED,
    STD,
    TINY_VOCAB,
    quiet_env,
    scrape,
    tiny_server_args,
    wait_for,
)


@pytest.fixture(scope="module")
def step_log(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("steps") / "steps.jsonl")


@pytest.fixture(scope="module")
def server(step_log):
    srv = ServerProcess(tiny_server_args("--stats-interval", "1", "--step-log", step_log), env=quiet_env()).start()
    try:
        yield srv  # the offline fixture loads while the server starts; tests wait in `url`
    finally:
        srv.close()


@pytest.fixture(scope="module")
def offline():
    threads = torch.get_num_threads()
    tok = load_tokenizer(default_model_path())
    yield LLM(
        dtype="float32",
        device="cpu",
        model_config=TINY_VOCAB,
        weights=random_weights(TINY_VOCAB, SEED, STD),
        tokenizer=tok,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_gb=0.02,
        num_threads=1,
    )
    torch.set_num_threads(threads)  # LLM(num_threads=1) set it for the whole test process


@pytest.fixture(scope="module")
def url(server, offline) -> str:
    server.wait_ready(timeout=120)
    return server.url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def offline_text(offline: LLM, prompt, **params) -> str:  # type: ignore[no-untyped-def]
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


# ---- basics ----------------------------------------------------------------------------------------


def test_models_and_health(url):
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_greedy_equals_offline(client, offline):
    for prompt in PROMPTS:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
        (choice,) = resp.choices
        assert choice.index == 0
        expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_the_step_log_has_a_row_per_step(client, url, step_log):
    """`--step-log`: rows as the offline benchmark's `steps` (what benchmarks/simulate.py calibrates on)."""
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    wait_for(lambda: _health(url)["num_requests_in_flight"] == 0)
    rows = wait_for(lambda: [json.loads(line) for line in open(step_log)] or None)  # flushed when idle
    assert rows and all(len(r) == 6 and r[0] > 0 and r[2] + r[3] > 0 for r in rows)
    assert sum(r[3] for r in rows) >= 5  # this request's decodes, at least
    prompt_rows = [r for r in rows if r[2] > 0]
    assert prompt_rows and all(r[5] >= r[2] for r in prompt_rows)  # context includes the step's own tokens


def test_completion_token_id_prompts_and_several_prompts(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[0])
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == offline_text(offline, PROMPTS[0], temperature=0, max_tokens=8)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in resp.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS[:3]):
        want = offline_text(offline, prompt, temperature=0, max_tokens=6)
        assert resp.choices[2 * i].text == want and resp.choices[2 * i + 1].text == want
    assert resp.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in PROMPTS[:3])
    assert resp.usage.completion_tokens == 36


def test_sampling_params_reach_the_engine(client, offline):
    """Seeded random sampling depends only on the request's own generator, so HTTP equals offline."""
    kw = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": 12}
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], extra_body={"top_k": 50, "min_p": 0.05, "ignore_eos": True}, **kw
    )
    want = offline_text(offline, PROMPTS[2], top_k=50, min_p=0.05, ignore_eos=True, **kw)
    assert resp.choices[0].text == want
    again = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], extra_body={"top_k": 50, "min_p": 0.05, "ignore_eos": True}, **kw
    )
    assert again.choices[0].text == want


def test_penalties_and_logit_bias_reach_the_engine(client, offline):
    kw = {"temperature": 0, "max_tokens": 12, "presence_penalty": 0.6, "frequency_penalty": 0.4}
    extra = {"repetition_penalty": 1.2, "ignore_eos": True}
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], extra_body=extra, **kw)
    want = offline_text(offline, PROMPTS[1], **kw, **extra)
    assert resp.choices[0].text == want
    assert want != offline_text(offline, PROMPTS[1], temperature=0, max_tokens=12, ignore_eos=True)
    token = offline.tokenizer.encode(" cat")[-1]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert offline.tokenizer.encode(resp.choices[0].text) == [token] * 4
    # min_tokens: a stop string the text starts with is looked for only from the 8th token on
    stop = offline_text(offline, PROMPTS[1], temperature=0, max_tokens=4, ignore_eos=True)[:2]
    early = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    late = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop],
        extra_body={"min_tokens": 8, "ignore_eos": True},
    )
    assert early.usage.completion_tokens < 8 <= late.usage.completion_tokens


def test_echo_puts_the_prompt_before_the_text_and_rates_its_tokens(client, offline):
    """lm-evaluation-harness scores a continuation with echo, logprobs and max_tokens=1."""
    prompt = PROMPTS[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert resp.choices[0].text == prompt + offline_text(offline, prompt, temperature=0, max_tokens=5)
    ids = offline.tokenizer.encode(prompt)
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = resp.choices[0].logprobs
    want = offline.generate(
        ids, SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )[0]
    assert want.prompt_logprobs is not None and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=1e-5)
        assert len(lp.top_logprobs[i]) >= 2
    assert lp.token_logprobs[-1] == pytest.approx(want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == resp_text(client, prompt, echo=True)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_response_format_and_structured_outputs_reach_the_engine(client, offline):
    """OpenAI's response_format (chat and completions) and vLLM's structured_outputs give offline's
    constrained output, streamed or not; the JSON parses and follows the schema."""
    from pdserve.structured import StructuredOutputs

    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, response_format=rf)
    text = resp.choices[0].message.content
    prompt = offline.tokenizer.apply_chat_template(msgs)
    assert text == offline_text(offline, offline.tokenizer.encode(prompt, add_special_tokens=False), temperature=0,
                                max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA))
    if resp.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    cases = [
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,6} [0-9]{2}"}}, StructuredOutputs(regex="[A-Z][a-z]{2,6} [0-9]{2}")),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, StructuredOutputs(choice=["red", "green", "blue"])),
    ]
    for extra, so in cases:
        got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, extra_body=extra)
        want = offline_text(offline, PROMPTS[2], temperature=0, max_tokens=16, structured_outputs=so)
        assert got.choices[0].text == want, extra
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                                extra_body=extra, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body=cases[2][0]
    ).choices[0].text in ("red", "green", "blue")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "invalid structured output"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid structured output"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "invalid structured output"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": "abc"}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "unsupported key"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
         "not both"),
        ({"structured_outputs": {"regex": "a", "json": "{"}}, "structured_outputs", "exactly one"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400_before_anything_runs(url, fields, param, message, stream):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": stream,
                                                  **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def resp_text(client, prompt: str, **kw) -> str:  # type: ignore[no-untyped-def]
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, **kw).choices[0].text


def test_completion_stream_equals_non_stream(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: none the first time a prompt is seen, its whole
    blocks the second time (whole and streamed); each prompt counted once with n > 1."""
    prompt = "Prefix caching keeps the KV of earlier prompts. " * 12 + "A new question?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    n3 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=3)
    assert n3.usage.prompt_tokens_details.cached_tokens == cached and n3.usage.prompt_tokens == again.usage.prompt_tokens


def test_continuous_usage_counts_in_every_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 12 and len(set(counts)) > 2


def test_sse_framing(url):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ")
        chunk = json.loads(event[len("data: ") :])
        assert {"id", "object", "created", "model", "choices"} <= chunk.keys()
    # Without include_usage, no usage chunk.
    assert all(json.loads(e[6:])["choices"] for e in events[:-1])


# ---- chat ------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


def test_chat_applies_template(client, offline):
    rendered = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    completion = client.completions.create(model=MODEL, prompt=rendered, max_tokens=16, temperature=0)
    assert choice.message.content == completion.choices[0].text
    assert (
        chat.usage.prompt_tokens == completion.usage.prompt_tokens == len(offline.tokenizer.encode(rendered))
    )
    offline_chat = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert choice.message.content == offline_chat.outputs[0].text


def test_chat_stream(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0
    )
    assert whole.usage.completion_tokens <= 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c for c in chunks if c.choices]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_content_parts_and_default_max_tokens(client):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is a "}, {"type": "text", "text": "KV cache?"}],
        }
    ]
    plain = [{"role": "user", "content": "What is a KV cache?"}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


# ---- tool calling (SmolLM2's template has no tool-call format: named and "required" only) -----------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_a_named_tool_choice_constrains_the_arguments_to_its_schema(client, offline):
    """The arguments are the model's output under the function's parameters schema (offline's constrained
    output, the same prompt); content is null, the finish reason "stop" (as OpenAI's for a forced call),
    and a stream says the same in pieces."""
    from pdserve.structured import StructuredOutputs

    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, max_tokens=40, temperature=0)
    resp = client.chat.completions.create(**kw)
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert choice.message.content is None
    prompt = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(ASK), add_special_tokens=False)
    assert call.function.arguments == offline_text(
        offline, prompt, temperature=0, max_tokens=40,
        structured_outputs=StructuredOutputs(json=WEATHER_TOOL["function"]["parameters"]))
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop":
        args = json.loads(call.function.arguments)
        assert set(args) == {"city", "days"} and isinstance(args["days"], int) and len(args["city"]) <= 10
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id and all(p.index == 0 for p in pieces)
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_calls_one_or_more_of_the_tools(client, parallel):
    """Random draws under "required": every answer is one or more calls of the given tools with arguments
    that follow their schemas (one at most without parallel calls); finish "tool_calls"; streamed the same."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=120,
              temperature=1.0, parallel_tool_calls=parallel)
    finished = 0
    for seed in range(6):
        resp = client.chat.completions.create(**kw, seed=seed)
        choice = resp.choices[0]
        if choice.finish_reason == "length":
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert 1 <= len(calls) and (parallel or len(calls) == 1)
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert set(args) == {"city", "days"} and isinstance(args["days"], int)
            else:
                assert call.function.name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})
        chunks = [c for c in client.chat.completions.create(**kw, seed=seed, stream=True) if c.choices]
        streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert finished >= 3


def test_tool_choice_none_and_a_tool_conversation(client):
    """"none" answers as without tools; a conversation with an assistant's tool calls and a tool's answer
    renders and runs."""
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                          tools=[WEATHER_TOOL], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": -3}'},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                          tools=[WEATHER_TOOL], tool_choice="none")
    assert resp.choices[0].message.content and resp.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER_TOOL]}, "tool_choice"),  # auto by default: this template teaches no call format
        ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"}, "tools"),
        ({"tools": "get_weather", "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools"),  # a schema llguidance refuses
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_start|>system"}}],
          "tool_choice": "required"}, "messages"),  # special tokens in what the template renders
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": "{not json"}}]}]}, "messages"),
        ({"messages": ASK + [{"role": "user", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]}]}, "messages"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tools_are_400_before_anything_runs(url, fields, param, stream):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": stream, **fields}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tokenize_and_detokenize(url, client, offline):
    """vLLM's /tokenize (a prompt, or messages as the chat endpoint templates them) and /detokenize."""
    tok = offline.tokenizer
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert r["count"] == chat.usage.prompt_tokens and r["token_strs"] is None
    assert r["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    with_tools = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": ASK, "tools": [WEATHER_TOOL]}).json()
    assert with_tools["count"] == httpx.post(url + "/tokenize", json={"model": MODEL, "messages": ASK}).json()["count"]
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back["prompt"] == tok.apply_chat_template(MESSAGES)
    for path, body, param in [
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": LONG_PROMPT * 40}, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/tokenize", {"model": MODEL, "messages": ASK, "tools": [{"type": "function"}]}, "tools"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 49152]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens"),
        ("/detokenize", {"model": MODEL}, "tokens"),
    ]:
        got = httpx.post(url + path, json=body)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (body, got.text)
    assert httpx.post(url + "/detokenize", json={"model": "gpt-4", "tokens": [1]}).status_code == 404


# ---- n, stop, logprobs -----------------------------------------------------------------------------


def test_n2(client):
    kw = {
        "model": MODEL,
        "prompt": PROMPTS[3],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
        "extra_body": {"ignore_eos": True},
    }
    resp = client.completions.create(**kw)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text != resp.choices[1].text  # each choice draws its own tokens
    assert resp.usage.completion_tokens == 16
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in resp.choices]
    streamed = {0: "", 1: ""}
    finished = set()
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert [streamed[0], streamed[1]] == [c.text for c in resp.choices]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=3, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings(client, offline):
    full = offline_text(offline, PROMPTS[0], temperature=0, max_tokens=30, ignore_eos=True)
    stop = full[12:15]
    assert stop.strip(), full
    expected = full[: full.index(stop)]
    kw = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 30,
        "temperature": 0,
        "stop": [stop, "\x00never"],
    }
    resp = client.completions.create(**kw)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra.get("stop_reason") == stop
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected  # no prefix of the stop string leaks
    assert streamed[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    text = chat.choices[0].message.content
    cut = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=text[5:8]
    )
    assert cut.choices[0].message.content == text[: text.index(text[5:8])]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    want = offline.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False
    )[0]
    comp = want.outputs[0]
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 6
    )
    for i, token_id in enumerate(comp.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(comp.logprobs[i][token_id], abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    tokens = [
        e.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in content]


# ---- load ------------------------------------------------------------------------------------------


def test_32_concurrent_clients(url, offline):
    prompts = [f"Request number {i} says" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        kw = {
            "model": MODEL,
            "prompt": prompts[i],
            "max_tokens": 16,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        if i % 2:
            resp = await aclient.completions.create(**kw)
            assert resp.usage.completion_tokens == 16
            return resp.choices[0].text
        text = ""
        async for chunk in await aclient.completions.create(stream=True, **kw):
            text += chunk.choices[0].text
        return text

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    before = scrape(url)
    got = asyncio.run(run())
    assert got == expected
    after = scrape(url)
    assert after["pdserve:request_finished_total"] - before["pdserve:request_finished_total"] == 32
    assert after["pdserve:generation_tokens_total"] - before["pdserve:generation_tokens_total"] == 32 * 16


# ---- aborts ----------------------------------------------------------------------------------------


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def test_dropped_streams_free_their_blocks(url):
    before = scrape(url)
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=60)) as c:

            async def open_one():  # type: ignore[no-untyped-def]
                cm = c.stream("POST", url + "/v1/completions", json=body)
                r = await cm.__aenter__()
                assert r.status_code == 200
                lines = r.aiter_lines()  # kept alive: a collected iterator would close the response
                while not (await anext(lines)).startswith("data: "):
                    pass
                return cm, lines

            streams = await asyncio.gather(*(open_one() for _ in range(50)))
            during = (await c.get(url + "/health")).json()
            for cm, _ in streams:  # drop every connection mid-stream
                await cm.__aexit__(None, None, None)
            return during

    during = asyncio.run(run())
    assert during["num_requests_in_flight"] == 50
    assert during["kv_cache_usage"] > 0
    after = wait_for(
        lambda: (h := _health(url))["num_requests_in_flight"] == 0 and h["kv_cache_usage"] == 0.0 and h
    )
    assert after, _health(url)
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    metrics = scrape(url)
    assert metrics["pdserve:request_aborted_total"] - before["pdserve:request_aborted_total"] == 50
    assert metrics["pdserve:kv_cache_usage_ratio"] == 0.0


def test_client_gone_while_waiting_for_whole_response(url):
    before = scrape(url)
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": 480,
        "n": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.25))
    after = wait_for(
        lambda: (h := _health(url))["num_requests_in_flight"] == 0 and h["kv_cache_usage"] == 0.0
    )
    assert after, _health(url)
    aborted = scrape(url)["pdserve:request_aborted_total"] - before["pdserve:request_aborted_total"]
    assert aborted == 16


# ---- bad input -------------------------------------------------------------------------------------

LONG_PROMPT = " ".join(["word"] * 600)
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 512}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x7": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"7": 300}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [{"a": 1}]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "slo_ttft_ms": 0}, 400, "slo_ttft_ms"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "slo_itl_ms": -5}, 400, "slo_itl_ms"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "slo_tpot_ms": "fast"}, 400, "slo_tpot_ms"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "slo_tpot_ms": True}, 400, "slo_tpot_ms"),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "hi", "slo_ttft_ms": 1e400}',
        400,
        "slo_ttft_ms",
    ),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 1000},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]},
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "auto"},
        400,
        "tool_choice",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "slo_itl_ms": 0.0}, 400, "slo_itl_ms"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "slo_ttft_ms": [1]}, 400, "slo_ttft_ms"),
    ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "model"),
    ("/v1/nothing", {"model": MODEL}, 404, None),
]


def test_bad_input_is_refused_before_the_engine(url):
    before = scrape(url)
    for path, body, status, param in BAD:
        if isinstance(body, bytes):
            r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=10)
        else:
            r = httpx.post(url + path, json=body, timeout=10)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        if param is not None:
            assert err["param"] == param, (body, err)
    after = scrape(url)
    for name in (
        "pdserve:request_finished_total",
        "pdserve:prompt_tokens_total",
        "pdserve:request_aborted_total",
    ):
        assert after[name] == before[name], name
    assert _health(url)["num_requests_in_flight"] == 0


def test_openai_client_error_types(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="missing", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 512" in e.value.body["message"]


# ---- metrics and stats -----------------------------------------------------------------------------


def test_metrics_present_and_moving(url, client):
    text = httpx.get(url + "/metrics").text
    for name in (
        "pdserve:time_to_first_token_seconds",
        "pdserve:time_per_output_token_seconds",
        "pdserve:inter_token_latency_seconds",
        "pdserve:e2e_request_latency_seconds",
        "pdserve:request_queue_time_seconds",
        "pdserve:prefill_step_duration_seconds",
        "pdserve:decode_step_duration_seconds",
        "pdserve:num_requests_running",
        "pdserve:num_requests_waiting",
        "pdserve:kv_cache_usage_ratio",
        "pdserve:kv_cache_num_blocks",
        "pdserve:prompt_tokens_total",
        "pdserve:generation_tokens_total",
        "pdserve:preemptions_total",
        "pdserve:prefix_cache_hit_tokens_total",
        "pdserve:request_aborted_total",
    ):
        assert f"\n{name}" in text, name
    before = scrape(url)
    assert before["pdserve:kv_cache_num_blocks"] > 0
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(url)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("pdserve:prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("pdserve:generation_tokens_total") == 10
    assert moved("pdserve:time_to_first_token_seconds_count") == 1
    assert moved("pdserve:e2e_request_latency_seconds_count") == 1
    assert moved("pdserve:time_per_output_token_seconds_count") == 1
    assert moved("pdserve:inter_token_latency_seconds_count") == 9
    assert moved("pdserve:request_queue_time_seconds_count") == 1
    assert moved("pdserve:prefill_step_duration_seconds_count") >= 1
    assert moved("pdserve:decode_step_duration_seconds_count") >= 8
    assert moved("pdserve:prefix_cache_queried_tokens_total") >= resp.usage.prompt_tokens
    # The same prompt again hits the prefix cache (its full blocks: 128 tokens each on a CPU).
    long_prompt = " ".join(f"w{i}" for i in range(80))  # ~260 tokens
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    mid = scrape(url)
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    assert scrape(url)["pdserve:prefix_cache_hit_tokens_total"] > mid["pdserve:prefix_cache_hit_tokens_total"]


def _slo_series(url: str) -> dict[tuple[str, str], float]:
    """{(met | missed, target): count} of the per-request goodput counters."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for kind in ("met", "missed"):
                if s.name == f"pdserve:request_slo_{kind}_total":
                    out[kind, s.labels["target"]] = s.value
    return out


def test_per_request_targets_are_accepted_and_judged(url, client):
    """The default policy (chunked) has no engine-wide targets: a request without its own is not judged;
    one with targets out of reach (a 0.001 ms TTFT) misses them, one with generous targets meets them,
    on both endpoints. Outputs are unchanged by the fields."""
    before = _slo_series(url)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert _slo_series(url) == before
    generous = {"slo_ttft_ms": 60_000, "slo_itl_ms": 60_000, "slo_tpot_ms": 60_000}
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body=generous
    )
    assert resp.choices[0].text == plain.choices[0].text
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_body={"slo_ttft_ms": 0.001}
    )
    after = _slo_series(url)

    def moved(kind: str, target: str) -> float:
        return after.get((kind, target), 0.0) - before.get((kind, target), 0.0)

    assert [moved("met", t) for t in ("ttft", "itl", "tpot", "all")] == [1, 1, 1, 1]
    assert [moved("missed", t) for t in ("ttft", "itl", "tpot", "all")] == [1, 0, 0, 1]


def test_pdserve_top_shows_what_the_instance_did(url, client):
    """`pdserve top`'s poller over a window with 4 requests; its CLI prints the window as JSON."""
    import subprocess
    import sys

    from pdserve.dashboard import Poller

    poller = Poller([url])
    try:
        poller.poll()
        for p in PROMPTS:
            client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        (w,) = poller.poll()
    finally:
        poller.close()
    assert w.up and w.role == "both" and w.running == 0  # (its /load says so)
    assert w.output_tokens_per_s > 0 and w.prompt_tokens_per_s > 0 and w.finished_per_s > 0
    assert w.prefill_steps_per_s > 0 and w.decode_steps_per_s > 0
    assert 0 < w.decode_step_p50 <= w.decode_step_p99 and 0 < w.ttft_p50 <= w.ttft_p99 and w.itl_p50 > 0
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "top", url, "--json", "--interval", "0.2"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    (row,) = json.loads(out)
    assert row["url"] == url and row["up"] and "decode_step_p50" in row


def test_periodic_stats_log(server, url, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    line = wait_for(
        lambda: next((l for l in server.log_text().splitlines() if "generation" in l and "tok/s" in l), None),
        timeout=5,
    )
    assert line and "running" in line and "KV cache" in line, server.log_text()[-2000:]


# ---- shutdown (last: it ends the module's server) --------------------------------------------------


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


def test_sigint_stops_both_processes(server, url):
    (engine_pid,) = server.engine_pids()
    body = {
        "model": MODEL,
        "prompt": "Go on and on",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGINT)
        rest = [line for line in lines if line]  # the open stream ends (finished or cut); it does not hang
    assert rest and rest[-1] == "data: [DONE]"
    assert server.proc.wait(timeout=20) == 0
    assert wait_for(lambda: _pid_gone(engine_pid), timeout=5)
    log = server.log_text()
    assert "Traceback" not in log and "engine core process exited with code 0" in log, log[-3000:]
