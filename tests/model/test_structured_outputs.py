"""Structured outputs through the engine (tiny random model with a tiny byte-level BPE tokenizer): random
sampling under a constraint always yields text the constraint accepts (the random model never would on
its own), and greedy outputs equal a by-hand reference that masks whole-sequence logits token by token
with its own llguidance matcher, whatever the batching, chunking, preemption, prefix cache, speculation
or disaggregation. Requests without a constraint are untouched by those with one."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.structured import StructuredOutputs
from tests.support.teacher_forced import teacher_forced_logits
from tests.support.tiny import TINY, random_prompts
from tests.support.tiny_tokenizer import tiny_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["math", "engines", "fox"]}, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "alive"],
    "additionalProperties": False,
}
EXPR = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
GBNF = 'root ::= "(" [a-c]+ ")" ("," "(" [a-c]+ ")")*'
CONSTRAINTS = {
    "json": StructuredOutputs(json=PERSON),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[a-z]{2,5}-\d{2}"),
    "choice": StructuredOutputs(choice=["yes", "no", "maybe not"]),
    "lark": StructuredOutputs(grammar=EXPR),
    "gbnf": StructuredOutputs(grammar=GBNF),
}


def _expr(text: str, i: int = 0) -> int:
    """Parses EXPR's `expr` from text[i]; returns where it ends (-1: not an expr)."""
    i = _term(text, i)
    while 0 <= i < len(text) and text[i] in "+-":
        i = _term(text, i + 1)
    return i


def _term(text: str, i: int) -> int:
    if i < 0 or i >= len(text):
        return -1
    if text[i] == "(":
        i = _expr(text, i + 1)
        return i + 1 if 0 <= i < len(text) and text[i] == ")" else -1
    m = re.match(r"[0-9]{1,3}(?![0-9])", text[i:])
    return i + m.end() if m else -1


def accepted(kind: str, text: str) -> bool:
    """Whether `text` satisfies constraint `kind`, checked without llguidance."""
    if kind == "json":
        try:
            v = json.loads(text)
        except ValueError:
            return False
        return (
            isinstance(v, dict)
            and set(v) <= set(PERSON["properties"]) and {"name", "age", "alive"} <= set(v)
            and isinstance(v["name"], str) and len(v["name"]) <= 8
            and type(v["age"]) is int and 0 <= v["age"] <= 150
            and isinstance(v["alive"], bool)
            and all(t in ("math", "engines", "fox") for t in v.get("tags", [])) and len(v.get("tags", [])) <= 3
        )
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(r"[a-z]{2,5}-\d{2}", text) is not None  # (\d: any Unicode digit, as Rust's)
    if kind == "choice":
        return text in ("yes", "no", "maybe not")
    if kind == "lark":
        return _expr(text) == len(text)
    if kind == "gbnf":
        return re.fullmatch(r"\([a-c]+\)(,\([a-c]+\))*", text) is not None
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return tiny_tokenizer()


@pytest.fixture
def make_llm(tiny_weights, tok):  # type: ignore[no-untyped-def]
    def make(**kw) -> LLM:
        kw.setdefault("num_blocks", 256)
        kw.setdefault("block_size", 4)
        return LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, tokenizer=tok, **kw)

    return make


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, 3, 30, seed=31, vocab=400)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_random_samples_satisfy_the_constraint(make_llm, prompts, kind, spec) -> None:  # type: ignore[no-untyped-def]
    """Random draws satisfy the constraint, with or without n-gram drafts (verified by rejection sampling
    under each draft position's mask)."""
    llm = make_llm(speculative_config=NGRAM) if spec else make_llm()
    so = CONSTRAINTS[kind]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=so) for s in range(len(prompts))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    done = [o for o in outs if o.finish_reason == "stop"]
    # (a random model's free JSON object stays inside its first string: only its beginnings are checked)
    assert len(done) >= (0 if kind == "json_object" else 3), [(o.text, o.finish_reason) for o in outs]
    for o in done:
        assert accepted(kind, o.text), o.text
    for o in outs:  # those cut at max_tokens are a beginning the constraint allows
        assert o.finish_reason in ("stop", "length")
        assert fresh_matcher(so).consume_tokens(o.token_ids)
    # unconstrained, the same draws give text no constraint accepts
    free = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=s, max_tokens=80) for s in range(len(prompts))],
                        use_tqdm=False)
    assert not any(accepted(kind, o.outputs[0].text) for o in free)
    assert not any(fresh_matcher(so).consume_tokens(o.outputs[0].token_ids) for o in free)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def fresh_matcher(so: StructuredOutputs) -> llguidance.LLMatcher:
    """A matcher of the test's own, outside the engine."""
    table = llguidance.LLTokenizer(tiny_tokenizer().backend.to_str(), n_vocab=TINY.vocab_size, eos_token=[0])
    return llguidance.LLMatcher(table, so.to_llguidance(), log_level=0)


def reference(llm: LLM, prompt: list[int], so: StructuredOutputs, max_tokens: int) -> list[int]:
    """Greedy decoding by hand: the whole sequence's last-position logits, one prefill per token, with
    every token a fresh llguidance matcher does not allow set to -inf; stops where the matcher does."""
    matcher = fresh_matcher(so)
    out: list[int] = []
    while len(out) < max_tokens and not matcher.is_stopped():
        logits = teacher_forced_logits(llm.engine, prompt + out)[-1]
        mask = torch.tensor([bool(matcher.compute_bitmask()[t // 8] >> (t % 8) & 1) for t in range(TINY.vocab_size)])
        token = int(logits.masked_fill(~mask, float("-inf")).argmax())
        assert matcher.consume_token(token)
        out.append(token)
        if token == 0:  # EOS
            break
    return out


GREEDY_KINDS = ["json", "regex", "lark"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def references(tiny_weights, tok, prompts) -> dict[str, list[list[int]]]:  # type: ignore[no-untyped-def]
    llm = LLM(dtype="float32", device="cpu", model_config=TINY, weights=tiny_weights, tokenizer=tok, num_blocks=64,
              block_size=4)
    return {k: [reference(llm, p, CONSTRAINTS[k], MAX_TOKENS) for p in prompts] for k in GREEDY_KINDS}


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(scheduler="chunked", max_num_batched_tokens=16, chunk_size=8),
        dict(num_blocks=20),  # preemption: a recomputed sequence's grammar keeps its state
        dict(num_blocks=20, preemption_mode="swap"),
        dict(attention_backend="cpu-paged"),
        dict(speculative_config=NGRAM),  # drafts verified under each draft position's mask
    ],
    ids=["default", "no-prefix-cache", "chunked", "recompute", "swap", "cpu-paged", "ngram"],
)
def test_constrained_greedy_equals_the_reference(make_llm, prompts, references, opts) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm(**opts)
    kinds = GREEDY_KINDS
    # every constraint's requests and unconstrained ones in one batch
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[k]) for k in kinds]
    batch = [p for p in prompts for _ in kinds] + prompts
    outs = llm.generate(batch, [q for _ in prompts for q in params] + [plain] * len(prompts), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, _ in enumerate(prompts):
        for j, k in enumerate(kinds):
            assert got[i * len(kinds) + j] == references[k][i], (k, i)
    alone = make_llm().generate(prompts, plain, use_tqdm=False)
    assert got[len(prompts) * len(kinds) :] == [o.outputs[0].token_ids for o in alone]
    if "speculative_config" in opts:
        stats = llm.engine.spec_decode_stats
        assert stats is not None and stats.num_draft_tokens > 0  # the plain requests still speculate
        # ... and so do the constrained ones: alone, they run and accept drafts, with the same output
        spec = make_llm(**opts)
        alone_c = spec.generate([p for p in prompts for _ in kinds], [q for _ in prompts for q in params], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in alone_c] == got[: len(prompts) * len(kinds)]
        s = spec.engine.spec_decode_stats
        assert s is not None and s.num_draft_tokens > 0 and s.num_accepted_tokens > 0, s
    if opts.get("num_blocks") == 20:
        assert any(o.metrics is not None and o.metrics.num_preemptions for o in outs[: len(prompts) * len(kinds)])
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_constraint_changes_the_greedy_output(make_llm, prompts, references) -> None:  # type: ignore[no-untyped-def]
    plain = make_llm().generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for k in GREEDY_KINDS:
        assert references[k] != [o.outputs[0].token_ids for o in plain]


def test_logprobs_stay_those_of_the_model(make_llm, prompts) -> None:  # type: ignore[no-untyped-def]
    """Logprobs are the raw model's (vLLM's default), as without a constraint: the sampled token's entry
    is its unconstrained logprob."""
    llm = make_llm()
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=2, structured_outputs=CONSTRAINTS["regex"])
    out = llm.generate(prompts[0], p, use_tqdm=False)[0].outputs[0]
    ids = prompts[0] + out.token_ids
    lp = torch.log_softmax(teacher_forced_logits(make_llm().engine, ids)[len(prompts[0]) - 1 : -1], dim=-1)
    for j, (t, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[t] == pytest.approx(float(lp[j, t]), abs=1e-4)


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutputs(json='{"type": "object", "properties": '), "invalid structured output"),
        (StructuredOutputs(json={"type": "no-such-type"}), "invalid structured output"),
        (StructuredOutputs(regex="(unclosed"), "invalid structured output"),
        (StructuredOutputs(grammar="start: undefined_rule"), "invalid structured output"),
    ],
)
def test_a_bad_constraint_is_refused_and_allocates_nothing(make_llm, so, message) -> None:  # type: ignore[no-untyped-def]
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"]),
                       use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no", "maybe not")


def test_an_engine_without_a_tokenizer_refuses_constraints(make_tiny_llm) -> None:  # type: ignore[no-untyped-def]
    llm = make_tiny_llm()
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.engine.add_request([5, 6], SamplingParams(structured_outputs=CONSTRAINTS["choice"]))


@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_disaggregated_equals_colocated(tiny_weights, tok, prompts, references, kind) -> None:  # type: ignore[no-untyped-def]
    """The prefill instance samples the first token under the constraint; the decode instance compiles
    its own and takes that token before its first step."""
    from pdserve.engine.disagg import generate_disaggregated
    from pdserve.transfer.inproc import InprocHub
    from tests.model.test_disagg import _layout, assert_no_leaks, make_engine, make_transport

    hub = InprocHub()
    p = make_engine(tiny_weights, "prefill", make_transport("inproc", hub, _layout({})), tokenizer=tok)
    d = make_engine(tiny_weights, "decode", make_transport("inproc", hub, _layout({})), tokenizer=tok)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind])
        outs = generate_disaggregated(p, d, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == references[kind]
        assert all(o.error is None for o in outs)
        assert_no_leaks(p, d)
    finally:
        p.close()
        d.close()
