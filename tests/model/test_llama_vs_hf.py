"""The model code against Hugging Face transformers' Llama with the same random weights."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from tests.support.tiny import TINY, random_prompts

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tiny_weights):
    cfg = transformers.LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        head_dim=TINY.head_dim,
        rms_norm_eps=TINY.rms_norm_eps,
        rope_theta=TINY.rope_theta,
        max_position_embeddings=TINY.max_position_embeddings,
        tie_word_embeddings=TINY.tie_word_embeddings,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(tiny_weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_prefill_logits_match_hf(make_tiny_llm, hf_model):
    llm = make_tiny_llm()
    eng = llm.engine
    for prompt in random_prompts(4, 5, 40, seed=3):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1]
        # Run our model on the prompt through the engine's runner and read the sampled row's logits.
        logits = _last_logits(eng, prompt)
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def _last_logits(eng, prompt):
    from pdserve.request import Request
    from pdserve.scheduler.scheduler import SchedulerOutput, ScheduledRequest

    req = Request("probe", list(prompt), SamplingParams(temperature=0, max_tokens=1))
    assert eng.block_manager.allocate_slots(req, len(prompt))
    try:
        captured = {}
        orig = eng.model.compute_logits

        def spy(h, upcast=True):  # the runner asks for the model's dtype; float32 here either way
            captured["logits"] = orig(h)
            return captured["logits"]

        eng.model.compute_logits = spy
        eng.runner.execute(SchedulerOutput([ScheduledRequest(req, len(prompt))], len(prompt)))
        return captured["logits"][0]
    finally:
        del eng.model.compute_logits
        eng.block_manager.free(req)


def test_greedy_matches_hf_generate(make_tiny_llm, hf_model):
    llm = make_tiny_llm()
    prompts = random_prompts(3, 4, 30, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)


def test_onednn_prepacked_projections_are_bit_identical(tiny_weights):
    from pdserve.model.llama import LlamaModel

    from pdserve.model.linear import onednn_bf16

    if not onednn_bf16():
        pytest.skip("no oneDNN bf16 matmul here (no oneDNN in this torch build, or a CPU without AVX-512)")
    model = LlamaModel(TINY)
    model.load_hf_weights(tiny_weights)
    model = model.to(torch.bfloat16)
    layer = model.layers[0]
    x = torch.randn(5, TINY.hidden_size, dtype=torch.bfloat16)
    plain = [layer.linear(x, "qkv"), layer.linear(x, "gate_up"), model.compute_logits(x)]
    assert model.prepack_for_cpu("onednn")
    assert set(layer.packed) == {"qkv", "o", "gate_up", "down"} and model.packed_lm_head is not None
    packed = [layer.linear(x, "qkv"), layer.linear(x, "gate_up"), model.compute_logits(x)]
    for a, b in zip(plain, packed):
        assert torch.equal(a, b)
    # the layers' own copies are freed (oneDNN runs from its reordered ones); the embedding and norms stay
    assert all(getattr(lay, n).numel() == 0 for lay in model.layers for n in layer.PROJECTIONS)
    assert model.embed.numel() == TINY.vocab_size * TINY.hidden_size
    assert model.num_params == LlamaModel(TINY).num_params
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.weight_bytes()["other"] == rest
    with pytest.raises(ValueError, match="unknown linear kernel"):
        model.prepack_for_cpu("mkl")
    with pytest.raises(RuntimeError, match="packed already"):
        model.prepack_for_cpu("pdserve")


def test_loading_can_consume_the_checkpoint_and_packing_keeps_what_a_kernel_shares(tiny_weights):
    from pdserve.model.llama import LlamaModel

    kept = dict(tiny_weights)
    a, b = LlamaModel(TINY), LlamaModel(TINY)
    a.load_hf_weights(tiny_weights)
    assert tiny_weights.keys() == kept.keys()  # not consumed: the fixture's dict is shared
    b.load_hf_weights(kept, consume=True)
    assert kept == {}  # every tensor copied in and released
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    # plain F.linear runs from the layer's own tensor: a kernel that shares it keeps it alive
    b._drop_linear_weights(keep=[b.layers[0].qkv])
    assert b.layers[0].qkv.numel() > 0 and b.layers[0].o.numel() == 0 and b.layers[1].qkv.numel() == 0
    assert b.lm_head.numel() > 0 if TINY.tie_word_embeddings else b.lm_head.numel() == 0
