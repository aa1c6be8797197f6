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
