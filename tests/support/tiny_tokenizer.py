"""A byte-level BPE tokenizer for the tiny random model (id 0 is its EOS), trained on a little JSON and
prose: enough for text prompts and structured outputs. It has fewer tokens than the model's 512 (418):
ids past its end are padding no text maps to, as in real models whose vocabulary is rounded up."""

from __future__ import annotations

import functools
import json

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.model.tokenizer import Tokenizer
from tests.support.tiny import TINY

_CORPUS = [
    json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "alive": False, "ratio": 0.5}),
    json.dumps([{"id": i, "value": f"item {i}", "ok": i % 2 == 0} for i in range(20)]),
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "yes no maybe true false null 0123456789 - + . , : ; ( ) [ ] { } \" ' \n \t",
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY.vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 50, trainer=trainer)
    assert backend.get_vocab_size() < TINY.vocab_size and backend.token_to_id("<eos>") == 0
    return Tokenizer(backend, {"eos_token": "<eos>"}, frozenset({0}), None)
