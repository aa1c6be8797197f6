"""Text <-> token ids for a model, and its chat template.

`load_tokenizer` builds a `tokenizers.Tokenizer` either from the vocabulary stored in a GGUF file (byte-level
BPE only) or from a Hugging Face directory's `tokenizer.json`, and wraps it in `Tokenizer`, which adds what
serving needs: BOS handling as the model asks, the set of ids that end generation, and the chat template
rendered the way transformers renders it. A request's prompt is encoded once on arrival; its output is
turned back into text piece by piece by an `IncrementalDetokenizer` as tokens are sampled.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from pdserve.errors import InvalidRequestError, ModelLoadError

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split patterns for the `tokenizer.ggml.pre` names whose vocabularies were not trained with GPT-2's
# pattern. Any other name (including "smollm") gets ByteLevel's built-in GPT-2 pattern, which is what
# transformers' GGUF conversion does and what our tests hold us to. llama.cpp's "smollm" (and SmolLM2's
# own tokenizer.json) isolate every digit first; SmolLM2's merges contain no digit, so the two differ only
# where a run of spaces meets a digit: "a  1" is a|Ġ|Ġ|1 here and a|ĠĠ|1 there. That touches
# about one ShareGPT message in seven (indented numbered lists).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# The special-token variables transformers hands a chat template (its `special_tokens_map`).
_TEMPLATE_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special tokens and chat template.

    `special_tokens` maps transformers' names ("bos_token", "eos_token", "unk_token", "pad_token", ...) to
    token strings; they become the chat template's variables. `eos_token_ids` is every id that ends
    generation (the EOS token plus e.g. end-of-turn tokens).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        eos_token_ids: frozenset[int],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._special_tokens = {name: tok for name, tok in special_tokens.items() if tok is not None}
        self._chat_template = chat_template
        self._compiled_template: Any = None
        self._bos_token_id = self._token_id(self._special_tokens.get("bos_token"))
        self._eos_token_id = self._token_id(self._special_tokens.get("eos_token"))
        ids = set(eos_token_ids)
        if self._eos_token_id is not None:
            ids.add(self._eos_token_id)
        self._eos_token_ids = frozenset(ids)
        self._all_special_ids = sorted(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special added token: the ones `decode(skip_special_tokens=True)` drops."""
        return list(self._all_special_ids)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, BOS/EOS are added if (and only if) the model
        asks for them; special tokens written in the text are matched either way."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages`, exactly as transformers' `apply_chat_template(tokenize=False)`;
        `tools`: function definitions in OpenAI's shape, for templates that show them (`pdserve.tools`).

        Raises InvalidRequestError if the model has no template or the template rejects the messages.
        """
        import jinja2

        if self._chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template, so chat messages cannot be turned into a prompt; "
                "send a plain text prompt instead"
            )
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        for message in messages:
            if not isinstance(message, dict):
                raise InvalidRequestError(f"each message must be an object, got {message!r}")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self._chat_template)
        # transformers drops keys whose value is None before rendering.
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        try:
            return self._compiled_template.render(
                messages=chat,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:  # the messages' shapes are the caller's
            raise InvalidRequestError(f"chat template error: {exc}") from exc


def _compile_chat_template(source: str) -> Any:
    """Compile a chat template in the environment transformers uses: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a request's output ids into text as they arrive, for streaming.

    Keeps two offsets into the token list (prompt tail + output): `prefix_offset..read_offset` is the window
    whose text was already emitted, `read_offset..` the tokens not yet emitted. Each `add` decodes only the
    window from `prefix_offset`, and emits the text beyond the already-emitted part unless it ends in an
    incomplete UTF-8 character (U+FFFD), which is held back until later tokens complete it. Decoding a
    few context tokens along with the new ones keeps decoders that depend on the previous token (leading
    spaces in sentencepiece) right. Cost per call is proportional to the tokens since the last emission.
    """

    _CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._token_ids[start:end]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        """Append sampled ids; return the text they complete (possibly "")."""
        if not new_token_ids:
            return ""
        self._token_ids.extend(new_token_ids)
        window_text = self._decode(self._prefix_offset)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of a request: emit whatever was held back, incomplete characters as U+FFFD."""
        window_text = self._decode(self._prefix_offset)
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        new_text = window_text[len(self._prefix_text):]
        self._prefix_text = self._decode(self._read_offset)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._pieces.append(new_text)
        return new_text


# --------------------------------------------------------------------------------------------- loading


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of the checkpoint at `path`: a `.gguf` file or a Hugging Face directory."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf_tokenizer(path)
    if os.path.isdir(path):
        return _load_hf_tokenizer(path)
    raise ModelLoadError(f"model path {path!r} not found (expected a .gguf file or a Hugging Face directory)")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to code points 256 and up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _load_gguf_tokenizer(path: str) -> Tokenizer:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {exc}") from exc

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    model = get("ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is unsupported: "
            "pdserve reads byte-level BPE ('gpt2') vocabularies"
        )
    tokens: list[str] = get("ggml.tokens")
    merges: list[str] | None = get("ggml.merges")
    token_types: list[int] = get("ggml.token_type") or [1] * len(tokens)
    if not tokens or merges is None:
        raise ModelLoadError(f"GGUF file {path!r} lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")

    # A byte-level vocabulary spells every token in the byte alphabet; respell any token that is not.
    byte_chars = _byte_alphabet()
    alphabet = set(byte_chars.values())
    spelled = [t if set(t) <= alphabet else "".join(byte_chars[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    split = _PRE_TOKENIZER_SPLITS.get(get("ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, <|endoftext|>, ...) stay whole and are special; user-defined ones stay
    # whole but are ordinary text. A "control" token outside the byte alphabet is a converter mislabel.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types)
        if kind == _TOKEN_CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens(special)
    user_defined = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types)
        if kind == _TOKEN_USER_DEFINED and t in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    def token_of(key: str) -> str | None:
        token_id = get(f"ggml.{key}")
        return None if token_id is None or not 0 <= int(token_id) < len(tokens) else tokens[int(token_id)]

    special_tokens = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
    }
    add_bos, add_eos = bool(get("ggml.add_bos_token", False)), bool(get("ggml.add_eos_token", False))
    _set_bos_eos(backend, special_tokens, add_bos, add_eos)
    # End-of-turn / end-of-message tokens end generation like EOS does (llama.cpp treats them so).
    stop_ids = {get(f"ggml.{key}") for key in ("eot_token_id", "eom_token_id")} - {None}
    return Tokenizer(backend, special_tokens, frozenset(int(i) for i in stop_ids), get("chat_template"))


def _set_bos_eos(
    backend: tokenizers.Tokenizer, special_tokens: dict[str, str | None], add_bos: bool, add_eos: bool
) -> None:
    """Make `encode(add_special_tokens=True)` add BOS/EOS exactly when the model's flags say so."""
    bos = special_tokens.get("bos_token") if add_bos else None
    eos = special_tokens.get("eos_token") if add_eos else None
    pieces = [(bos, "bos"), (eos, "eos")]
    used = [(tok, backend.token_to_id(tok)) for tok, _ in pieces if tok is not None]
    if any(token_id is None for _, token_id in used):
        raise ModelLoadError("the BOS/EOS token the model asks to add is not in its vocabulary")
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=used)


def _load_hf_tokenizer(path: str) -> Tokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ModelLoadError(f"{path!r} has no tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from exc
    tokenizer_config = _read_json(os.path.join(path, "tokenizer_config.json"))

    special_tokens: dict[str, str] = {}
    for name in _TEMPLATE_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):  # serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            special_tokens[name] = value
    # tokenizer.json already adds BOS/EOS in its post-processor; an explicit flag overrides it.
    if "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config:
        _set_bos_eos(
            backend,
            dict(special_tokens),
            bool(tokenizer_config.get("add_bos_token", False)),
            bool(tokenizer_config.get("add_eos_token", False)),
        )

    stop_ids: set[int] = set()
    for config_name in ("config.json", "generation_config.json"):
        eos = _read_json(os.path.join(path, config_name)).get("eos_token_id")
        stop_ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    chat_template = _hf_chat_template(path, tokenizer_config)
    return Tokenizer(backend, special_tokens, frozenset(int(i) for i in stop_ids), chat_template)


def _hf_chat_template(path: str, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    return data if isinstance(data, dict) else {}
