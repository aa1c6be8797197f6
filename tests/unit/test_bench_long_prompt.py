"""The long-prompt workload: deterministic for a seed, long prompts in their length range, the requested
share of long requests at spread-out positions, short chats from ShareGPT records or random."""

from __future__ import annotations

import pytest

from pdserve.bench import serve_bench
from pdserve.bench.datasets import sample_long_prompt
from pdserve.config import LongPromptMix


class WordTokenizer:
    """Token id k is the word `wk`; any other word is token 0. Decoding and re-encoding keep the length."""

    vocab_size = 5000

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else 0 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


MIX = LongPromptMix(fraction=0.05, min_len=1500, max_len=1900, output_len=128)


def sharegpt_records(n: int) -> list[dict]:
    return [
        {"id": f"r{i}", "conversations": [
            {"from": "human", "value": f"question {i} " + "x " * (5 + i % 40)},
            {"from": "gpt", "value": "y " * (10 + i % 50)},
        ]}
        for i in range(n)
    ]


def is_long(s) -> bool:  # type: ignore[no-untyped-def]
    return s.prompt_len >= MIX.min_len


def test_deterministic_for_a_seed():
    tok = WordTokenizer()
    a = sample_long_prompt(tok, 100, seed=3, mix=MIX)
    b = sample_long_prompt(tok, 100, seed=3, mix=MIX)
    c = sample_long_prompt(tok, 100, seed=4, mix=MIX)
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "num_prompts,fraction,num_long",
    [(200, 0.05, 10), (38, 0.05, 2), (40, 0.25, 10), (20, 0.0, 0), (7, 1.0, 7)],
)
def test_mix_ratio_and_long_lengths_in_range(num_prompts, fraction, num_long):
    mix = LongPromptMix(fraction=fraction, min_len=1500, max_len=1900, output_len=100)
    samples = sample_long_prompt(WordTokenizer(), num_prompts, seed=0, mix=mix)
    assert len(samples) == num_prompts
    longs = [s for s in samples if s.prompt_len >= mix.min_len]
    assert len(longs) == num_long
    for s in longs:
        assert mix.min_len <= s.prompt_len <= mix.max_len
        assert s.output_len == mix.output_len
        assert s.prompt_len + s.output_len <= mix.max_total_len
    for s in samples:
        if s not in longs:
            # random short chats: 256 +- 50% prompt tokens, 128 +- 50% output tokens
            assert 128 <= s.prompt_len <= 384 and 64 <= s.output_len <= 192
    # Lengths vary across the range rather than sitting on one value.
    if num_long >= 5:
        assert len({s.prompt_len for s in longs}) > 1


def test_long_prompts_are_spread_not_a_block():
    samples = sample_long_prompt(WordTokenizer(), 200, seed=0, mix=MIX)
    positions = [i for i, s in enumerate(samples) if is_long(s)]
    assert len(positions) == 10
    assert positions != list(range(positions[0], positions[0] + 10))
    assert positions[-1] - positions[0] > 50


def test_short_chats_come_from_sharegpt_records_when_given():
    records = sharegpt_records(300)
    firsts = {r["conversations"][0]["value"] for r in records}
    samples = sample_long_prompt(WordTokenizer(), 60, seed=1, mix=MIX, short_records=records)
    shorts = [s for s in samples if not is_long(s)]
    assert len(shorts) == 57  # round(60 * 0.05) = 3 long
    assert all(s.prompt in firsts for s in shorts)
    assert sum(is_long(s) for s in samples) == 3


def test_too_few_sharegpt_chats_is_an_error():
    with pytest.raises(ValueError, match="short chats"):
        sample_long_prompt(WordTokenizer(), 60, seed=1, mix=MIX, short_records=sharegpt_records(10))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fraction": 1.5}, "fraction"),
        ({"min_len": 1900, "max_len": 1500}, "min <= max"),
        ({"max_len": 2000, "output_len": 100}, "do not fit"),
        ({"output_len": 0}, ">= 1"),
    ],
)
def test_mix_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LongPromptMix(**kwargs)


def test_load_samples_falls_back_to_random_chats_without_sharegpt(monkeypatch):
    def missing() -> list[dict]:
        raise FileNotFoundError("not installed")

    monkeypatch.setattr(serve_bench, "load_sharegpt_records", missing)
    tok = WordTokenizer()
    samples = serve_bench.load_samples(tok, "long-prompt", 40, 2, long_prompt=MIX)
    assert samples == sample_long_prompt(tok, 40, 2, MIX, short_records=None)
    assert sum(is_long(s) for s in samples) == 2


def test_workload_rejects_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        serve_bench.Workload(dataset="nope")


def test_random_short_chats_must_fit_the_context():
    mix = LongPromptMix(min_len=300, max_len=400, output_len=16, max_total_len=512)
    with pytest.raises(ValueError, match="random short chats"):
        sample_long_prompt(WordTokenizer(), 20, mix=mix)
    # ShareGPT chats are filtered to the context instead.
    samples = sample_long_prompt(WordTokenizer(), 20, mix=mix, short_records=sharegpt_records(100))
    assert all(s.prompt_len + s.output_len <= 512 for s in samples)
