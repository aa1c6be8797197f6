"""The speculative-decoding counters reach /metrics under vLLM's names, as deltas of the engine's totals."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.engine.process.messages import EngineStats
from pdserve.server.metrics import ServerMetrics


def value(text: str, name: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def test_spec_decode_counters_follow_the_engine_totals() -> None:
    m = ServerMetrics("m")
    m.observe_engine(EngineStats(0, 0, 0.0, 0, 0, 0, num_spec_drafts=2, num_spec_draft_tokens=7,
                                 num_spec_accepted_tokens=3, spec_accepted_per_pos=(2, 1)), None)
    m.observe_engine(EngineStats(0, 0, 0.0, 0, 0, 0, num_spec_drafts=5, num_spec_draft_tokens=15,
                                 num_spec_accepted_tokens=8, spec_accepted_per_pos=(4, 3, 1)), None)
    text = generate_latest(m.registry).decode()
    assert value(text, "pdserve:spec_decode_num_drafts_total") == 5
    assert value(text, "pdserve:spec_decode_num_draft_tokens_total") == 15
    assert value(text, "pdserve:spec_decode_num_accepted_tokens_total") == 8
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text


def test_chosen_speculation_lengths_reach_metrics() -> None:
    m = ServerMetrics("m")
    m.observe_engine(EngineStats(0, 0, 0.0, 0, 0, 0, num_spec_length_choices=4, num_spec_chosen_tokens=6), None)
    m.observe_engine(EngineStats(0, 0, 0.0, 0, 0, 0, num_spec_length_choices=10, num_spec_chosen_tokens=9), None)
    text = generate_latest(m.registry).decode()
    assert value(text, "pdserve:spec_decode_num_length_choices_total") == 10
    assert value(text, "pdserve:spec_decode_num_chosen_tokens_total") == 9
