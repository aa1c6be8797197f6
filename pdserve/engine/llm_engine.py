"""LLMEngine: one step is schedule -> execute -> update.

The engine owns the components and their wiring; every state change of a request happens in the
scheduler. Text concerns (detokenization, stop strings) live in `OutputProcessor` beside the loop.
Each step's shape and duration are recorded (`step_records`) for metrics and to calibrate the
simulator's cost model.

With a KV transport (disaggregation), each step first applies what the transport delivered (KV written
into reserved blocks, transfers acknowledged or expired), then reserves blocks for new remote-prefill
requests, and hands the forward a hook that sends each layer's fresh K/V of remote-decode requests.
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
from pdserve.transfer.connector import KVConnector, RemoteDecode, RemotePrefill
from pdserve.engine.output_processor import OutputProcessor
from pdserve.errors import InvalidRequestError
from pdserve.kv.block_manager import BlockManager, HostBlockPool
from pdserve.kv.cache import KVCache, kv_block_bytes
from pdserve.model.llama import LlamaModel
from pdserve.outputs import RequestOutput
from pdserve.request import FinishReason, Request, SamplingParams
from pdserve.runner.model_runner import ModelOutput, ModelRunner
from pdserve.scheduler import Scheduler, make_policy
from pdserve.scheduler.scheduler import SchedulerOutput
from pdserve.transfer.base import KVLayout, KVTransport, TransferError
from pdserve.transfer.registry import transport_class

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
        kv_transport: KVTransport | None = None,
    ) -> None:
        """Load the model named by `config.model`, or use `model_config` + `weights` (tests) with an
        optional tokenizer (without one, prompts must be token ids and outputs carry no text).
        `kv_transport`: a ready transport (inproc tests); otherwise `config.kv_transfer.backend` makes one."""
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
        self.model.prepack_for_cpu(config.linear_kernel)
        if config.fused_cpu_ops:
            self.model.use_fused_cpu_ops()
        del weights

        sc = config.scheduler
        self.max_model_len = min(sc.max_model_len, model_config.max_position_embeddings)
        cc = config.cache
        num_blocks = cc.num_blocks or max(
            1, int(cc.kv_cache_memory_gb * (1 << 30)) // kv_block_bytes(model_config, cc.block_size, self.dtype)
        )
        # A sequence can never outgrow the whole KV cache (it would preempt itself forever): cap it there.
        self.max_model_len = min(self.max_model_len, num_blocks * cc.block_size)
        num_host_blocks = 0
        if sc.preemption_mode == "swap":
            num_host_blocks = int(cc.swap_space_gb * (1 << 30)) // kv_block_bytes(model_config, cc.block_size, self.dtype)
            if num_host_blocks < 1:
                raise ValueError('preemption_mode "swap" needs swap_space_gb large enough for one KV block')
        self.kv_cache = KVCache(model_config, num_blocks, cc.block_size, self.dtype, self.device, num_host_blocks)
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        host_pool = HostBlockPool(num_host_blocks) if num_host_blocks else None
        self.scheduler = Scheduler(sc, self.block_manager, make_policy(sc.policy, sc), host_pool)
        attn = self._make_attention(config.attention_backend)
        attn.warmup(self.kv_cache.layers[0][0], model_config.num_heads)
        self.runner = ModelRunner(self.model, self.kv_cache, attn, self.device, config.seed)
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", ()))
        self.eos_token_ids = frozenset(eos)
        self.outputs = OutputProcessor(tokenizer)
        self.step_records: deque[StepRecord] = deque(maxlen=10_000)
        self.role = config.kv_transfer.role
        self.connector = self._make_connector(kv_transport)
        self.kv_reservations: list[tuple[str, int]] = []  # (req_id, tokens it holds already) since last taken
        self._remote_prefill: dict[str, RemotePrefill] = {}  # waiting for their blocks to be reserved
        self._ids = itertools.count()
        logger.info(
            "engine ready in %.1fs: %s, %s on %s, %d KV blocks x %d tokens (%.2f GiB), %d host blocks, "
            "policy %s, preemption %s, attention %s",
            time.perf_counter() - t0, self.model_name, self.dtype, self.device, num_blocks, cc.block_size,
            self.kv_cache.nbytes / (1 << 30), num_host_blocks, sc.policy, sc.preemption_mode, attn.name,
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

    def _make_connector(self, transport: KVTransport | None) -> KVConnector | None:
        kc = self.config.kv_transfer
        if transport is None and kc.backend is None:
            return None
        if transport is None:
            layout = KVLayout(
                self.model_config.num_layers, self.model_config.num_kv_heads, self.model_config.head_dim, self.dtype
            )
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

    def close(self) -> None:
        """Release the KV transport (sockets, shared buffers)."""
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        arrival_time: float | None = None,
        kv_transfer: RemoteDecode | RemotePrefill | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError and allocates nothing when it is bad.
        `kv_transfer`: compute only the prompt and first token here and send the KV (RemoteDecode), or
        receive them from a prefill instance and decode here (RemotePrefill)."""
        params = params or SamplingParams()
        params.validate()
        self._check_transfer(kv_transfer)
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
        self.scheduler.check_admission(req)  # SLORejectedError under `slo` with `slo_reject`
        if isinstance(kv_transfer, RemoteDecode):
            req.remote_decode = True
            assert self.connector is not None
            try:
                self.connector.start_send(req, kv_transfer)
            except TransferError as e:
                raise InvalidRequestError(f"cannot send this request's KV: {e}") from None
        elif isinstance(kv_transfer, RemotePrefill):
            req.remote_prefill = True
            self._remote_prefill[req.req_id] = kv_transfer
        self.outputs.add(req, prompt_text)
        self.scheduler.add_request(req)
        return req_id

    def _check_transfer(self, kv_transfer: RemoteDecode | RemotePrefill | None) -> None:
        if kv_transfer is None:
            return
        if self.connector is None:
            raise InvalidRequestError("this instance has no KV transfer backend (start it with one)")
        if isinstance(kv_transfer, RemoteDecode) and self.role == "decode":
            raise InvalidRequestError("a decode instance does not run prompts for other instances")
        if isinstance(kv_transfer, RemotePrefill) and self.role == "prefill":
            raise InvalidRequestError("a prefill instance does not decode prompts computed elsewhere")

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
        self._release(req_id)
        return self.outputs.finish(req)

    def _release(self, req_id: str) -> None:
        self.runner.release(req_id)
        self._remote_prefill.pop(req_id, None)
        if self.connector is not None:
            self.connector.cancel(req_id)

    def take_kv_reservations(self) -> list[tuple[str, int]]:
        """Remote-prefill requests whose blocks were reserved since the last call, with the number of
        prompt tokens this instance already holds (the prefill side skips sending those)."""
        taken, self.kv_reservations = self.kv_reservations, []
        return taken

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        transferred = self._poll_transfers() if self.connector is not None else []
        sched = self.scheduler.schedule()
        self.kv_cache.swap(sched.swap_in, sched.swap_out)
        if sched.is_empty:
            return transferred
        sampling = [s.req for s in sched.scheduled if s.samples]
        hook = None
        if self.connector is not None:
            hook = self.connector.layer_hook([(s.req, s.num_new_tokens) for s in sched.scheduled])
        replayed = False
        try:
            out = self.runner.execute(sched, hook)
        except Exception as e:  # a failed step fails the requests that cause it, never the engine
            if hook is not None or len(sched.scheduled) == 1:  # (a KV send cannot be replayed per request)
                logger.exception("step failed; finishing its %d requests with an error", len(sched.scheduled))
                return transferred + self._fail([s.req for s in sched.scheduled], f"engine step failed: {e}")
            logger.exception("step of %d requests failed; running them one at a time", len(sched.scheduled))
            out, failed = self._execute_one_by_one(sched)
            replayed = True
            for req, error in failed:
                transferred += self._fail([req], f"engine step failed: {error}")
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
        if self.connector is not None:
            lost = [r for r in updated if r.remote_decode and not self.connector.finish_send(r)]
            if lost:  # their transfer failed during this step
                lost_ids = {id(r) for r in lost}
                updated = [r for r in updated if id(r) not in lost_ids]
                transferred += self._fail(lost, "the KV transfer to the decode instance failed")
        results = self.outputs.process(updated, self.scheduler)
        for r in results:
            if r.finished:
                self._release(r.request_id)
        results = transferred + results
        if replayed:  # its duration is no step's: keep it out of the records and the step-time model
            return results
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
        rec = self.step_records[-1]  # what the `slo` policy's step-time model learns from
        self.scheduler.observe_step(
            rec.duration, rec.num_prefill_tokens, rec.num_decode_tokens, rec.num_context_tokens
        )
        return results

    def _execute_one_by_one(self, sched: SchedulerOutput) -> tuple[ModelOutput, list[tuple[Request, str]]]:
        """Run each request of a failed step alone, so that only those that fail again are failed (with
        `chunked`, running decodes share every prompt's step). Nothing of the failed step was applied:
        counters only move in `update_from_output`, and K/V slots it wrote are rewritten. Returns the
        step's output in scheduler order (a placeholder token for each failed sampling request, which
        `update_from_output` skips once the request is finished) and the failures."""
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        failed: list[tuple[Request, str]] = []
        forward_time = 0.0
        for s in sched.scheduled:
            try:
                one = self.runner.execute(SchedulerOutput(scheduled=[s], num_batched_tokens=s.num_new_tokens))
            except Exception as e:
                logger.exception("request %s fails on its own", s.req.req_id)
                failed.append((s.req, str(e)))
                if s.samples:
                    tokens.append(0)
                    logprobs.append(None)
                continue
            forward_time += one.forward_time
            tokens += one.token_ids
            logprobs += one.logprobs
        return ModelOutput(tokens, logprobs, forward_time), failed

    def _fail(self, reqs: list[Request], message: str) -> list[RequestOutput]:
        results = []
        for req in reqs:
            self.scheduler.finish_request(req.req_id, FinishReason.ERROR)
            req.error = message
            self._release(req.req_id)
            results.append(self.outputs.finish(req))
        return results

    def _poll_transfers(self) -> list[RequestOutput]:
        """Apply the transport's news: finished sends free their blocks, complete receives start decoding,
        failures fail their request; then reserve blocks for new remote-prefill requests."""
        connector = self.connector
        assert connector is not None
        ev = connector.poll()
        results: list[RequestOutput] = []
        for req, ok, error in ev.sent:
            if self.scheduler.finish_sending(req.req_id, None if ok else error) is not None:
                results.append(self.outputs.finish(req))
            elif not ok and not req.is_finished:  # failed while its prompt was still being computed
                results.extend(self._fail([req], error or "the KV transfer failed"))
        for req, error in ev.failed_receives:
            results.extend(self._fail([req], error))
        now = time.monotonic()
        received = []
        for req, done in ev.received:
            if self.scheduler.kv_received(req.req_id, done.first_token) is None:
                continue
            req.first_token_time = now
            if req.params.logprobs is not None and done.logprobs is not None:
                req.logprobs = [done.logprobs]
            self.runner.skip_draws(req, 1)
            received.append(req)
        results.extend(self.outputs.process(received, self.scheduler))
        for req in self.scheduler.reserve():
            spec = self._remote_prefill.pop(req.req_id)
            try:
                connector.start_receive(req, spec)
            except (TransferError, OSError) as e:
                results.extend(self._fail([req], f"cannot receive this request's KV: {e}"))
                continue
            self.kv_reservations.append((req.req_id, req.num_computed_tokens))
        for r in results:
            if r.finished:
                self._release(r.request_id)
        return results
