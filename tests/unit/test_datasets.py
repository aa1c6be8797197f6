import json
import logging

import pytest

from pdserve.bench.datasets import (
    SampleRequest,
    load_sharegpt_records,
    sample_random,
    sample_sharegpt,
    sharegpt_path,
)


class WhitespaceTokenizer:
    """One token per whitespace-separated word; decode joins words back."""

    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [hash(w) % self.vocab_size for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def words(n: int) -> str:
    return " ".join(["x"] * n)


def record(prompt_len: int, output_len: int, turns: int = 2, rid: str = "r") -> dict:
    convs = [{"from": "human", "value": words(prompt_len)}, {"from": "gpt", "value": words(output_len)}]
    convs += [{"from": "human", "value": "more"}] * (turns - 2)
    return {"id": rid, "conversations": convs[:turns]}


def write_truncated(tmp_path, records: list[dict], cut: int) -> str:
    text = json.dumps(records, indent=2, ensure_ascii=False)
    path = tmp_path / "sg.json"
    path.write_bytes(text.encode("utf-8")[:cut])
    return str(path)


@pytest.mark.real_model
def test_bundled_sharegpt_keeps_all_complete_records(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.bench.datasets"):
        records = load_sharegpt_records(sharegpt_path())
    assert len(records) == 17_671
    assert all("conversations" in r for r in records)
    assert "dropped the truncated tail" in caplog.text
    assert "17671" in caplog.text


def test_truncated_file_keeps_complete_records(tmp_path, caplog):
    recs = [record(5, 5, rid=f"id{i}") for i in range(4)]
    recs[2]["conversations"][0]["value"] = "héllo wörld ✓ " * 3  # multi-byte characters near the cut
    full = json.dumps(recs, indent=2, ensure_ascii=False).encode("utf-8")
    # Cut inside the third record, including in the middle of a multi-byte character.
    start = full.index(b'"id2"')
    cuts = [start + 10, full.index("✓".encode()) + 1, full.index(b'"id3"') - 20]
    for cut in cuts:
        path = write_truncated(tmp_path, recs, cut)
        with caplog.at_level(logging.INFO, logger="pdserve.bench.datasets"):
            got = load_sharegpt_records(path)
        assert [r["id"] for r in got] == ["id0", "id1"], cut
    # Cut just after the closing brace of the third record: it is complete and kept.
    end_of_third = full.index(b'"id3"')
    end_of_third = full.rindex(b"}", 0, end_of_third) + 1
    got = load_sharegpt_records(write_truncated(tmp_path, recs, end_of_third))
    assert [r["id"] for r in got] == ["id0", "id1", "id2"]
    assert "dropped the truncated tail" in caplog.text


def test_complete_file_keeps_everything(tmp_path):
    recs = [record(5, 5, rid=f"id{i}") for i in range(3)]
    path = tmp_path / "full.json"
    path.write_text(json.dumps(recs))
    assert load_sharegpt_records(str(path)) == recs
    path.write_text("[]")
    assert load_sharegpt_records(str(path)) == []


def test_sharegpt_filters():
    tok = WhitespaceTokenizer()
    keep = record(10, 20, rid="keep")
    rejected = [
        record(10, 20, turns=1, rid="one_turn"),
        record(3, 20, rid="short_prompt"),
        record(10, 3, rid="short_output"),
        record(101, 5, rid="long_prompt"),
        record(100, 101, rid="long_total"),
    ]
    edge = [record(4, 4, rid="min_edge"), record(100, 100, rid="max_edge")]
    recs = [keep, *rejected, *edge]
    samples = sample_sharegpt(tok, 100, records=recs, min_len=4, max_prompt_len=100, max_total_len=200)
    got = sorted((s.prompt_len, s.output_len) for s in samples)
    assert got == [(4, 4), (10, 20), (100, 100)]
    assert all(isinstance(s, SampleRequest) and s.prompt == words(s.prompt_len) for s in samples)


def test_sharegpt_fixed_output_len():
    tok = WhitespaceTokenizer()
    recs = [
        record(10, 1, rid="tiny_reply"),
        record(10, 500, rid="long_reply"),
        record(151, 1, rid="too_long"),
    ]
    samples = sample_sharegpt(
        tok, 10, records=recs, max_prompt_len=200, max_total_len=200, fixed_output_len=50
    )
    # The reply is ignored, but prompt + fixed output must still fit in max_total_len.
    assert sorted((s.prompt_len, s.output_len) for s in samples) == [(10, 50), (10, 50)]


def test_sharegpt_stops_at_num_prompts_and_tokenizes_lazily():
    class Counting(WhitespaceTokenizer):
        calls = 0

        def encode(self, text):
            self.calls += 1
            return super().encode(text)

    tok = Counting()
    recs = [record(10, 10, rid=f"id{i}") for i in range(1000)]
    samples = sample_sharegpt(tok, 5, records=recs)
    assert len(samples) == 5
    assert tok.calls == 10


def test_sharegpt_seeded():
    tok = WhitespaceTokenizer()
    recs = [record(5 + i, 5, rid=f"id{i}") for i in range(200)]
    a = sample_sharegpt(tok, 20, seed=1, records=recs)
    b = sample_sharegpt(tok, 20, seed=1, records=recs)
    c = sample_sharegpt(tok, 20, seed=2, records=recs)
    assert a == b
    assert a != c


def test_sharegpt_reads_path(tmp_path):
    recs = [record(5, 5, rid=f"id{i}") for i in range(3)]
    path = write_truncated(tmp_path, recs, 10**9)
    assert len(sample_sharegpt(WhitespaceTokenizer(), 3, path=path)) == 3


@pytest.mark.parametrize("range_ratio", [0.0, 0.25, 0.5])
def test_sample_random_lengths(range_ratio):
    tok = WhitespaceTokenizer()
    samples = sample_random(tok, 200, input_len=64, output_len=32, seed=3, range_ratio=range_ratio)
    assert len(samples) == 200
    lo_in, hi_in = int(64 * (1 - range_ratio)), 64 * (1 + range_ratio)
    lo_out, hi_out = int(32 * (1 - range_ratio)), 32 * (1 + range_ratio)
    for s in samples:
        assert lo_in <= s.prompt_len <= hi_in
        assert lo_out <= s.output_len <= hi_out
        assert len(tok.encode(s.prompt)) == s.prompt_len
    if range_ratio == 0.0:
        assert {s.prompt_len for s in samples} == {64}
        assert {s.output_len for s in samples} == {32}
    else:
        assert len({s.prompt_len for s in samples}) > 1
    assert samples == sample_random(tok, 200, 64, 32, seed=3, range_ratio=range_ratio)
    assert samples != sample_random(tok, 200, 64, 32, seed=4, range_ratio=range_ratio)


def test_sample_random_rejects_bad_ratio():
    with pytest.raises(ValueError):
        sample_random(WhitespaceTokenizer(), 1, 8, 8, range_ratio=1.0)
