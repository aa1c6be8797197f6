"""What each storage option (a quantized KV cache, 8-bit weights, fp32) costs in accuracy against a
baseline engine (issue 17 item 6; `docs/accuracy.md`, `benchmarks/accuracy.py`).

An option is a name for a few engine settings (`OPTIONS`). Each gets its own engine, built from one base
`EngineConfig` plus its overrides, and every engine scores the same conversations two ways:

- **Teacher-forced.** A conversation's prompt (through the chat template) but its last token is
  prefilled, then the stream `prompt[-1:] + reply[:-1]` is fed `chunk` tokens per step with the paged
  cache holding every earlier token, so each reference-reply position's next-token distribution comes from attention that reads the
  earlier K/V from the cache as decode does (a quantized cache shows its error; `chunk=1` is decode
  exactly). The step plan depends only on the conversations' lengths, so all engines run the same
  steps in lockstep and the baseline's log-softmax rows are compared with each option's as they come:
  nothing of size reply x vocab is kept. Per option: KL(p_base || p_opt) (mean, percentiles, by context
  length), top-1 agreement and the perplexity of the reference reply, over all reply positions.
- **Greedy.** Every engine continues every prompt greedily through `LLM.generate`; per prompt, the first
  index where an option's tokens differ from the baseline's.
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Protocol

import torch

from pdserve.batch import BatchRequest
from pdserve.bench.datasets import load_sharegpt_records
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.linear import amx_bf16
from pdserve.request import Request, SamplingParams

logger = logging.getLogger(__name__)

# Option name -> engine settings it overrides (fields of EngineConfig, CacheConfig or SchedulerConfig).
OPTIONS: Mapping[str, dict[str, object]] = MappingProxyType({
    "bf16": {"dtype": "bfloat16"},
    "fp32": {"dtype": "float32"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8_e4m3"},
    "kv-int4": {"kv_cache_dtype": "int4"},
    "w-int8": {"weight_dtype": "int8"},
    # an int8 x int8 kernel at every row count: what w8a8 costs wherever the autotune picks one (torch's
    # `_int_mm`: bitwise equal to oneDNN's where both run, and the only one on CPUs without VNNI)
    "w-w8a8": {"weight_dtype": "w8a8", "linear_kernel": "torch"},
})
BASELINE = "bf16"

EngineFactory = Callable[[EngineConfig], LLMEngine]


class OptionError(ValueError):
    """An option names an engine setting this build does not have, or a value it rejects."""


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class Conversation:
    prompt_ids: list[int]  # the first human turn through the chat template, as the engine would encode it
    reply_ids: list[int]  # the first gpt turn: the reference every reply position is scored against

    @property
    def stream_ids(self) -> list[int]:
        """What runs through the model: every reply token is predicted from all the tokens before it."""
        return self.prompt_ids + self.reply_ids[:-1]


# ---- options ---------------------------------------------------------------------------------------
_NESTED = frozenset({"cache", "scheduler", "kv_transfer", "speculative"})


def option_config(base: EngineConfig, name: str, overrides: Mapping[str, object]) -> EngineConfig:
    """`base` with an option's overrides, each routed to the dataclass that owns the field (EngineConfig,
    its CacheConfig or its SchedulerConfig; validated by their constructors). A field none of them has (a
    setting of a branch not merged into this build) or a value one rejects raises OptionError naming the
    option."""
    routed: dict[type, dict[str, object]] = {EngineConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
    for key, value in overrides.items():
        owner = next((cls for cls in routed if key in {f.name for f in fields(cls)} - _NESTED), None)
        if owner is None:
            raise OptionError(
                f"option {name!r}: this build has no engine setting {key!r} (not a field of EngineConfig, "
                f"CacheConfig or SchedulerConfig)"
            )
        routed[owner][key] = value
    if routed[EngineConfig].get("weight_dtype", base.weight_dtype) in ("int8", "w8a8"):
        # a bf16 kernel named by the base is not one of the 8-bit weights' kernels: they choose their own
        routed[EngineConfig].setdefault("linear_kernel", "auto")
    try:
        return replace(
            base,
            **routed[EngineConfig],
            cache=replace(base.cache, **routed[CacheConfig]),
            scheduler=replace(base.scheduler, **routed[SchedulerConfig]),
        )
    except (ValueError, TypeError) as e:
        raise OptionError(f"option {name!r} {dict(overrides)}: {e}") from None


def parse_option(spec: str) -> tuple[str, dict[str, object]]:
    """`NAME=JSON-object` (the script's `--define`) as a name and its overrides."""
    name, sep, text = spec.partition("=")
    try:
        overrides = json.loads(text) if sep else None
    except json.JSONDecodeError as e:
        raise OptionError(f"option {name!r}: its settings are not valid JSON: {e}") from None
    if not name or not isinstance(overrides, dict):
        example = 'kv-int8={"kv_cache_dtype": "int8"}'
        raise OptionError(f"an option is NAME=JSON-object, e.g. {example}; got {spec!r}")
    return name, overrides


def select_options(
    baseline: str, names: Sequence[str], defined: Mapping[str, dict[str, object]] | None = None
) -> dict[str, dict[str, object]]:
    """The baseline first, then `names` (without repeating it), looked up in `OPTIONS` and `defined`
    (which may add names or redefine known ones)."""
    known = {**OPTIONS, **(defined or {})}
    chosen = [baseline] + [n for n in dict.fromkeys(names) if n != baseline]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise OptionError(f"unknown option(s) {unknown}; known: {sorted(known)}")
    return {n: known[n] for n in chosen}


def base_config(
    model: str | None,
    *,
    max_total_len: int = 1024,
    max_tokens: int = 128,
    max_num_seqs: int = 16,
    block_size: int = 16,
    device: str = "auto",
    num_threads: int | None = None,
    batch_invariant: bool = True,
    seed: int = 0,
) -> EngineConfig:
    """The settings every option starts from. The KV cache is sized in blocks (not bytes), enough for
    `max_num_seqs` sequences of `max_total_len + max_tokens` tokens, so an option that stores K/V in fewer
    bytes runs the same schedule as the baseline. `batch_invariant` pins one row-independent matmul
    kernel: a row's rounding then depends neither on the batch around it nor on a kernel timing that
    could pick differently in two engines, so the figures measure the option and nothing else. Where
    there are two (pdserve's AVX-512 and AMX kernels) it names the AMX one, which is also the fast one at
    the scoring steps' hundreds of rows; an option with 8-bit weights gets its own (`option_config`)."""
    max_len = max_total_len + max_tokens
    num_blocks = max_num_seqs * -(-max_len // block_size) + 1
    return EngineConfig(
        model=model,
        device=device,
        num_threads=num_threads,
        batch_invariant=batch_invariant,
        linear_kernel="amx" if batch_invariant and device != "cuda" and amx_bf16() else "auto",
        seed=seed,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_model_len=max_len, max_num_batched_tokens=max(2048, max_total_len)
        ),
    )


def build_engines(
    base: EngineConfig,
    options: Mapping[str, Mapping[str, object]],
    make_engine: EngineFactory = LLMEngine,
) -> dict[str, LLMEngine]:
    """One engine per option. Every option's config is checked before the first engine is built, so a
    bad option fails in seconds; an engine that refuses its config (a value only the engine checks) is
    an OptionError naming the option too."""
    configs = {name: option_config(base, name, overrides) for name, overrides in options.items()}
    engines: dict[str, LLMEngine] = {}
    for name, config in configs.items():
        try:
            engines[name] = make_engine(config)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise OptionError(f"option {name!r} {dict(options[name])}: {e}") from e
    return engines


# ---- data ------------------------------------------------------------------------------------------
def sample_conversations(
    tokenizer: ChatTokenizer,
    num: int,
    seed: int = 0,
    *,
    max_total_len: int = 1024,
    min_reply_len: int = 4,
    records: Sequence[dict] | None = None,
) -> list[Conversation]:
    """`num` ShareGPT conversations (shuffled with `seed`, as `datasets.sample_sharegpt` does) whose first
    turn is human and second gpt: the first as a chat prompt, the second's tokens as the reference reply,
    cut so prompt + reply fit `max_total_len`. Prompts that leave fewer than `min_reply_len` reply tokens
    are skipped, as are replies shorter than that."""
    if records is None:
        records = load_sharegpt_records()
    pairs = []
    for rec in records:
        turns = rec.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            if turns[0].get("value") and turns[1].get("value"):
                pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    convs: list[Conversation] = []
    for prompt, reply in pairs:
        if len(convs) == num:
            break
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text)
        room = max_total_len - len(prompt_ids)
        if room < min_reply_len:
            continue
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)[:room]
        if len(reply_ids) >= min_reply_len:
            convs.append(Conversation(prompt_ids, reply_ids))
    if len(convs) < num:
        logger.warning("only %d of %d ShareGPT conversations pass the length filters", len(convs), num)
    return convs


# ---- metrics (rows of log-probabilities, [rows, vocab]) ---------------------------------------------
def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in nats; tokens p gives no mass add nothing (0 log 0 = 0)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def top1_agreement(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per row, whether both distributions put their maximum on the same token."""
    return logp.argmax(-1) == logq.argmax(-1)


def token_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the negative log-probability of that row's target token."""
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp(mean NLL): the perplexity of all scored tokens together (token-weighted, not per reply)."""
    return math.exp(nll_sum / num_tokens) if num_tokens else float("nan")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (one ending before the other counts as a
    difference at its end); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# Context lengths (the scored row's position in its conversation) the KL is also broken down by: a
# quantized cache's error may grow with the number of cached tokens attended.
CONTEXT_BINS = (0, 128, 256, 512, 1024, 2048, 4096)


def bootstrap_ratio_ci(
    num: torch.Tensor, den: torch.Tensor, *, num_resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap interval of sum(num) / sum(den) over units resampled with replacement (here
    conversations: `num` a conversation's summed KL, `den` its positions). Positions of one conversation
    are not independent (one hard reply moves all of its rows), so the conversation is the unit; a
    paired difference of two options is the same call with num = kl_a - kl_b per conversation."""
    if num.numel() == 0:
        return float("nan"), float("nan")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(num.numel(), (num_resamples, num.numel()), generator=gen)
    ratios = num.double()[idx].sum(1) / den.double()[idx].sum(1).clamp_min(1e-300)
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return lo, hi


@dataclass(slots=True)
class TeacherForcedStats:
    """One option against the baseline over reply positions: sums, plus every position's KL, context
    position, conversation and top-1 agreement (on the host) for percentiles, the breakdown by context
    and the spread over conversations."""

    num_positions: int = 0
    num_top1_agree: int = 0
    nll_sum: float = 0.0  # the option's NLL of the reference tokens
    base_nll_sum: float = 0.0
    kl: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    conv_ids: list[torch.Tensor] = field(default_factory=list)
    agree: list[torch.Tensor] = field(default_factory=list)

    def add(
        self,
        base_logp: torch.Tensor,
        logp: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor,
        conv_ids: torch.Tensor,
    ) -> None:
        self.num_positions += int(targets.numel())
        self.positions.append(positions.cpu())
        self.conv_ids.append(conv_ids.cpu())
        for b, o, t in zip(base_logp.split(_ROW_SLICE), logp.split(_ROW_SLICE), targets.split(_ROW_SLICE)):
            self.kl.append(kl_divergence(b, o).double().cpu())
            agree = top1_agreement(b, o)
            self.agree.append(agree.cpu())
            self.num_top1_agree += int(agree.sum())
            self.nll_sum += float(token_nll(o, t).double().sum())
            self.base_nll_sum += float(token_nll(b, t).double().sum())

    def per_conversation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per conversation seen (in index order): its summed KL, its number of positions and of top-1
        agreements."""
        if not self.kl:
            return (torch.zeros(0, dtype=torch.float64),) * 3  # type: ignore[return-value]
        conv = torch.cat(self.conv_ids)
        ids, inverse = conv.unique(return_inverse=True)
        kl_sum = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, torch.cat(self.kl))
        count = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, torch.ones(len(conv), dtype=torch.float64))
        agree = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, torch.cat(self.agree).double())
        return kl_sum, count, agree

    def summary(self) -> dict[str, object]:
        ppl = perplexity(self.nll_sum, self.num_positions)
        base_ppl = perplexity(self.base_nll_sum, self.num_positions)
        kl = torch.cat(self.kl) if self.kl else torch.zeros(1, dtype=torch.float64)
        pos = torch.cat(self.positions) if self.positions else torch.zeros(1, dtype=torch.int64)
        q = torch.quantile(kl, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
        bins = torch.bucketize(pos, torch.tensor(CONTEXT_BINS[1:]), right=True)
        by_context = {}
        for b in bins.unique().tolist():
            lo, hi = CONTEXT_BINS[b], CONTEXT_BINS[b + 1] if b + 1 < len(CONTEXT_BINS) else None
            by_context[f"{lo}-{hi - 1}" if hi else f"{lo}-"] = float(kl[bins == b].mean())
        kl_sum, count, agree = self.per_conversation()
        conv_kl = kl_sum / count.clamp_min(1)
        spread = (torch.quantile(conv_kl, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
                  if conv_kl.numel() else [float("nan")] * 3)
        n = max(1, self.num_positions)
        return {
            "positions": self.num_positions,
            "conversations": int(count.numel()),
            "mean_kl": float(kl.sum()) / n,
            "mean_kl_ci95": bootstrap_ratio_ci(kl_sum, count),  # over conversations
            "median_kl": q[0],
            "p99_kl": q[1],
            "p999_kl": q[2],
            "max_kl": float(kl.max()),
            "mean_kl_by_context": by_context,
            # each conversation's own mean KL: 10th, 50th and 90th percentile over conversations
            "conversation_mean_kl_p10_p50_p90": spread,
            "top1_agreement": self.num_top1_agree / n,
            "top1_agreement_ci95": bootstrap_ratio_ci(agree, count),
            "ppl": ppl,
            "base_ppl": base_ppl,
            "ppl_delta": ppl / base_ppl - 1.0,
        }


@dataclass(slots=True)
class GreedyStats:
    """Per prompt, the first index where the option's greedy tokens left the baseline's (None: never)."""

    first_divergence: list[int | None] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # of the baseline's continuation

    def add(self, base_tokens: Sequence[int], tokens: Sequence[int]) -> None:
        self.first_divergence.append(first_divergence(base_tokens, tokens))
        self.lengths.append(len(base_tokens))

    def summary(self) -> dict[str, float | int | None]:
        """Mean and median over all prompts, an identical pair counting as its length (so both are lower
        bounds, censored at max_tokens), the same over the pairs that diverged, and the share identical."""
        censored = [n if d is None else d for d, n in zip(self.first_divergence, self.lengths)]
        diverged = [d for d in self.first_divergence if d is not None]
        return {
            "prompts": len(censored),
            "share_identical": (len(censored) - len(diverged)) / len(censored) if censored else float("nan"),
            "mean_first_divergence": statistics.fmean(censored) if censored else None,
            "median_first_divergence": statistics.median(censored) if censored else None,
            "mean_first_divergence_diverged": statistics.fmean(diverged) if diverged else None,
            "median_first_divergence_diverged": statistics.median(diverged) if diverged else None,
        }


# ---- teacher-forced scoring ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Piece:
    """One conversation's share of a scoring step."""

    index: int  # which conversation
    start: int  # position of its first token in the conversation's stream
    num_tokens: int
    num_scored: int  # its last num_scored tokens predict reply tokens (0: the prompt's prefill)
    last: bool  # the conversation's final piece: its blocks are freed after the step

    def first_reply_index(self, conv: Conversation) -> int:
        """The reply token its first scored row predicts."""
        return self.start + self.num_tokens - self.num_scored - (len(conv.prompt_ids) - 1)


# Scored rows per step by default: each engine's step is a [rows, vocab] float32 block (Qwen's 151,936
# tokens: 0.6 GB per thousand rows), held for the baseline and one option at a time.
MAX_SCORED_ROWS = 2048


def plan_steps(
    convs: Sequence[Conversation], chunk: int, max_batch: int, max_rows: int = MAX_SCORED_ROWS
) -> list[list[Piece]]:
    """The scoring steps, from lengths only (so every engine runs the same ones). Up to `max_batch`
    conversations run at once, a new one admitted as soon as one finishes; each runs its prompt but the
    last token in one unscored piece, then `chunk` scored tokens per step (the first is the prompt's last
    token, whose row predicts the first reply token). A step scores at most `max_rows` tokens: once they
    are spent the step's later conversations run shorter pieces or sit it out (the logits a step returns
    are rows x vocab float32, so this bounds memory whatever the chunk)."""
    if chunk < 1 or max_batch < 1 or max_rows < 1:
        raise ValueError("chunk, max_batch and max_rows must be >= 1")
    pending = deque(range(len(convs)))
    active: dict[int, int] = {}  # conversation -> next stream position to run
    steps: list[list[Piece]] = []
    while pending or active:
        while pending and len(active) < max_batch:
            active[pending.popleft()] = 0
        step = []
        rows_left = max_rows
        for i, start in list(active.items()):
            prefill_len = len(convs[i].prompt_ids) - 1
            total = prefill_len + len(convs[i].reply_ids)  # len(stream_ids)
            if start < prefill_len:
                n, scored = prefill_len - start, 0
            else:
                n = min(chunk, total - start, rows_left)
                if n == 0:
                    continue
                scored = n
                rows_left -= n
            last = start + n == total
            step.append(Piece(i, start, n, scored, last))
            if last:
                del active[i]
            else:
                active[i] = start + n
        steps.append(step)
    return steps


def teacher_forced_rows(
    engine: LLMEngine, convs: Sequence[Conversation], steps: Sequence[Sequence[Piece]]
) -> Iterator[torch.Tensor]:
    """Per step, the float32 log-softmax rows of its scored positions (pieces in step order, rows in
    position order), computed by the engine's runner through its paged cache. Block tables come from
    the engine's block manager and go back to it; the engine must be idle meanwhile."""
    if engine.has_unfinished_requests():
        raise RuntimeError("teacher-forced scoring needs an idle engine")
    bm = engine.block_manager
    params = SamplingParams(max_tokens=1)
    streams = [c.stream_ids for c in convs]
    reqs: dict[int, Request] = {}
    try:
        for step in steps:
            batch = []
            for p in step:
                stream = streams[p.index]
                req = reqs.get(p.index)
                if req is None:
                    req = reqs[p.index] = Request(f"accuracy-{p.index}", stream, params)
                    if not bm.allocate_slots(req, len(stream)):
                        raise RuntimeError(
                            f"the KV cache ({bm.num_blocks} blocks) cannot hold the scoring batch: "
                            f"lower the batch or raise the cache size"
                        )
                tokens = stream[p.start : p.start + p.num_tokens]
                batch.append(BatchRequest(req.req_id, tokens, p.start, list(req.block_ids), False, 0, params))
            logits = engine.runner.logits_for(batch, [p.num_scored for p in step])
            rows = torch.cat(logits) if len(logits) != 1 else logits[0]
            del logits  # a suspended generator keeps its locals: it must not hold a second copy
            yield _log_softmax_(rows)
            del rows
            for p in step:
                if p.last:
                    bm.free(reqs.pop(p.index))
    finally:
        for req in reqs.values():
            bm.free(req)


# Rows normalised / compared at a time: bounds the [rows, vocab] float32 temporaries.
_ROW_SLICE = 256


def _log_softmax_(rows: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, in place, a slice of rows at a time (no second rows x vocab copy).
    Under inference mode: the runner's logits are inference tensors, which only it may update in place."""
    with torch.inference_mode():
        for s in rows.split(_ROW_SLICE):
            s.sub_(torch.logsumexp(s, dim=-1, keepdim=True))
    return rows


def step_targets(
    convs: Sequence[Conversation], step: Sequence[Piece]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference tokens the step's scored rows predict, each row's position in its stream (the
    tokens before it) and its conversation, in the order of `teacher_forced_rows`."""
    targets: list[int] = []
    positions: list[int] = []
    conv_ids: list[int] = []
    for p in step:
        if p.num_scored:
            first = p.first_reply_index(convs[p.index])
            targets.extend(convs[p.index].reply_ids[first : first + p.num_scored])
            positions.extend(range(p.start + p.num_tokens - p.num_scored, p.start + p.num_tokens))
            conv_ids.extend([p.index] * p.num_scored)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return as_tensor(targets), as_tensor(positions), as_tensor(conv_ids)


def score_teacher_forced(
    engines: Mapping[str, LLMEngine],
    baseline: str,
    convs: Sequence[Conversation],
    chunk: int = 16,
    max_batch: int = 8,
    progress: Callable[[int], None] | None = None,
    max_rows: int = MAX_SCORED_ROWS,
) -> dict[str, TeacherForcedStats]:
    """Every option (engines but the baseline) against the baseline, over all reply positions. The
    engines run the same steps in lockstep, and only the baseline's rows and one option's are alive at a
    time; `progress(n)` is called after each step with its count."""
    steps = plan_steps(convs, chunk, max_batch, max_rows)
    streams = {name: teacher_forced_rows(engine, convs, steps) for name, engine in engines.items()}
    stats = {name: TeacherForcedStats() for name in engines if name != baseline}
    for step in steps:
        base_rows = next(streams[baseline])
        targets, positions, conv_ids = step_targets(convs, step)
        targets = targets.to(base_rows.device)
        for name, s in stats.items():
            rows = next(streams[name])
            if targets.numel():
                s.add(base_rows, rows.to(base_rows.device), targets, positions, conv_ids)
            del rows
        del base_rows
        if progress is not None:
            progress(1)
    return stats


# ---- greedy continuations --------------------------------------------------------------------------
def greedy_tokens(engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt continued greedily (stopping at EOS or `max_tokens`) through `LLM.generate`."""
    # What LLM.from_config does, over an engine built here (the tests build theirs from in-memory weights).
    llm = LLM.__new__(LLM)
    llm.engine = engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def score_greedy(
    engines: Mapping[str, LLMEngine], baseline: str, prompts: Sequence[Sequence[int]], max_tokens: int = 128
) -> dict[str, GreedyStats]:
    base = greedy_tokens(engines[baseline], prompts, max_tokens)
    stats: dict[str, GreedyStats] = {}
    for name, engine in engines.items():
        if name == baseline:
            continue
        s = stats[name] = GreedyStats()
        for b, t in zip(base, greedy_tokens(engine, prompts, max_tokens)):
            s.add(b, t)
    return stats


# ---- report ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class OptionResult:
    name: str
    overrides: dict[str, object]
    teacher_forced: dict[str, object]
    greedy: dict[str, float | int | None] | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def evaluate(
    engines: Mapping[str, LLMEngine],
    baseline: str,
    convs: Sequence[Conversation],
    options: Mapping[str, Mapping[str, object]],
    *,
    chunk: int = 16,
    max_batch: int = 8,
    max_tokens: int = 128,
    progress: Callable[[int], None] | None = None,
    max_rows: int = MAX_SCORED_ROWS,
    greedy_prompts: int | None = None,
) -> list[OptionResult]:
    """Teacher-forced and (with `max_tokens` > 0) greedy figures for every option but the baseline; the
    greedy part runs on the first `greedy_prompts` conversations (None: all)."""
    tf = score_teacher_forced(engines, baseline, convs, chunk, max_batch, progress, max_rows)
    greedy = {}
    if max_tokens > 0:
        prompts = [c.prompt_ids for c in convs[:greedy_prompts]]
        greedy = score_greedy(engines, baseline, prompts, max_tokens)
    return [
        OptionResult(name, dict(options.get(name, {})), tf[name].summary(),
                     greedy[name].summary() if name in greedy else None)
        for name in engines
        if name != baseline
    ]


def format_table(baseline: str, results: Sequence[OptionResult]) -> str:
    """One line per option: the teacher-forced figures against the baseline, then the greedy ones."""
    head = (f"{'option':<12} {'mean KL':>10} {'95% CI':>19} {'p99 KL':>9} {'max KL':>9} {'top-1':>7} {'ppl':>8} "
            f"{'ppl ' + baseline:>9} {'ppl delta':>9} {'identical':>9} {'1st div mean':>12} {'median':>7}")
    lines = [head]
    for r in results:
        t, g = r.teacher_forced, r.greedy or {}
        mean, median = g.get("mean_first_divergence"), g.get("median_first_divergence")
        lines.append(
            f"{r.name:<12} {t['mean_kl']:>10.2e} {_ci(t['mean_kl_ci95']):>19} {t['p99_kl']:>9.2e} {t['max_kl']:>9.2e} "
            f"{t['top1_agreement']:>7.2%} {t['ppl']:>8.3f} {t['base_ppl']:>9.3f} {t['ppl_delta']:>+9.2%} "
            f"{_fmt(g.get('share_identical'), '.0%'):>9} {_fmt(mean, '.1f'):>12} {_fmt(median, '.1f'):>7}"
        )
    for r in results:
        if r.teacher_forced["mean_kl"] == 0.0 and r.teacher_forced["max_kl"] == 0.0:
            lines.append(f"note: {r.name} is bit-identical to {baseline}: does this build use {r.overrides}?")
    return "\n".join(lines)


def _ci(ci: object) -> str:
    lo, hi = ci  # type: ignore[misc]
    return f"[{lo:.2e}, {hi:.2e}]"


def _fmt(x: object, spec: str) -> str:
    return "-" if x is None else format(x, spec)
