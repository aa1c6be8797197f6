"""A quantized KV cache on the bundled SmolLM2-135M (float32 weights, so that only the KV's rounding
differs): next-token distributions teacher-forced over ~250 tokens of prose and code stay close to those
of the unquantized cache. Issue 17's target for int8 is a mean KL <= 0.002 (~0.001 here
for the symmetric int8 format of session 8, the bound the asymmetric one now stored is held to; fp8
e4m3, with 3 mantissa bits, ~0.005)."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from tests.support.teacher_forced import kl_and_top1, teacher_forced_logprobs

pytestmark = pytest.mark.real_model

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used for wine. Within fifty "
    "years, printing shops had spread to more than two hundred cities across Europe, and the price of books "
    "fell so far that ordinary merchants could own them.",
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n    mid = len(xs) // 2\n"
    "    left = merge_sort(xs[:mid])\n    right = merge_sort(xs[mid:])\n    out = []\n    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            out.append(left[i]); i += 1\n        else:\n            out.append(right[j]); j += 1\n"
    "    return out + left[i:] + right[j:]\n",
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, water is "
    "split and oxygen is released, while ATP and NADPH are produced. The Calvin cycle then uses these "
    "molecules to fix carbon dioxide into sugars that the plant uses to grow.",
]


@pytest.fixture(scope="module")
def reference():
    return LLM(dtype="float32", device="cpu", num_blocks=64).engine


@pytest.mark.parametrize("kv_dtype,max_kl,min_top1", [("int8", 0.002, 0.98), ("fp8_e4m3", 0.01, 0.95)])
def test_teacher_forced_kl_against_unquantized_kv(reference, kv_dtype, max_kl, min_top1):
    quant = LLM(dtype="float32", device="cpu", num_blocks=64, kv_cache_dtype=kv_dtype).engine
    kls, top1 = [], []
    for text in TEXTS:
        ids = reference.tokenizer.encode(text)
        kl, same = kl_and_top1(teacher_forced_logprobs(reference, ids), teacher_forced_logprobs(quant, ids))
        kls.append(kl)
        top1.append(same)
    kl_mean, agree = torch.cat(kls).mean().item(), torch.cat(top1).float().mean().item()
    assert 0 < kl_mean <= max_kl and agree >= min_top1, (kl_mean, agree)
