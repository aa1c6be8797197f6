"""Speculative decoding on the decode instance of a disaggregated pair (tiny random model, float32, one
process, `engine/disagg.py`): a request whose prompt KV and first token came from the prefill instance
speculates like a colocated one, greedy output is unchanged, and no drafts run while its KV is in flight."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve import SamplingParams
from pdserve.batch import ModelOutput
from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine.disagg import generate_disaggregated
from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import RequestStatus
from pdserve.scheduler.scheduler import SchedulerOutput
from pdserve.transfer.inproc import InprocHub, InprocTransport
from tests.model.test_disagg import LAYOUT, assert_no_leaks
from tests.support.tiny import TINY, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def engine(weights, role: str, hub: InprocHub | None, spec: SpeculativeConfig | None, **sched):  # type: ignore
    cfg = EngineConfig(
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_blocks=256, block_size=4),
        scheduler=SchedulerConfig(**sched),
        kv_transfer=KVTransferConfig(role=role, backend=None if hub is None else "inproc"),
        speculative=spec,
    )
    transport = None if hub is None else InprocTransport(LAYOUT, hub)
    return LLMEngine(cfg, model_config=TINY, weights=weights, kv_transport=transport)


class DraftWatch:
    """Sits in front of the decode engine's executor and checks, before every step runs, that each request
    carrying drafts is running with its KV here and its first token known."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner = engine.executor
        self.engine = engine
        self.num_draft_steps = 0
        self.num_draft_steps_beside_transfers = 0  # ... while another request's KV was in flight
        self.drafts: dict[str, list[int]] = {}  # req_id -> drafts run by each of its sampling steps

    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        drafting = [s for s in out.scheduled if s.num_spec_tokens]
        for s in drafting:
            assert s.req.req_id not in self.engine.scheduler.receiving, s.req.req_id
            assert s.req.status is RequestStatus.RUNNING and s.req.output_token_ids, s.req.req_id
        for s in out.scheduled:
            if s.samples:
                self.drafts.setdefault(s.req.req_id, []).append(s.num_spec_tokens)
        if drafting:
            self.num_draft_steps += 1
            self.num_draft_steps_beside_transfers += bool(self.engine.scheduler.receiving)
        return self.inner.execute(out, after_layer)

    def propose_received(self, reqs, num_running: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
        return self.inner.propose_received(reqs, num_running)

    def apply_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        self.inner.apply_swaps(swap_in, swap_out)

    def release(self, req_id: str) -> None:
        self.inner.release(req_id)

    def skip_draws(self, req, num_draws: int) -> None:  # type: ignore[no-untyped-def]
        self.inner.skip_draws(req, num_draws)


@pytest.fixture(scope="module")
def prompts(tiny_weights) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Repeated text, so lookups find matches, followed by 30 tokens of its own greedy continuation: the
    tiny model's output repeats itself, so first tokens occur in their prompt (a draft proposed right
    after the first token needs that)."""
    ps = [p + p for p in random_prompts(6, 4, 30, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    return [p + o for p, o in zip(ps, colocated(tiny_weights, ps, None, params=params))]


def colocated(weights, prompts, spec, watch=None, params=GREEDY) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Greedy outputs of one colocated engine; `watch` (a list) receives its `DraftWatch`."""
    e = engine(weights, "both", None, spec)
    if watch is not None:
        e.executor = DraftWatch(e)
        watch.append(e.executor)
    for i, p in enumerate(prompts):
        e.add_request(p, params, req_id=str(i))
    done: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    e.close()
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("p_opts", [{}, dict(policy="chunked", max_num_batched_tokens=16, chunk_size=7)])
def test_decode_instance_speculates_with_unchanged_greedy_output(tiny_weights, prompts, p_opts):  # type: ignore[no-untyped-def]
    want = colocated(tiny_weights, prompts, None)
    hub = InprocHub()
    p = engine(tiny_weights, "prefill", hub, None, **p_opts)
    d = engine(tiny_weights, "decode", hub, NGRAM)
    watch = DraftWatch(d)
    d.executor = watch
    try:
        outs = generate_disaggregated(p, d, prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.error is None for o in outs)
        stats = d.spec_decode_stats
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert watch.num_draft_steps > 0
        # Drafts proposed when the KV and first token arrived: each request drafts step by step exactly
        # as it does colocated after its prefill step.
        here: list[DraftWatch] = []
        colocated(tiny_weights, prompts, NGRAM, here)
        assert sum(map(sum, watch.drafts.values())) == stats.num_draft_tokens
        assert any(d[0] for d in watch.drafts.values()), "no request drafted at its first step here"
        for i in range(len(prompts)):
            assert watch.drafts[f"d{i}"] == here[0].drafts[str(i)][1:], i
        if p_opts:  # prompts reach the decode side over many steps: some decode while others wait for KV
            assert watch.num_draft_steps_beside_transfers > 0
        assert_no_leaks(p, d)
    finally:
        p.close()
        d.close()


def test_speculation_on_both_sides_matches_colocated_speculation(tiny_weights, prompts):  # type: ignore[no-untyped-def]
    """A prefill instance configured for speculation proposes nothing for requests it hands over."""
    hub = InprocHub()
    p = engine(tiny_weights, "prefill", hub, NGRAM)
    d = engine(tiny_weights, "decode", hub, NGRAM)
    try:
        outs = generate_disaggregated(p, d, prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == colocated(tiny_weights, prompts, NGRAM)
        assert p.spec_decode_stats is not None and p.spec_decode_stats.num_drafts == 0
        assert_no_leaks(p, d)
    finally:
        p.close()
        d.close()
