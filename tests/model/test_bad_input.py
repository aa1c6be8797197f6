"""Bad input raises InvalidRequestError (or ModelLoadError), allocates nothing, and the engine keeps
serving the other requests."""

from __future__ import annotations

import pytest

from pdserve import LLM, InvalidRequestError, ModelLoadError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    "kw",
    [dict(max_tokens=0), dict(max_tokens=-3), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1.0),
     dict(top_k=-5), dict(min_p=2.0), dict(logprobs=-1), dict(stop=[""]), dict(temperature=float("nan"))],
)
def test_bad_sampling_params(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_bad_prompts_do_not_disturb_others(make_tiny_llm):
    llm = make_tiny_llm(max_model_len=64)
    eng = llm.engine
    good = [eng.add_request([1, 2, 3, 4], GREEDY), eng.add_request([5, 6, 7], GREEDY)]
    eng.step()  # the good requests are running now
    for bad in ([], [1] * 64, [1] * 100, [1, 2, 10_000], [-1, 2]):
        with pytest.raises(InvalidRequestError):
            eng.add_request(bad, GREEDY)
    with pytest.raises(InvalidRequestError):
        eng.add_request("text prompt without a tokenizer", GREEDY)
    with pytest.raises(InvalidRequestError):
        eng.add_request([1, 2], GREEDY, req_id=good[0])  # id in use
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(good)
    assert all(len(o.outputs[0].token_ids) == 8 for o in done.values())
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_generate_with_a_bad_prompt_runs_nothing(make_tiny_llm):
    llm = make_tiny_llm()
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], []], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_prompt_larger_than_kv_cache(make_tiny_llm):
    llm = make_tiny_llm(num_blocks=4, block_size=4)  # 16 tokens of KV in all
    with pytest.raises(InvalidRequestError, match="KV cache"):
        llm.engine.add_request(list(range(1, 20)), GREEDY)


def test_abort_frees_blocks(make_tiny_llm):
    llm = make_tiny_llm()
    eng = llm.engine
    ids = [eng.add_request(list(range(1, 30)), GREEDY) for _ in range(3)]
    eng.step()
    out = eng.abort_request(ids[0])
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.abort_request("no-such-request") is None
    eng.abort_request(ids[2])  # may still be waiting or running
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_failed_step_fails_its_requests_only(make_tiny_llm, monkeypatch):
    llm = make_tiny_llm()
    eng = llm.engine
    rid = eng.add_request([1, 2, 3], GREEDY)

    def boom(*_):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(eng.runner, "execute", boom)
    outs = eng.step()
    assert [o.request_id for o in outs] == [rid]
    assert outs[0].outputs[0].finish_reason == "error" and "simulated" in outs[0].error
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    monkeypatch.undo()
    assert llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_failed_step_is_replayed_to_fail_only_the_culprit(make_tiny_llm, monkeypatch):
    """Under `chunked` a running decode shares a bad prompt's step: when the step fails, its requests run
    one at a time, only the one that fails again is failed, and the others' tokens are unchanged."""
    poison = 311
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in make_tiny_llm(scheduler="chunked").generate(prompts, params, use_tqdm=False)]
    llm = make_tiny_llm(scheduler="chunked")
    eng = llm.engine
    execute = eng.runner.execute

    def failing(sched, after_layer=None):  # type: ignore[no-untyped-def]
        if any(poison in s.req.prompt_token_ids for s in sched.scheduled):
            raise RuntimeError("injected failure")
        return execute(sched, after_layer)

    monkeypatch.setattr(eng.runner, "execute", failing)
    ids = [eng.add_request(p, params) for p in prompts]
    outs: dict[str, object] = {}
    for _ in range(3):  # both decoding
        for o in eng.step():
            outs[o.request_id] = o
    bad = eng.add_request([4, poison, 6], params)
    shared = False
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
            if o.request_id == bad:
                shared = not outs[ids[0]].finished  # the good ones were still running in that step
    assert shared
    assert outs[bad].outputs[0].finish_reason == "error" and "injected failure" in outs[bad].error
    for rid, ref in zip(ids, reference):
        assert outs[rid].outputs[0].finish_reason == "length" and outs[rid].outputs[0].token_ids == ref
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(model="/no/such/model.gguf", device="cpu")


def test_sequence_that_would_outgrow_the_kv_cache_stops_with_length(make_tiny_llm):
    llm = make_tiny_llm(num_blocks=4, block_size=2)  # 8 tokens of KV in all
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 8
    assert llm.engine.block_manager.num_free_blocks == 4


def test_control_plane_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; import pdserve, pdserve.scheduler, pdserve.kv.block_manager, pdserve.request; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
