"""StructuredOutputs' checks and the Grammar / GrammarCompiler wrappers over llguidance (tiny tokenizer)."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.request import SamplingParams
from pdserve.structured import MAX_SPEC_CHARS, GrammarCompiler, StructuredOutputs
from tests.support.tiny_tokenizer import tiny_tokenizer


def _nested(depth: int) -> dict:
    d: dict = {}
    for _ in range(depth):
        d = {"items": d}
    return d


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(json={"type": "object"}, json_object=True), "exactly one"),
        (dict(regex=""), "non-empty string"),
        (dict(grammar=5), "non-empty string"),
        (dict(choice=[]), "list of 1 to"),
        (dict(choice=["a", ""]), "non-empty strings"),
        (dict(choice="abc"), "list of 1 to"),
        (dict(json=[1, 2]), "JSON schema"),
        (dict(regex="a" * (MAX_SPEC_CHARS + 1)), "longer than"),
        (dict(json={"enum": ["x" * MAX_SPEC_CHARS]}), "longer than"),
        (dict(json={"const": object()}), "JSON values"),
        (dict(json=_nested(100_000)), "JSON values"),
    ],
)
def test_bad_constraints_are_refused(kw, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(structured_outputs=StructuredOutputs(**kw))


def test_sampling_params_refuse_a_constraint_of_the_wrong_type():
    with pytest.raises(InvalidRequestError, match="StructuredOutputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = tiny_tokenizer()
    c = GrammarCompiler.for_tokenizer(tok, 512, frozenset({0}))
    assert c is not None
    return c


def allowed(grammar) -> list[int]:  # type: ignore[no-untyped-def]
    b = grammar.bitmask()
    return [t for t in range(len(b) * 8) if b[t // 8] >> (t % 8) & 1]


def test_a_choice_grammar_allows_its_strings_then_completes(compiler):
    tok = tiny_tokenizer()
    g = compiler.compile(StructuredOutputs(choice=["yes", "no"]))
    first = allowed(g)
    assert first and all(t < tok.vocab_size for t in first)
    assert {tok.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"}
    assert 0 not in first  # EOS only where the grammar accepts
    ids = tok.encode("no")
    for t in ids:
        assert not g.is_complete
        assert g.accept(t)
    assert g.is_complete and g.error is None


def test_a_token_the_grammar_forbids_breaks_it(compiler):
    tok = tiny_tokenizer()
    g = compiler.compile(StructuredOutputs(regex=r"[0-9]+"))
    assert not g.accept(tok.encode("x")[0])
    assert g.error


def test_json_schema_text_and_dict_compile_alike(compiler):
    a = compiler.compile(StructuredOutputs(json={"type": "object"}))
    b = compiler.compile(StructuredOutputs(json='{"type": "object"}'))
    c = compiler.compile(StructuredOutputs(json_object=True))
    assert allowed(a) == allowed(b) == allowed(c)


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputs(json="{not json"),
        StructuredOutputs(json="[1, 2]"),
        StructuredOutputs(regex="a{2,1}"),
        StructuredOutputs(grammar="root ::= undefined"),
    ],
)
def test_compile_errors_are_invalid_requests(compiler, so):
    with pytest.raises(InvalidRequestError):
        compiler.compile(so)


def test_a_tokenizer_without_a_backend_has_no_compiler():
    assert GrammarCompiler.for_tokenizer(object(), 10, frozenset()) is None
    assert GrammarCompiler.for_tokenizer(None, 10, frozenset()) is None


def test_an_added_token_of_ordinary_text_is_known_by_its_text():
    """A token added as ordinary text and also in the model's vocabulary (as GGUF files list Qwen2.5's
    <tool_call>): the grammar takes it where its text fits (llguidance would read it as a special token,
    which no text grammar takes, while its masks allowed it), and the tokens its masks allow lead to the
    same text."""
    import json

    import tokenizers

    base = tiny_tokenizer().backend
    model = json.loads(base.to_str())["model"]
    vocab = {**model["vocab"], "<tag>": len(model["vocab"])}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = base.pre_tokenizer
    backend.decoder = base.decoder
    backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True, normalized=False)])
    backend.add_tokens([tokenizers.AddedToken("<tag>", special=False, normalized=False)])
    tag = vocab["<tag>"]
    ids = backend.encode("no<tag>yes").ids
    assert tag in ids
    compiler = GrammarCompiler(backend, 512, frozenset({0}))
    g = compiler.compile(StructuredOutputs(choice=["no<tag>yes"]))
    for t in ids:
        assert g.accept(t), g.error
    assert g.is_complete
    g, walked = compiler.compile(StructuredOutputs(choice=["no<tag>yes"])), []
    while not g.is_complete:
        t = allowed(g)[0]
        assert g.accept(t), g.error
        walked.append(t)
    assert backend.decode(walked) == "no<tag>yes"


def test_masks_after_each_draft_equal_taking_the_drafts_one_by_one(compiler):
    """`bitmasks_with_drafts`: the mask after 0..k drafts, as taking them one at a time gives, with the
    grammar left where it was; grammars without drafts in the same call; a refused draft cuts
    `valid_prefix`."""
    from pdserve.structured import bitmasks, bitmasks_with_drafts

    tok = tiny_tokenizer()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    g = compiler.compile(StructuredOutputs(json=schema))
    h = compiler.compile(StructuredOutputs(choice=["yes", "no"]))
    ids = tok.encode('{"name":"Ada","age":36}')
    assert g.accept(ids[0])
    drafts = ids[1:]
    assert g.valid_prefix(drafts) == len(drafts)
    assert g.valid_prefix(drafts[:2] + tok.encode("x") + drafts[2:]) == 2
    got = bitmasks_with_drafts([(h, []), (g, drafts)])
    want = []
    for j in range(len(drafts) + 1):
        want.append(bitmasks([g])[0])
        if j < len(drafts):
            assert g.accept(drafts[j])
    assert got[0] == (bitmasks([h])[0],)
    assert list(got[1]) == want and len(set(want)) > 3
    fresh = compiler.compile(StructuredOutputs(json=schema))
    assert fresh.accept(ids[0])
    bitmasks_with_drafts([(fresh, drafts)])
    assert bitmasks([fresh])[0] == want[0]  # rolled back
    assert bitmasks_with_drafts([(h, [])]) == [(bitmasks([h])[0],)]
