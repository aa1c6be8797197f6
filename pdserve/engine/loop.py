"""The engine loop: one step is schedule -> executor.execute -> update_from_output. Torch-free.

`EngineLoop` owns the requests' way through the engine: validation, the step, aborts and failures, the
KV-transfer events of disaggregation, and the per-step records. What runs a step is an `Executor`
(`pdserve.engine.executor`): the model runner in `LLMEngine`, which builds one, or a fake executor in
tests and the simulator, which drive this same loop without torch. Every state change of a request
happens in the scheduler; text concerns (detokenization, stop strings) live in `OutputProcessor`. Each
step's shape and duration are recorded (`step_records`) for metrics and to calibrate the simulator's
cost model; time is read from `clock` (the scheduler's, so every time stamp shares one clock).

With a KV connector (disaggregation), each step first applies what the transport delivered (KV written
into reserved blocks, transfers acknowledged or expired; a speculating executor, a `Drafter`, proposes
the first drafts of requests whose KV arrived), then reserves blocks for new remote-prefill requests,
and hands the executor a hook that sends each layer's fresh K/V of remote-decode requests.
The connector's module imports torch; it is imported here only when a transfer is asked for.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.batch import ModelOutput
from pdserve.engine.executor import Drafter, Executor
from pdserve.engine.output_processor import OutputProcessor
from pdserve.errors import InvalidRequestError
from pdserve.outputs import RequestOutput
from pdserve.request import FinishReason, Request, SamplingParams
from pdserve.scheduler.scheduler import Scheduler, SchedulerOutput
from pdserve.structured import GrammarCompiler

if TYPE_CHECKING:
    from pdserve.transfer.connector import KVConnector
    from pdserve.transfer.types import RemoteDecode, RemotePrefill

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepRecord:
    start: float  # the loop's clock (time.monotonic in an engine)
    duration: float  # seconds, whole step
    forward_time: float  # seconds in model + sampler
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_context_tokens: int  # sum over the step's requests of their computed tokens once it ran (its own included)


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        tokenizer: object | None = None,
        connector: KVConnector | None = None,
        role: str = "both",
    ) -> None:
        """`max_model_len`: the longest sequence (prompt plus output) a request may reach. Without a
        `tokenizer`, prompts must be token ids and outputs carry no text. `connector`: the KV transfers
        of a disaggregated instance whose `role` is "prefill", "decode" or "both"."""
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.executor = executor
        self.clock = scheduler.clock
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.connector = connector
        self.role = role
        self.outputs = OutputProcessor(tokenizer)
        self.grammars = GrammarCompiler.for_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.step_records: deque[StepRecord] = deque(maxlen=10_000)
        self.kv_reservations: list[tuple[str, int]] = []  # (req_id, tokens it holds already) since last taken
        self._remote_prefill: dict[str, RemotePrefill] = {}  # waiting for their blocks to be reserved
        self._ids = itertools.count()

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
        params.check_vocab(self.vocab_size)
        if kv_transfer is not None and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported with disaggregation (kv_transfer_params)")
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
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer; this engine has none")
            grammar = self.grammars.compile(params.structured_outputs)
        req = Request(
            req_id=req_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            grammar=grammar,
        )
        self.scheduler.check_admission(req)  # SLORejectedError under `slo` with `slo_reject`
        if kv_transfer is not None:
            self._start_transfer(req, kv_transfer)
        self.outputs.add(req, prompt_text)
        self.scheduler.add_request(req)
        return req_id

    def _check_transfer(self, kv_transfer: RemoteDecode | RemotePrefill | None) -> None:
        if kv_transfer is None:
            return
        from pdserve.transfer.types import RemoteDecode, RemotePrefill

        if self.connector is None:
            raise InvalidRequestError("this instance has no KV transfer backend (start it with one)")
        if isinstance(kv_transfer, RemoteDecode) and self.role == "decode":
            raise InvalidRequestError("a decode instance does not run prompts for other instances")
        if isinstance(kv_transfer, RemotePrefill) and self.role == "prefill":
            raise InvalidRequestError("a prefill instance does not decode prompts computed elsewhere")

    def _start_transfer(self, req: Request, kv_transfer: RemoteDecode | RemotePrefill) -> None:
        from pdserve.transfer.types import RemoteDecode, TransferError

        if isinstance(kv_transfer, RemoteDecode):
            req.remote_decode = True
            assert self.connector is not None
            try:
                self.connector.start_send(req, kv_transfer)
            except TransferError as e:
                raise InvalidRequestError(f"cannot send this request's KV: {e}") from None
        else:
            req.remote_prefill = True
            self._remote_prefill[req.req_id] = kv_transfer

    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
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
        self.executor.release(req_id)
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
        start = self.clock()
        results = self._poll_transfers() if self.connector is not None else []
        sched = self.scheduler.schedule()
        self.executor.apply_swaps(sched.swap_in, sched.swap_out)
        if sched.is_empty:
            return results
        out, replayed = self._execute(sched, results)
        updated = self.scheduler.update_from_output(sched, out)
        if self.connector is not None:
            updated = self._finish_sends(updated, results)
        processed = self.outputs.process(updated, self.scheduler)
        for r in processed:
            if r.finished:
                self._release(r.request_id)
        if not replayed:  # a replayed step's duration is no step's: keep it out of the records and model
            self._record(sched, out, start)
        return results + processed

    def _execute(self, sched: SchedulerOutput, results: list[RequestOutput]) -> tuple[ModelOutput, bool]:
        """Run the step; a failed step fails the requests that cause it, never the engine (their outputs
        join `results`, already released). Returns the output and whether the step had to be replayed
        request by request."""
        hook = None
        if self.connector is not None:
            hook = self.connector.layer_hook([(s.req, s.num_new_tokens) for s in sched.scheduled])
        try:
            return self.executor.execute(sched, hook), False
        except Exception as e:
            if hook is not None or len(sched.scheduled) == 1:  # (a KV send cannot be replayed per request)
                logger.exception("step failed; finishing its %d requests with an error", len(sched.scheduled))
                results += self._fail([s.req for s in sched.scheduled], f"engine step failed: {e}")
                num_sampling = sum(1 for s in sched.scheduled if s.samples)  # all finished: skipped
                return ModelOutput([[0]] * num_sampling, [None] * num_sampling, 0.0), True
            logger.exception("step of %d requests failed; running them one at a time", len(sched.scheduled))
            out, failed = self._execute_one_by_one(sched)
            for req, error in failed:
                results += self._fail([req], f"engine step failed: {error}")
            return out, True

    def _execute_one_by_one(self, sched: SchedulerOutput) -> tuple[ModelOutput, list[tuple[Request, str]]]:
        """Run each request of a failed step alone, so that only those that fail again are failed (with
        `chunked`, running decodes share every prompt's step). Nothing of the failed step was applied:
        counters only move in `update_from_output`, and K/V slots it wrote are rewritten. Returns the
        step's output in scheduler order (a placeholder token for each failed sampling request, which
        `update_from_output` skips once the request is finished) and the failures."""
        tokens: list[list[int]] = []
        logprobs: list[list[dict[int, float]] | None] = []
        drafts: list[list[int]] = []
        failed: list[tuple[Request, str]] = []
        forward_time = 0.0
        for s in sched.scheduled:
            try:
                alone = SchedulerOutput(scheduled=[s], num_batched_tokens=s.num_new_tokens)
                one = self.executor.execute(alone)
            except Exception as e:
                logger.exception("request %s fails on its own", s.req.req_id)
                failed.append((s.req, str(e)))
                if s.samples:
                    tokens.append([0])
                    logprobs.append(None)
                    drafts.append([])
                continue
            forward_time += one.forward_time
            tokens += one.token_ids
            logprobs += one.logprobs
            drafts += one.spec_token_ids or [[] for _ in one.token_ids]
        return ModelOutput(tokens, logprobs, forward_time, drafts), failed

    def _record(self, sched: SchedulerOutput, out: ModelOutput, start: float) -> None:
        rec = StepRecord(
            start=start,
            duration=self.clock() - start,
            forward_time=out.forward_time,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_seqs=len(sched.scheduled),
            num_context_tokens=sum(s.req.num_computed_tokens for s in sched.scheduled),
        )
        self.step_records.append(rec)
        # What the `slo` policy's step-time model learns from.
        self.scheduler.observe_step(
            rec.duration, rec.num_prefill_tokens, rec.num_decode_tokens, rec.num_context_tokens
        )

    def _fail(self, reqs: list[Request], message: str) -> list[RequestOutput]:
        results = []
        for req in reqs:
            self.scheduler.finish_request(req.req_id, FinishReason.ERROR)
            req.error = message
            self._release(req.req_id)
            results.append(self.outputs.finish(req))
        return results

    # ---- KV transfers (disaggregation) -----------------------------------------------------------
    def _finish_sends(self, updated: list[Request], results: list[RequestOutput]) -> list[Request]:
        """Remote-decode requests whose transfer failed during this step fail (into `results`); returns
        the others."""
        assert self.connector is not None
        lost = [r for r in updated if r.remote_decode and not self.connector.finish_send(r)]
        if not lost:
            return updated
        lost_ids = {id(r) for r in lost}
        results += self._fail(lost, "the KV transfer to the decode instance failed")
        return [r for r in updated if id(r) not in lost_ids]

    def _poll_transfers(self) -> list[RequestOutput]:
        """Apply the transport's news: finished sends free their blocks, complete receives start decoding,
        failures fail their request; then reserve blocks for new remote-prefill requests."""
        from pdserve.transfer.types import TransferError

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
        received = []
        for req, done in ev.received:
            if self.scheduler.kv_received(req.req_id, done.first_token, done.logprobs) is None:
                continue
            self.executor.skip_draws(req, 1)
            received.append(req)
        if received and isinstance(self.executor, Drafter):
            running = [r for r in received if not r.is_finished]
            drafts = self.executor.propose_received(running, len(self.scheduler.running))
            for req, d in zip(running, drafts):
                self.scheduler.set_drafts(req, d)
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
