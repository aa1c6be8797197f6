"""SmolLM2 with 8-bit weights (`--weight-dtype int8`, and `w8a8`): greedy chat replies are sane text and follow the
bf16 ones for most of their first tokens; the CLI runs it end to end. pdserve's kernels are pinned (the
autotune's choice is tested on the tiny model; each int8 kernel against the reference in
tests/model/test_linear_int8.py)."""

from __future__ import annotations


import pytest

from pdserve import LLM, SamplingParams
from pdserve.model.linear import available_kernels

pytestmark = pytest.mark.real_model

# pdserve's int8 kernel needs AVX-512 BF16; elsewhere (AMD Zen 3) ATen's int8-weight kernel, also pinned.
INT8_KERNEL = "pdserve" if "pdserve" in available_kernels("int8") else "torch"
# oneDNN's int8 x int8 kernel needs VNNI; elsewhere torch's (`_int_mm`).
A8_KERNEL = "onednn" if "onednn-a8" in available_kernels("w8a8") else "torch"

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a fun fact about octopuses.",
]


def test_int8_greedy_follows_bf16():
    params = SamplingParams(temperature=0, max_tokens=32)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = {}
    for wd in ("bfloat16", "int8"):
        # pinned: no minutes of autotune on a busy host
        llm = LLM(weight_dtype=wd, linear_kernel="pdserve" if wd == "bfloat16" else INT8_KERNEL)
        outs[wd] = [o.outputs[0] for o in llm.chat(msgs, params, use_tqdm=False)]
        if wd == "int8":
            assert llm.engine.model.linear_plan.weight_dtype == "int8"
            assert llm.engine.model.weight_bytes()["total"] < 200e6  # bf16: 538 MB resident
    common = []
    for a, b in zip(outs["bfloat16"], outs["int8"]):
        assert b.text.strip() and all(c.isprintable() or c.isspace() for c in b.text), b.text
        common.append(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                           min(len(a.token_ids), len(b.token_ids))))
    # Observed (2026-12-01): the replies first differ at tokens 8 (both end), 21, 13, 14, 32, 25 of 32.
    # A broken quantization diverges within the first few tokens.
    assert sum(c >= 8 for c in common) >= 4, common
    assert sum(common) / len(common) >= 10, common
    assert "Paris" in outs["int8"][0].text


def test_w8a8_greedy_follows_bf16():
    """`--weight-dtype w8a8` with an int8 x int8 kernel (oneDNN's, or torch's without VNNI) pinned at every row count (so activations
    are quantized everywhere, the worst case for accuracy): replies stay sane, follow bf16 at first, and the first
    reply token's top choices stay those of bf16."""
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = {}
    for wd, kernel in (("bfloat16", "pdserve"), ("w8a8", A8_KERNEL)):
        llm = LLM(weight_dtype=wd, linear_kernel=kernel, attention_backend="cpu-paged")
        outs[wd] = [o.outputs[0] for o in llm.chat(msgs, params, use_tqdm=False)]
        if wd == "w8a8":
            assert llm.engine.model.linear_plan.weight_dtype == "w8a8"
    common = []
    for a, b in zip(outs["bfloat16"], outs["w8a8"]):
        assert b.text.strip() and all(c.isprintable() or c.isspace() for c in b.text), b.text
        common.append(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                           min(len(a.token_ids), len(b.token_ids))))
        # No assert on which word wins a near tie: the France reply's first token is one even in bf16
        # ("The" 0.17 vs "L" 0.15 on host F'', session 24), and the summation order of whichever attention
        # and GEMM kernels the host has flips it ("The capital of France is Paris" / "L'Etoile de France").
        # What must hold: each one's first choice is among the other's top 3 (observed there: the top 3
        # are the same three tokens for all six prompts, with w8a8 moving their probabilities by up to
        # 0.16); a broken rescale puts unrelated tokens first.
        top3 = [sorted(o.logprobs[0], key=o.logprobs[0].get, reverse=True)[:3] for o in (a, b)]
        assert a.token_ids[0] in top3[1] and b.token_ids[0] in top3[0], (a.logprobs[0], b.logprobs[0])
    assert sum(common) / len(common) >= 4, common  # a broken rescale diverges at the first token


def test_cli_generate_with_int8_weights(capsys):
    from pdserve.cli import main

    argv = ["generate", "--weight-dtype", "int8", "--linear-kernel", INT8_KERNEL, "--chat", "--max-tokens", "8"]
    assert main([*argv, "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out
