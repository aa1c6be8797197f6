"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a context-free grammar (Lark or GBNF). Torch-free.

The grammar engine is llguidance (imported only when a request asks for a constraint). What a request
asks for is a `StructuredOutputs` value on its `SamplingParams` (vLLM's field names). The engine loop
compiles it into a `Grammar`, one per request, at `add_request` (a bad grammar is an
InvalidRequestError there, nothing allocated); from then on:

- `SchedulerOutput.to_batch` has the grammars of the requests that sample in the step compute their
  bitmasks of allowed next tokens (`bitmasks`: one bit per vocabulary entry, all in one call), and the
  sampler sets every other token's logit to -inf before choosing (greedy, random, or verifying drafts);
- the scheduler feeds each accepted token to the grammar and finishes the request with "stop" once the
  grammar is complete (EOS is allowed only where the grammar accepts);
- with speculative decoding, a request's drafts are cut to those its grammar takes, and the step gets
  a mask for each draft position (`bitmasks_with_drafts`) so drafts are verified under the grammar.

Compiling is ~1 ms for ordinary schemas (host G); llguidance's parser limits bound pathological ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequestError

# Bound on the text of one constraint (schema, regex, grammar, choices together), in characters.
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 1_024

# Compact JSON output: "," and ":" between items, no whitespace. Free whitespace lets a model fill
# max_tokens with newlines (a known failure of greedy decoding under JSON grammars); a schema can ask for
# it with {"x-guidance": {"whitespace_flexible": true}}.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Exactly one constraint (vLLM's `StructuredOutputsParams` names): `json`, a JSON schema (a dict or
    its text); `json_object`, any JSON object; `regex`; `choice`, one of these strings exactly;
    `grammar`, a Lark or GBNF grammar."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def validate(self) -> None:
        """Shape and size checks (no compiling: that needs the tokenizer, in the engine)."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) or "none")
            )
        size = 0
        if self.json is not None:
            if not isinstance(self.json, (dict, str)):
                raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object or its text)")
            try:
                size = len(self.json) if isinstance(self.json, str) else len(_dumps(self.json))
            except (TypeError, ValueError, RecursionError):  # not JSON-serialisable, or nested too deeply
                raise InvalidRequestError("structured_outputs.json must be a JSON schema of JSON values") from None
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, str) or not v:
                    raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string")
                size = len(v)
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, list) or not c or len(c) > MAX_CHOICES:
                raise InvalidRequestError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if any(not isinstance(s, str) or not s for s in c):
                raise InvalidRequestError("structured_outputs.choice must hold non-empty strings")
            size = sum(len(s) for s in c)
        if size > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the structured output constraint is longer than {MAX_SPEC_CHARS} characters")

    def to_llguidance(self) -> str:
        """The constraint as an llguidance grammar (its JSON text)."""
        import llguidance

        m = llguidance.LLMatcher
        try:
            if self.json is not None:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, (dict, bool)):
                    raise InvalidRequestError("structured_outputs.json must be a JSON schema object")
                return m.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
            if self.json_object:
                return m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
            if self.regex is not None:
                return m.grammar_from_regex(self.regex)
            if self.choice is not None:
                return m.grammar_from_lark("start: " + " | ".join(_dumps(s) for s in self.choice))
            assert self.grammar is not None
            return llguidance.grammar_from("grammar", self.grammar)
        except (ValueError, TypeError, RecursionError) as e:  # a schema that is not JSON, a GBNF that fails
            raise InvalidRequestError(f"invalid structured output constraint: {e}") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class Grammar:
    """One request's constraint in progress: which tokens may come next, and the tokens taken so far."""

    __slots__ = ("_matcher", "_compiler")

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler = compiler

    def bitmask(self) -> bytes:
        """The tokens allowed next (layout of `bitmasks`); one grammar's, for tests and tools."""
        return bitmasks([self])[0]

    def accept(self, token: int) -> bool:
        """Take a sampled token; False (and the grammar broken for good) if it was not allowed."""
        return bool(self._matcher.consume_token(token))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would take in a row from here (nothing is taken)."""
        return int(self._matcher.validate_tokens(list(tokens))) if tokens else 0

    @property
    def is_complete(self) -> bool:
        """Nothing more may follow (the grammar is satisfied and cannot be extended, or EOS was taken)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


def bitmasks(grammars: Sequence[Grammar]) -> list[bytes]:
    """Each grammar's allowed next tokens: bit t % 8 of byte t // 8 for token t (32-bit little-endian
    words). All of a step's masks are computed in one call on llguidance's thread pool, which runs
    without the GIL: 0.44 ms for 64 JSON grammars at SmolLM2's 49k tokens on host G, against 10 ms for
    64 calls of the matcher's own `compute_bitmask`. Grammars of one compiler."""
    if not grammars:
        return []
    import numpy as np  # (here: the control plane imports this module, and only constrained steps need it)

    compiler = grammars[0]._compiler
    assert all(g._compiler is compiler for g in grammars), "grammars of one engine's compiler"
    words = (compiler.table_vocab_size + 31) // 32
    out = np.empty((len(grammars), words), dtype=np.int32)
    compiler.executor.unsafe_compute_mask_ptr(
        [(g._matcher, i) for i, g in enumerate(grammars)], out.ctypes.data, words * 4, len(grammars)
    )
    return [row.tobytes() for row in out]


def bitmasks_with_drafts(items: Sequence[tuple[Grammar, Sequence[int]]]) -> list[tuple[bytes, ...]]:
    """For each (grammar, draft tokens): the masks after 0, 1, ..., k of its drafts (k + 1 masks, the
    layout of `bitmasks`), for verifying drafts under the grammar; the grammars end as they began. The
    drafts must be ones the grammar takes (`Grammar.valid_prefix`). One call on llguidance's thread pool,
    which advances each matcher through its drafts and rolls it back."""
    if not any(drafts for _, drafts in items):
        return [(m,) for m in bitmasks([g for g, _ in items])]
    import numpy as np

    compiler = items[0][0]._compiler
    assert all(g._compiler is compiler for g, _ in items), "grammars of one engine's compiler"
    words = (compiler.table_vocab_size + 31) // 32
    starts = [0]
    for _, drafts in items:
        starts.append(starts[-1] + len(drafts) + 1)
    out = np.empty((starts[-1], words), dtype=np.int32)
    ex = compiler.executor
    with_drafts = [(g._matcher, starts[i], list(d)) for i, (g, d) in enumerate(items) if d]
    ex.unsafe_compute_mask_ptr_with_draft_token(with_drafts, out.ctypes.data, words * 4, starts[-1])
    if without := [(g._matcher, starts[i]) for i, (g, d) in enumerate(items) if not d]:
        ex.unsafe_compute_mask_ptr(without, out.ctypes.data, words * 4, starts[-1])
    return [tuple(row.tobytes() for row in out[starts[i] : starts[i + 1]]) for i in range(len(items))]


class GrammarCompiler:
    """Compiles constraints against one tokenizer. Its token table (llguidance's `LLTokenizer`) is built at
    the first `compile`: 0.2 s for SmolLM2's 49k tokens, 0.6 s for Qwen2.5's 152k on host G, paid once
    per engine by the first request with a constraint rather than by every engine start (a thread at
    start would run beside the kernel measurements)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer` (serialised for llguidance at the first compile)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._table: Any = None
        self.executor: Any = None  # llguidance's thread pool for a step's masks (`bitmasks`)

    @property
    def table_vocab_size(self) -> int:
        return int(self._table.vocab_size)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> GrammarCompiler | None:
        """A compiler for pdserve's `Tokenizer` (anything with a `tokenizers` backend); None for others."""
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        return cls(backend, vocab_size, eos_token_ids)

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """Raises InvalidRequestError for a constraint llguidance refuses (with its message)."""
        import llguidance

        spec.validate()
        grammar = spec.to_llguidance()
        if self._table is None:
            self._table = llguidance.LLTokenizer(
                _llguidance_tokenizer_json(self._tokenizer), n_vocab=self._vocab_size, eos_token=self._eos or None
            )
            self.executor = llguidance.LLExecutor(num_threads=min(len(os.sched_getaffinity(0)), 16))
        matcher = llguidance.LLMatcher(self._table, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid structured output constraint: {matcher.get_error()}")
        return Grammar(matcher, self)


def _llguidance_tokenizer_json(backend: Any) -> str:
    """The tokenizer's JSON for llguidance, which reads every entry of `added_tokens` as a special token
    (known by a marker byte, never by its text). An added token that is ordinary text (`special` false,
    as Qwen2.5's `<tool_call>`) and is in the model's vocabulary is left out of that list, so llguidance
    knows it by its bytes: otherwise its masks allowed the token where its text fits the grammar, and
    the grammar then refused the token when it was sampled."""
    j = json.loads(backend.to_str())
    vocab = (j.get("model") or {}).get("vocab") or {}
    added = j.get("added_tokens") or []
    j["added_tokens"] = [a for a in added if a.get("special", True) or a.get("content") not in vocab]
    return json.dumps(j) if len(j["added_tokens"]) != len(added) else backend.to_str()

