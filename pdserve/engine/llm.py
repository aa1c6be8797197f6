"""The offline API, familiar to vLLM users: `LLM(...).generate(prompts, params)` / `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pdserve.config import field_default as _default  # defaults are written once, in config.py
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError, SLORejectedError
from pdserve.outputs import RequestOutput
from pdserve.request import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = _default(EngineConfig, "dtype"),
        device: str = _default(EngineConfig, "device"),
        *,
        scheduler: str = _default(SchedulerConfig, "policy"),
        max_num_batched_tokens: int = _default(SchedulerConfig, "max_num_batched_tokens"),
        max_num_seqs: int = _default(SchedulerConfig, "max_num_seqs"),
        max_model_len: int = _default(SchedulerConfig, "max_model_len"),
        chunk_size: int | None = None,
        preemption_mode: str = _default(SchedulerConfig, "preemption_mode"),
        swap_space_gb: float = _default(CacheConfig, "swap_space_gb"),
        block_size: int | None = _default(CacheConfig, "block_size"),
        kv_cache_memory_gb: float = _default(CacheConfig, "kv_cache_memory_gb"),
        kv_cache_dtype: str = _default(CacheConfig, "kv_cache_dtype"),
        kv_key_scaling: str = _default(CacheConfig, "kv_key_scaling"),
        num_blocks: int | None = None,
        enable_prefix_caching: bool = _default(CacheConfig, "enable_prefix_caching"),
        num_threads: int | None = None,
        attention_backend: str = _default(EngineConfig, "attention_backend"),
        fused_cpu_ops: bool = _default(EngineConfig, "fused_cpu_ops"),
        linear_kernel: str = _default(EngineConfig, "linear_kernel"),
        batch_invariant: bool = _default(EngineConfig, "batch_invariant"),
        kernel_cache_dir: str | None = None,
        weight_dtype: str = _default(EngineConfig, "weight_dtype"),
        seed: int = _default(EngineConfig, "seed"),
        speculative_config: dict[str, object] | SpeculativeConfig | None = None,
        model_config: ModelConfig | None = None,
        weights: dict | None = None,
        tokenizer: object | None = None,
        draft_model_config: ModelConfig | None = None,
        draft_weights: dict | None = None,
    ) -> None:
        """`model` is a .gguf file or a Hugging Face directory (None: the bundled SmolLM2-135M-Instruct).
        `model_config` + `weights` (+ `tokenizer`) build an engine from in-memory weights instead (tests).
        `kv_cache_dtype`: how K/V are stored ("auto" = the model's dtype; "int8", "fp8_e4m3" quantized;
            "int4": KIVI, docs/kv_quantization.md). `kv_key_scaling` (int8 / fp8): per-channel powers of
            two for the keys folded into the q/k projections, "auto" where a calibration shows they help,
            "on" every layer, "off" none (model/key_scales.py).
        `speculative_config`: speculative decoding in vLLM's convention (see `SpeculativeConfig`);
        `draft_model_config` + `draft_weights`: its "draft" method's model from memory (tests).
        `weight_dtype="int8"`: the projections and output head quantized per output channel (CPU, bf16
        activations; docs/architecture.md, "8-bit weights"); `"w8a8"`: the same weights, and kernels that
        may also quantize the activations per token where they measure faster."""
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            num_threads=num_threads,
            attention_backend=attention_backend,
            fused_cpu_ops=fused_cpu_ops,
            linear_kernel=linear_kernel,
            batch_invariant=batch_invariant,
            kernel_cache_dir=kernel_cache_dir,
            weight_dtype=weight_dtype,
            seed=seed,
            speculative=speculative_config,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory_gb=kv_cache_memory_gb,
                enable_prefix_caching=enable_prefix_caching,
                swap_space_gb=swap_space_gb,
                kv_cache_dtype=kv_cache_dtype,
                kv_key_scaling=kv_key_scaling,
            ),
            scheduler=SchedulerConfig(
                policy=scheduler,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                chunk_size=chunk_size,
                preemption_mode=preemption_mode,
            ),
        )
        self.engine = LLMEngine(config, model_config=model_config, weights=weights, tokenizer=tokenizer,
                                draft_model_config=draft_model_config, draft_weights=draft_weights)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an engine built from a complete `EngineConfig` (the CLI's path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`. A prompt is text
        or a list of token ids. Invalid prompts raise InvalidRequestError before anything runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p))
        except (InvalidRequestError, SLORejectedError):
            for req_id in ids:
                engine.abort_request(req_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (with `tools`, function
        definitions in OpenAI's shape, for templates that show them), then generate. The text is the
        model's; `pdserve.tools` parses tool calls out of it as the server does."""
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this engine has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            tok.apply_chat_template(list(c), add_generation_prompt=True, tools=tools)  # type: ignore[attr-defined]
            for c in convs
        ]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2, unit="req")
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for req_id in pending:
                engine.abort_request(req_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]
