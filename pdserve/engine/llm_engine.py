"""LLMEngine: builds the model, the KV cache, the scheduler and the runner from an `EngineConfig`, and
runs them with the torch-free `EngineLoop` (schedule -> executor.execute -> update_from_output), whose
executor is the `ModelRunner`.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.attention.base import AttentionBackend, get_attention_backend
from pdserve.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, default_block_size
from pdserve.transfer.connector import KVConnector
from pdserve.engine.loop import EngineLoop, StepRecord
from pdserve.kv.block_manager import BlockManager, HostBlockPool
from pdserve.kv.cache import KVCache, KVLayout
from pdserve.kv.quant import QUANT_DTYPES
from pdserve.model.key_scales import KeyScales, calibrate, calibration_ids
from pdserve.model.llama import LlamaModel
from pdserve.runner.model_runner import ModelRunner
from pdserve.scheduler import Scheduler, make_policy
from pdserve.spec import SpecDecodeStats, SpeculativeExecutor
from pdserve.spec.draft import DraftModelProposer, check_same_vocab
from pdserve.spec.length import RowCurve
from pdserve.transfer.base import KVTransport
from pdserve.transfer.registry import transport_class

__all__ = ["LLMEngine", "StepRecord", "make_attention", "resolve_device", "resolve_dtype"]

logger = logging.getLogger(__name__)


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


def make_attention(name: str, dtype: torch.dtype, device: torch.device, kv_dtype: str) -> AttentionBackend:
    """The attention backend `name` ("auto": the fastest that works here) for a model in `dtype` over a
    cache stored as `kv_dtype`; the torch reference, with a WARNING, where the chosen one cannot read it."""
    attn = _pick_attention(name, dtype, device)
    if not attn.supports_kv_dtype(kv_dtype):
        logger.warning(
            "attention %s cannot read a KV cache stored as %s; using the torch reference backend instead",
            attn.name, kv_dtype,
        )
        attn = get_attention_backend("torch")
    return attn


def int4_residual_slots(sc: SchedulerConfig, block_size: int, spec: SpeculativeConfig | None) -> int:
    """How many blocks an int4 cache can have open at once: each live request's last, partly filled
    block, plus the blocks one step writes (a step's tokens fill at most ceil(tokens / block_size) of
    them, and each request's chunk may straddle one more boundary), plus the blocks draft tokens reach
    before they are accepted, plus a few."""
    drafts = -(-spec.num_speculative_tokens // block_size) if spec is not None else 0
    return sc.max_num_seqs * (2 + drafts) + -(-sc.max_num_batched_tokens // block_size) + 4


def _pick_attention(name: str, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    if name != "auto":
        return get_attention_backend(name)
    if dtype == torch.float32:
        return get_attention_backend("torch")  # the reference: what the fp32 correctness tests use
    if device.type == "cpu":
        try:
            return get_attention_backend("cpu-paged")
        except Exception as e:  # no compiler, or it failed: the compiled torch backend still works
            logger.warning("C++ paged decode kernel unavailable (%s); using torch-compiled", e)
    return get_attention_backend("torch-compiled")


class LLMEngine(EngineLoop):
    def __init__(
        self,
        config: EngineConfig,
        *,
        model_config: ModelConfig | None = None,
        weights: dict[str, torch.Tensor] | None = None,
        tokenizer: object | None = None,
        kv_transport: KVTransport | None = None,
        draft_model_config: ModelConfig | None = None,
        draft_weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Load the model named by `config.model`, or use `model_config` + `weights` (tests) with an
        optional tokenizer (without one, prompts must be token ids and outputs carry no text).
        `kv_transport`: a ready transport (inproc tests); otherwise `config.kv_transfer.backend` makes one.
        `draft_model_config` + `draft_weights`: the "draft" method's model in memory (tests), instead of
        loading `config.speculative.model`."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        loaded = weights is None
        if loaded:
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
        quantized = self._check_weight_dtype(config.weight_dtype)
        cc = config.cache
        self.key_scales: KeyScales | None = None  # set by _build_model where the keys are scaled
        self.model = self._build_model(model_config, weights, quantized, consume=loaded, kv_cache_dtype=cc.kv_cache_dtype)
        del weights

        sc = config.scheduler
        self.max_model_len = min(sc.max_model_len, model_config.max_position_embeddings)
        # kv/cache.py owns the layout; a quantized dtype's blocks are smaller (scales included), so the
        # same memory holds more of them.
        self.block_size = cc.block_size or default_block_size(self.device.type, cc.kv_cache_dtype)
        digest = self.key_scales.digest() if self.key_scales is not None else ""
        self.kv_layout = KVLayout.for_model(model_config, self.block_size, cc.kv_cache_dtype, self.dtype, digest)
        block_bytes = self.kv_layout.block_bytes
        budget = int(cc.kv_cache_memory_gb * (1 << 30))
        num_residual_slots = 0
        if self.kv_layout.is_int4:  # open blocks live unquantized in a pool paid for from the same budget
            num_residual_slots = int4_residual_slots(sc, self.block_size, config.speculative)
            budget -= num_residual_slots * self.kv_layout.residual_slot_bytes
        num_blocks = cc.num_blocks or max(1, budget // block_bytes)
        # A sequence can never outgrow the whole KV cache (it would preempt itself forever): cap it there.
        self.max_model_len = min(self.max_model_len, num_blocks * self.block_size)
        num_host_blocks = 0
        if sc.preemption_mode == "swap":
            num_host_blocks = int(cc.swap_space_gb * (1 << 30)) // block_bytes
            if num_host_blocks < 1:
                raise ValueError('preemption_mode "swap" needs swap_space_gb large enough for one KV block')
        self.kv_cache = KVCache(self.kv_layout, num_blocks, self.device, num_host_blocks, num_residual_slots)
        block_manager = BlockManager(num_blocks, self.block_size, cc.enable_prefix_caching)
        if self.kv_layout.is_int4:
            block_manager.on_free = self.kv_cache.note_freed
        host_pool = HostBlockPool(num_host_blocks) if num_host_blocks else None
        scheduler = Scheduler(sc, block_manager, make_policy(sc.policy, sc), host_pool)
        attn = self._make_attention(config.attention_backend, self.kv_layout.kv_dtype)
        attn.warmup(self.kv_cache.layers[0], model_config.num_heads)
        if config.attention_backend == "auto" and hasattr(attn, "autotune"):  # cpu-paged: kernels per phase
            attn.autotune(self.kv_cache.layers[0], model_config.num_heads, self.dtype,
                          batch_invariant=config.batch_invariant, cache_dir=config.autotune_dir)
        self.runner = ModelRunner(self.model, self.kv_cache, attn, self.device, config.seed)
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", ()))
        super().__init__(
            scheduler,
            self.runner,
            vocab_size=model_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=frozenset(eos),
            tokenizer=tokenizer,
            connector=self._make_connector(kv_transport),
            role=config.kv_transfer.role,
        )
        self.spec_executor: SpeculativeExecutor | None = None
        if config.speculative is not None:
            # The runner verifies the drafts a step carries; the wrapper proposes the next ones.
            proposer, cost, draft_curve = None, 0.0, None
            if config.speculative.method == "draft":
                proposer = self._make_draft_proposer(config.speculative, draft_model_config, draft_weights)
                cost = proposer.cost
                draft_curve = _row_curve(proposer.runner.model)
            # The slack length rule reads the `slo` policy's step-time model and ITL target; the cost rule
            # (any other policy) the models' measured kernel tables.
            itl = sc.slo_itl_ms / 1e3 if sc.policy == "slo" else None
            target_curve = _row_curve(self.model)
            if proposer is not None and draft_curve is None:
                target_curve = None  # a draft model without its price: the fixed caps
            self.spec_executor = SpeculativeExecutor(
                self.executor, config.speculative, proposer, cost,
                step_model=scheduler.step_model, itl_target=itl, clock=scheduler.clock,
                target_curve=target_curve, draft_curve=draft_curve,
            )
            logger.info("speculation length rule: %s", self.spec_executor.length_rule)
            self.executor = self.spec_executor
        logger.info(
            "engine ready in %.1fs: %s, %s on %s, KV cache %s: %d blocks x %d tokens (%d bytes, %.2f GiB), "
            "%d host blocks, policy %s, preemption %s, attention %s",
            time.perf_counter() - t0, self.model_name, self.dtype, self.device, self.kv_layout.kv_dtype,
            num_blocks, self.block_size, self.kv_cache.nbytes, self.kv_cache.nbytes / (1 << 30), num_host_blocks,
            sc.policy, sc.preemption_mode, attn.name,
        )

    def _make_draft_proposer(
        self,
        spec: SpeculativeConfig,
        draft_config: ModelConfig | None,
        weights: dict[str, torch.Tensor] | None,
    ) -> DraftModelProposer:
        """The draft model on the target's device and dtype (bf16 CPU kernels as the target's), over its
        own KV cache of `spec.draft_kv_cache_memory_gb` in the model's dtype."""
        tokenizer = None
        loaded = weights is None
        if loaded:
            from pdserve.model.loader import load_weights, resolve_model_path
            from pdserve.model.tokenizer import load_tokenizer

            path = resolve_model_path(spec.model)
            draft_config, weights = load_weights(path, torch.float32)
            tokenizer = load_tokenizer(path)
        assert draft_config is not None, "draft weights need their model_config"
        check_same_vocab(self.model_config, draft_config, self.tokenizer, tokenizer)
        model = self._build_model(draft_config, weights, quantized=None, consume=loaded)
        del weights
        cfg = self.config
        layout = KVLayout.for_model(draft_config, self.block_size, "auto", self.dtype)
        num_blocks = max(1, int(spec.draft_kv_cache_memory_gb * (1 << 30)) // layout.block_bytes)
        kv_cache = KVCache(layout, num_blocks, self.device)
        attn = self._make_attention(cfg.attention_backend, layout.kv_dtype)
        runner = ModelRunner(model, kv_cache, attn, self.device, cfg.seed)
        cost = spec.draft_cost
        if cost is None:  # decode is memory-bound: a step's time goes with the weight bytes it streams
            cost = min(0.99, model.num_params / max(1, self.model.num_params))
        max_len = min(self.max_model_len, draft_config.max_position_embeddings, num_blocks * layout.block_size)
        logger.info("draft model: %d layers, %d KV blocks, a step costs %.2f target steps",
                    draft_config.num_layers, num_blocks, cost)
        return DraftModelProposer(runner, num_blocks, max_len, cost)

    def _build_model(
        self, model_config: ModelConfig, weights: dict[str, torch.Tensor], quantized: str | None,
        consume: bool = False, kv_cache_dtype: str = "auto",
    ) -> LlamaModel:
        """The model on this engine's device and dtype, with the CPU kernels chosen (the target and the
        draft model alike): int8 projections when asked (`quantized` "int8" or "w8a8"), packed linears,
        fused or plain elementwise ops. `consume`: `weights` is the loader's own dict, emptied as copied.
        `kv_cache_dtype`: the cache it writes; an int8 or fp8 one gets its key channels scaled first
        (`config.cache.kv_key_scaling`; `self.key_scales` says how)."""
        config = self.config
        model = LlamaModel(model_config)
        model.load_hf_weights(weights, consume=consume)
        scaling = config.cache.kv_key_scaling
        if kv_cache_dtype in QUANT_DTYPES and scaling != "off":
            t0 = time.perf_counter()
            ids = calibration_ids(self.tokenizer, model_config.vocab_size)
            self.key_scales = calibrate(model, ids, kv_cache_dtype, every_layer=scaling == "on")
            model.scale_key_channels(self.key_scales.powers)
            logger.info("%s (calibrated on %d tokens in %.1fs)", self.key_scales.describe(), ids.numel(),
                        time.perf_counter() - t0)
        if quantized is not None:
            model.quantize_linears(quantized)  # from the float32 weights, before the cast; frees the float copies
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.inv_freq = model.inv_freq.float()
        if model.prepack_for_cpu(config.linear_kernel, config.batch_invariant, config.autotune_dir):
            logger.info("%s", model.linear_plan.describe())
            wb = model.weight_bytes()
            logger.info("weights resident: %.1f MB (projections and head %.1f MB as packed, the rest %.1f MB)",
                        wb["total"] / 1e6, wb["linears"] / 1e6, wb["other"] / 1e6)
        if config.fused_cpu_ops:
            model.use_fused_cpu_ops(measure=True, batch_invariant=config.batch_invariant,
                                    cache_dir=config.autotune_dir)
        return model

    def _check_weight_dtype(self, weight_dtype: str) -> str | None:
        """"int8" or "w8a8" where the projections run from int8 weights (w8a8: their kernels may also
        quantize the activations), else None; a clear error where they cannot."""
        from pdserve.config import WEIGHT_DTYPES

        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight dtype {weight_dtype!r}; choose from {list(WEIGHT_DTYPES)}")
        if weight_dtype == "bfloat16" and self.dtype != torch.bfloat16:
            raise ValueError(f"weight dtype bfloat16 needs dtype bfloat16 (or auto), not {self.dtype}")
        if weight_dtype not in ("int8", "w8a8"):
            return None
        if self.device.type != "cpu":
            raise ValueError(f"{weight_dtype} weights run on the CPU only (device is {self.device})")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"{weight_dtype} weights need bf16 activations: dtype bfloat16 (or auto), not {self.dtype}")
        return weight_dtype

    @property
    def runner(self) -> ModelRunner:
        """The loop's executor: the model runner (replacing it replaces what runs every step)."""
        return self.executor  # type: ignore[return-value]

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters (None without speculation)."""
        return self.spec_executor.stats if self.spec_executor is not None else None

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self.executor = runner

    def _make_attention(self, name: str, kv_dtype: str) -> AttentionBackend:
        return make_attention(name, self.dtype, self.device, kv_dtype)

    def _make_connector(self, transport: KVTransport | None) -> KVConnector | None:
        kc = self.config.kv_transfer
        if transport is None and kc.backend is None:
            return None
        if transport is None:
            layout = self.kv_layout
            cls = transport_class(kc.backend)  # type: ignore[arg-type]
            if kc.backend == "tcp":
                transport = cls(layout, host=kc.host, port=kc.port)  # type: ignore[call-arg]
            elif kc.backend == "torch.distributed":
                transport = cls(layout, host=kc.host, port=kc.port, device=self.device)  # type: ignore[call-arg]
            elif kc.backend == "shm":
                transport = cls(layout, verify=kc.verify)  # type: ignore[call-arg]
            else:
                raise ValueError(f"the {kc.backend!r} KV backend needs a transport passed to the engine")
        logger.info("KV transfer: role %s, backend %s at %s", kc.role, transport.name, transport.address)
        return KVConnector(transport, self.kv_cache, kc.ack_timeout_s, kc.lease_s)


def _row_curve(model: LlamaModel) -> RowCurve | None:
    """The model's projections by row count, from the linear autotune's table (None: no table, e.g. a
    named --linear-kernel, or not on the CPU)."""
    plan = model.linear_plan
    if plan is None or plan.table is None:
        return None
    return RowCurve.from_table(plan.table.buckets, plan.table.chosen_seconds())
