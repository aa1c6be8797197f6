"""The bundled SmolLM2-135M-Instruct against Hugging Face transformers loading the same GGUF: logits
within a tight tolerance in float32, identical greedy continuations, and the same output batched as
one at a time."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.loader import default_model_path

pytestmark = pytest.mark.real_model
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first humans",
    "Explain the difference between prefill and decode in one sentence:",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", kv_cache_memory_gb=0.5)


@pytest.fixture(scope="module")
def hf():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def test_logits_match_transformers(llm, hf):
    eng = llm.engine
    for text in PROMPTS:
        ids = eng.tokenizer.encode(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
        ours = out.outputs[0].logprobs[0]
        ref_lp = torch.log_softmax(ref.float(), -1)
        for tok, lp in ours.items():
            assert abs(lp - ref_lp[tok].item()) < 2e-3, (text, tok, lp, ref_lp[tok].item())
        assert out.outputs[0].token_ids[0] == int(ref.argmax())


@pytest.mark.timeout(900)  # ~200 s on a loaded 2-core machine: past the 300 s default there is no slack
def test_greedy_32_tokens_identical(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # batched
    for text, out in zip(PROMPTS, outs):
        ids = torch.tensor([llm.engine.tokenizer.encode(text)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), text


def test_chat_and_text(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    stop = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=32, stop=["."]),
                        use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == "." and "." not in stop.text
