"""The bundled SmolLM2-135M-Instruct behind the HTTP server: greedy output over HTTP (completions and
chat, streamed and not) equals the offline API's `LLM(dtype="float32")`."""

from __future__ import annotations

import openai
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.server.launcher import ServerProcess
from tests.support.server import quiet_env

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server():
    args = [
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--kv-cache-memory-gb",
        "0.25",
        "--stats-interval",
        "0",
    ]
    srv = ServerProcess(args, env=quiet_env()).start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def offline():
    threads = torch.get_num_threads()
    yield LLM(dtype="float32", device="cpu", kv_cache_memory_gb=0.25, num_threads=1)
    torch.set_num_threads(threads)  # LLM(num_threads=1) set it for the whole test process


@pytest.fixture(scope="module")
def client(server, offline) -> openai.OpenAI:
    server.wait_ready(timeout=300)  # the offline model loaded meanwhile
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_greedy_http_equals_offline(client, offline):
    (model,) = [m.id for m in client.models.list().data]
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    params = SamplingParams(temperature=0, max_tokens=16)
    for prompt in PROMPTS:
        want = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
    want = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == want.text
    assert chat.choices[0].finish_reason == want.finish_reason
    streamed = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
