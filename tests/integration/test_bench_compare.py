"""`pdserve bench compare` end to end: two presets, each on a fresh tiny random-weights pdserve server
started by the command itself, the same handful of prompts replayed against each; the table and the JSON
report hold both modes with complete records, and the figure, plots and trace are written."""

from __future__ import annotations

import json
import shlex

import pytest

from pdserve.cli import main
from tests.support.server import tiny_server_args

NUM_PROMPTS = 6
INPUT_LEN, OUTPUT_LEN = 24, 8

PRESETS = """
[presets.chunked-16]
args = ["--scheduler", "chunked", "--chunk-size", "16"]
description = "tiny chunks, so the 24-token prompts take two steps"
"""


@pytest.fixture
def quiet(monkeypatch):
    # The servers inherit the environment: one OpenMP thread each, as the other server tests run them.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def test_compare_two_presets_on_fresh_servers(tmp_path, capsys, quiet):
    presets = tmp_path / "presets.toml"
    presets.write_text(PRESETS)
    out = tmp_path / "compare.json"
    rc = main(
        [
            "bench", "compare",
            "--modes", "prefill-first,chunked-16",
            "--presets", str(presets),
            "--server-args", shlex.join(tiny_server_args("--stats-interval", "0")),
            "--server-timeout", "120",
            "--dataset", "random",
            "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN),
            "--request-rate", "inf",
            "--slo", "ttft=60000",
            "--count-output-tokens",  # the tiny server uses the default model's tokenizer
            "--out", str(out),
            "--plot-dir", str(tmp_path / "plots"),
            "--trace", str(tmp_path / "trace.json"),
            "--no-progress",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert header == ["mode", "prefill-first", "chunked-16"]
    assert "TTFT p99 (ms)" in table and "a fresh server per mode" in table

    report = json.loads(out.read_text())
    assert report["server"]["state"].startswith("fresh")
    assert report["config"]["workload"]["num_prompts"] == NUM_PROMPTS
    modes = report["modes"]
    assert [m["name"] for m in modes] == ["prefill-first", "chunked-16"]
    assert modes[1]["args"] == ["--scheduler", "chunked", "--chunk-size", "16"]
    prompt_lens = None
    for mode in modes:
        assert mode["server_command"][-len(mode["args"]):] == mode["args"]
        assert mode["model"] == "tiny"
        # Fresh server, prompts without shared prefixes: nothing came from the prefix cache.
        assert mode["prefix_cache_hit_tokens"] == 0
        metrics = mode["metrics"]
        assert (metrics["completed"], metrics["failed"]) == (NUM_PROMPTS, 0)
        assert metrics["slo_attainment"] == 100.0 and metrics["output_len_mismatches"] is not None
        records = mode["records"]
        assert len(records) == NUM_PROMPTS
        for rec in records:
            assert rec["success"] and rec["output_len"] == OUTPUT_LEN, rec
            times = rec["token_times"]
            assert 1 <= len(times) <= OUTPUT_LEN
            assert rec["arrival_time"] <= rec["send_time"] < times[0] <= times[-1] <= rec["end_time"]
            assert rec["prompt_len"] > 0 and rec["tokenizer_output_len"] is not None
            assert rec["output_text"]
        # The same workload against both modes.
        lens = [r["prompt_len"] for r in records]
        assert prompt_lens is None or lens == prompt_lens
        prompt_lens = lens

    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["cdf.png", "timeline-chunked-16.png", "timeline-prefill-first.png"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert processes == ["prefill-first", "chunked-16"]
