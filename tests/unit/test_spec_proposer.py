"""The n-gram proposer, the speculation-length rule, the counters and the config (torch-free)."""

from __future__ import annotations

import pytest

from pdserve.config import SpeculativeConfig
from pdserve.spec import DraftRequest, NgramProposer, SpecDecodeStats, SpecLengthController


def test_ngram_proposes_what_followed_the_longest_earlier_match() -> None:
    p = NgramProposer(min_n=2, max_n=4)
    # The suffix [7, 8, 9] occurred at 1..3, followed by 4, 5; [8, 9] alone also occurs at 6..7 (then 1).
    seq = [1, 7, 8, 9, 4, 5, 8, 9, 1, 2, 7, 8, 9]
    assert p.propose_one(seq, 2) == [4, 5]
    assert p.propose_one(seq, 10) == [4, 5, 8, 9, 1, 2, 7, 8, 9]  # at most what exists after the match


def test_ngram_falls_back_to_shorter_suffixes_and_the_earliest_occurrence() -> None:
    p = NgramProposer(min_n=2, max_n=5)
    seq = [3, 4, 10, 3, 4, 11, 6, 3, 4]  # only [3, 4] matches, first at 0
    assert p.propose_one(seq, 3) == [10, 3, 4]


def test_ngram_proposes_nothing_without_a_match_of_min_n() -> None:
    p = NgramProposer(min_n=3, max_n=5)
    assert p.propose_one([1, 2, 3, 9, 2, 3], 4) == []  # [2, 3] matches but is shorter than 3
    assert p.propose_one([5, 5], 4) == []
    assert p.propose_one([1, 2, 1, 2], 0) == []
    assert NgramProposer(1, 1).propose_one([5, 6, 5], 2) == [6, 5]


def test_ngram_matches_a_brute_force_search() -> None:
    import random

    rng = random.Random(0)
    p = NgramProposer(min_n=2, max_n=4)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k = rng.randrange(0, 5)
        want: list[int] = []
        if k:
            for n in range(min(4, len(seq) - 1), 1, -1):
                starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[-n:]]
                if starts:
                    want = seq[starts[0] + n : starts[0] + n + k]
                    break
        assert p.propose_one(seq, k) == want, (seq, k)
        assert p.propose([DraftRequest("r", seq, k)]) == [want]


def test_length_follows_measured_acceptance() -> None:
    c = SpecLengthController(4, ema=0.5, min_acceptance=0.25)
    assert c.length("new") == 4  # optimistic until measured
    for _ in range(10):
        c.observe("bad", 4, 0)
        c.observe("good", 4, 4)
        c.observe("half", 4, 1)
    assert c.length("bad") == 1  # never 0: one draft keeps measuring
    assert c.length("good") == 4
    a = c.acceptance("half")
    assert 0.4 < a < 0.6 and c.length("half") == 2  # 0.5**2 >= 0.25 > 0.5**3
    c.release("good")
    assert c.length("good") == 4 and SpecLengthController(3, adaptive=False).length("x") == 3


def test_length_rule_counts_the_draft_models_cost() -> None:
    """The k-th draft is worth its draft step when a**k >= max(min_acceptance, draft_cost): a costly
    draft speculates less deeply at the same acceptance; a free one (n-gram) keeps the plain rule."""
    free = SpecLengthController(8, ema=1.0, min_acceptance=0.25)
    costly = SpecLengthController(8, ema=1.0, min_acceptance=0.25, draft_cost=0.5)
    for c in (free, costly):
        c.observe("r", 4, 3)  # acceptance a = 3 / (3 + 1) = 0.75
    assert free.length("r") == 4  # 0.75**4 = 0.32 >= 0.25 > 0.75**5
    assert costly.length("r") == 2  # 0.75**2 = 0.56 >= 0.5 > 0.75**3
    assert SpecLengthController(8, min_acceptance=0.25, draft_cost=0.1).threshold == 0.25


def test_stats_count_drafts_and_accepted_positions() -> None:
    s = SpecDecodeStats()
    s.observe(3, 2)
    s.observe(2, 0)
    s.observe(0, 0)  # no drafts ran: not a draft step
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.accepted_per_pos == [1, 1, 0]
    assert s.acceptance_rate == pytest.approx(0.4) and s.mean_acceptance_length == pytest.approx(2.0)


def test_config_parses_vllm_style_json_and_rejects_bad_values() -> None:
    c = SpeculativeConfig.from_dict(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
    )
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 1, 4)
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        SpeculativeConfig(method="eagle")
    d = SpeculativeConfig.from_dict({"method": "draft", "model": "x", "draft_kv_cache_memory_gb": 0.5})
    assert (d.method, d.model, d.draft_kv_cache_memory_gb, d.draft_cost) == ("draft", "x", 0.5, None)
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_kv_cache_memory_gb"):
        SpeculativeConfig(method="draft", model="x", draft_kv_cache_memory_gb=0)
    with pytest.raises(ValueError, match="draft_cost"):
        SpeculativeConfig(method="draft", model="x", draft_cost=1.5)
    with pytest.raises(ValueError, match="unknown speculative config keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "lookahead": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_dict("{method: ngram}")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
