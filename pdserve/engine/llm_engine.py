"""LLMEngine: one step is schedule -> execute -> update.

The engine owns the components and their wiring; every state change of a request happens in the
scheduler. Text concerns (detokenization, stop strings) live in `OutputProcessor` beside the loop.
Each step's shape and duration are recorded (`step_records`) for metrics and to calibrate the
simulator's cost model.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend, get_attention_backend
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.output_processor import OutputProcessor
from pdserve.errors import InvalidRequestError
from pdserve.kv.block_manager import BlockManager
from pdserve.kv.cache import KVCache, kv_block_bytes
from pdserve.model.llama import LlamaModel
from pdserve.outputs import RequestOutput
from pdserve.request import FinishReason, Request, SamplingParams
from pdserve.runner.model_runner import ModelRunner
from pdserve.scheduler import Scheduler, make_policy

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepRecord:
    start: float  # time.monotonic
    duration: float  # seconds, whole step
    forward_time: float  # seconds in model + sampler
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_context_tokens: int  # sum of context lengths of the requests in the step


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    # bf16 is 3-4x faster than fp32 for batched GEMMs on CPUs with AVX-512 BF16 / AMX and on GPUs;
    # fp32 stays the reference for correctness tests.
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(table)}")
    return table[dtype]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_config: ModelConfig | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        tokenizer: object | None = None,
    ) -> None:
        """Load the model named by `config.model`, or use `model_config` + `weights` (tests) with an
        optional tokenizer (without one, prompts must be token ids and outputs carry no text)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        if weights is None:
            from pdserve.model.loader import load_weights, resolve_model_path
            from pdserve.model.tokenizer import load_tokenizer

            path = resolve_model_path(config.model)
            model_config, weights = load_weights(path, torch.float32)
            tokenizer = load_tokenizer(path)
            self.model_name = path
        else:
            assert model_config is not None, "weights need their model_config"
            self.model_name = "random"
        self.model_config: ModelConfig = model_config
        self.tokenizer = tokenizer
        model = LlamaModel(model_config)
        model.load_hf_weights(weights)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.inv_freq = self.model.inv_freq.float()
        self.model.prepack_for_cpu()
        del weights

        sc = config.scheduler
        self.max_model_len = min(sc.max_model_len, model_config.max_position_embeddings)
        cc = config.cache
        num_blocks = cc.num_blocks or max(
            1, int(cc.kv_cache_memory_gb * (1 << 30)) // kv_block_bytes(model_config, cc.block_size, self.dtype)
        )
        # A sequence can never outgrow the whole KV cache (it would preempt itself forever): cap it there.
        self.max_model_len = min(self.max_model_len, num_blocks * cc.block_size)
        self.kv_cache = KVCache(model_config, num_blocks, cc.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(sc, self.block_manager, make_policy(sc.policy, sc))
        attn = self._make_attention(config.attention_backend)
        attn.warmup(self.kv_cache.layers[0][0], model_config.num_heads)
        self.runner = ModelRunner(self.model, self.kv_cache, attn, self.device, config.seed)
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", ()))
        self.eos_token_ids = frozenset(eos)
        self.outputs = OutputProcessor(tokenizer)
        self.step_records: deque[StepRecord] = deque(maxlen=10_000)
        self._ids = itertools.count()
        logger.info(
            "engine ready in %.1fs: %s, %s on %s, %d KV blocks x %d tokens (%.2f GiB), policy %s, attention %s",
            time.perf_counter() - t0, self.model_name, self.dtype, self.device, num_blocks, cc.block_size,
            self.kv_cache.nbytes / (1 << 30), sc.policy, attn.name,
        )

    def _make_attention(self, name: str) -> AttentionBackend:
        if name != "auto":
            return get_attention_backend(name)
        if self.dtype == torch.float32:
            return get_attention_backend("torch")  # the reference: what the fp32 correctness tests use
        if self.device.type == "cpu":
            try:
                return get_attention_backend("cpu-paged")
            except Exception as e:  # no compiler, or it failed: the compiled torch backend still works
                logger.warning("C++ paged decode kernel unavailable (%s); using torch-compiled", e)
        return get_attention_backend("torch-compiled")

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError and allocates nothing when it is bad."""
        params = params or SamplingParams()
        params.validate()
        if req_id is None:
            req_id = f"req-{next(self._ids)}"
        if req_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        prompt_text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass prompt token ids")
            prompt_text = prompt
            token_ids = self.tokenizer.encode(prompt)  # type: ignore[attr-defined]
        else:
            token_ids = list(prompt)
        self.validate_prompt(token_ids)
        req = Request(
            req_id=req_id,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.outputs.add(req, prompt_text)
        self.scheduler.add_request(req)
        return req_id

    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but the context length is {self.max_model_len} "
                "(prompt plus at least one generated token must fit in the model's context and the KV cache)"
            )

    def abort_request(self, req_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(req_id, FinishReason.ABORT)
        if req is None:
            return None
        self.runner.release(req_id)
        return self.outputs.finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampling = [s.req for s in sched.scheduled if s.samples]
        try:
            out = self.runner.execute(sched)
        except Exception as e:  # a failed step fails its requests, never the engine
            logger.exception("step failed; finishing its %d requests with an error", len(sched.scheduled))
            return self._fail([s.req for s in sched.scheduled], f"engine step failed: {e}")
        for req, lp in zip(sampling, out.logprobs):
            if lp is not None:
                if req.logprobs is None:
                    req.logprobs = []
                req.logprobs.append(lp)
        now = time.monotonic()
        for req in sampling:
            if req.first_token_time is None:
                req.first_token_time = now
        updated = self.scheduler.update_from_output(sched, out.token_ids)
        results = self.outputs.process(updated, self.scheduler)
        for r in results:
            if r.finished:
                self.runner.release(r.request_id)
        self.step_records.append(
            StepRecord(
                start=start,
                duration=time.monotonic() - start,
                forward_time=out.forward_time,
                num_prefill_tokens=sched.num_prefill_tokens,
                num_decode_tokens=sched.num_decode_tokens,
                num_seqs=len(sched.scheduled),
                num_context_tokens=sum(s.req.num_computed_tokens for s in sched.scheduled),
            )
        )
        return results

    def _fail(self, reqs: list[Request], message: str) -> list[RequestOutput]:
        results = []
        for req in reqs:
            self.scheduler.finish_request(req.req_id, FinishReason.ERROR)
            req.error = message
            self.runner.release(req.req_id)
            results.append(self.outputs.finish(req))
        return results
