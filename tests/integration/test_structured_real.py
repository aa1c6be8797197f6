"""Structured outputs on SmolLM2 against transformers: greedy output under a JSON schema and a regex is
the output of transformers' `generate` with `prefix_allowed_tokens_fn` fed by a matcher of the test's
own (transformers masks the logits in its loop, pdserve in its sampler)."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.structured import StructuredOutputs
from tests.integration.test_real_model import hf, llm  # noqa: F401 (the module's fixtures: SmolLM2 and transformers' copy)

pytestmark = pytest.mark.real_model
transformers = pytest.importorskip("transformers")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
CASES = [
    ("Describe Paris as a JSON object with its city, country, population in millions and landmarks.",
     StructuredOutputs(json=SCHEMA)),
    ("What is the date of the first Moon landing? Answer as YYYY-MM-DD.",
     StructuredOutputs(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
    ("Is Python a compiled language? Answer yes or no.", StructuredOutputs(choice=["yes", "no"])),
]
MAX_TOKENS = 64


def hf_constrained(hf, llm: LLM, ids: list[int], so: StructuredOutputs) -> list[int]:  # type: ignore[no-untyped-def]
    tok = llm.engine.tokenizer
    vocab = llm.engine.model_config.vocab_size
    table = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=sorted(tok.eos_token_ids))
    matcher = llguidance.LLMatcher(table, so.to_llguidance(), log_level=0)
    taken: list[int] = []

    def allowed(_batch: int, seq: torch.Tensor) -> list[int]:
        new = seq[len(ids) :].tolist()
        assert new[: len(taken)] == taken
        for t in new[len(taken) :]:
            assert matcher.consume_token(t)
            taken.append(t)
        mask = matcher.compute_bitmask()
        return [t for t in range(vocab) if mask[t // 8] >> (t % 8) & 1]

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=sorted(tok.eos_token_ids), prefix_allowed_tokens_fn=allowed)
    got = out[0, len(ids) :].tolist()
    return got[:-1] if got and got[-1] in tok.eos_token_ids else got


@pytest.mark.timeout(900)
def test_constrained_greedy_equals_transformers(llm, hf):
    tok = llm.engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q, _ in CASES]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so) for _, so in CASES]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]  # batched
    for ids, (_, so), out in zip(prompts, CASES, outs):
        ref = hf_constrained(hf, llm, ids, so)
        got = out.token_ids[:-1] if out.token_ids and out.token_ids[-1] in tok.eos_token_ids else out.token_ids
        assert got == ref, (tok.decode(got), tok.decode(ref))
        assert out.finish_reason == "stop", out.text
    value = json.loads(outs[0].text)
    assert set(value) == set(SCHEMA["properties"]) and isinstance(value["landmarks"], list)
    assert len(outs[1].text) == 10 and outs[2].text in ("yes", "no")
