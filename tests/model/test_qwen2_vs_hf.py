"""The Qwen2 path of the model (q/k/v biases, theta 1e6, eps 1e-6) against transformers' Qwen2 with the
same random weights, and the engine's batched/chunked/prefix-cached/preempted modes against one request
at a time on that tiny Qwen2."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.model.llama import LlamaModel, random_weights
from tests.support.tiny import random_prompts

transformers = pytest.importorskip("transformers")

# GQA group 7 with head_dim 16: the 0.5B's head layout (14 / 2) at toy sizes.
TINY_QWEN2 = ModelConfig(
    vocab_size=512,
    hidden_size=224,
    intermediate_size=192,
    num_layers=3,
    num_heads=14,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_ids=(0,),
    architecture="qwen2",
    attention_bias=True,
)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY_QWEN2, seed=4321, std=0.08)


@pytest.fixture(scope="module")
def hf_model(weights):
    c = TINY_QWEN2
    cfg = transformers.Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, use_sliding_window=False, attn_implementation="eager",
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def make_llm(weights, **kw) -> LLM:
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(dtype="float32", device="cpu", model_config=TINY_QWEN2, weights=weights, **kw)


def test_biases_are_loaded_and_used(weights):
    model = LlamaModel(TINY_QWEN2)
    model.load_hf_weights(weights)
    bias = model.layers[1].qkv_bias
    assert bias is not None
    expected = torch.cat([weights[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(bias, expected) and bias.abs().max() > 0.5


def test_logits_match_hf(weights, hf_model):
    llm = make_llm(weights)
    for prompt in random_prompts(4, 5, 40, seed=3):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1], -1)
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
        for tok, lp in out.outputs[0].logprobs[0].items():
            assert abs(lp - ref[tok].item()) < 1e-4, (tok, lp, ref[tok].item())
        assert out.outputs[0].token_ids[0] == int(ref.argmax())


def test_greedy_matches_hf_generate(weights, hf_model):
    llm = make_llm(weights)
    prompts = random_prompts(3, 4, 30, seed=5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompts():
    ps = random_prompts(10, 3, 60, seed=17)
    return ps + [ps[0] + [7, 8, 9], ps[1] + ps[2]]  # shared prefixes for the prefix cache


@pytest.fixture(scope="module")
def reference(weights, prompts):
    llm = make_llm(weights, enable_prefix_caching=False, max_num_seqs=1)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(scheduler="chunked", max_num_batched_tokens=16),
        dict(scheduler="prefill-first", max_num_batched_tokens=32, num_blocks=40),  # preempts
        dict(scheduler="chunked", max_num_batched_tokens=32, num_blocks=40, preemption_mode="swap", swap_space_gb=0.01),
    ],
    ids=["default", "chunked-16", "recompute-preemption", "swap-preemption"],
)
def test_modes_equal_one_at_a_time(weights, prompts, reference, opts):
    llm = make_llm(weights, **opts)
    for _ in range(2):  # the second pass starts from prefix-cache hits
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert llm.engine.block_manager.num_prefix_hit_tokens > 0
    if "num_blocks" in opts:
        assert llm.engine.scheduler.num_preemptions > 0
