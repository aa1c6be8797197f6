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
