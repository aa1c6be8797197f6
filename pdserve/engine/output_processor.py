"""Per-request text state beside the engine loop: incremental detokenization, stop strings, and the
`RequestOutput` objects the caller sees. Stop token ids and lengths are the scheduler's business; stop
*strings* need text, so they are checked here and reported back with `scheduler.finish_request`.

While a request has stop strings, the last `len(longest stop) - 1` characters are held back from the
stream so a client never sees the beginning of a stop string that is then cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.request import FinishReason, Request
from pdserve.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class _TextState:
    prompt: str | None
    detok: object | None  # IncrementalDetokenizer
    text: str = ""  # all text decoded so far (after a stop string: cut there)
    num_sent_chars: int = 0  # characters already returned as new_text
    num_sent_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        detok = None
        if self.tokenizer is not None:
            from pdserve.model.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
        self._states[req.req_id] = _TextState(prompt, detok)

    def process(self, updated: list[Request], scheduler: Scheduler) -> list[RequestOutput]:
        results = []
        for req in updated:
            st = self._states[req.req_id]
            if st.detok is not None:
                st.text += st.detok.add(req.output_token_ids[st.num_sent_tokens :])  # type: ignore[attr-defined]
                if req.params.stop and not req.is_finished and req.num_output_tokens >= req.params.min_tokens:
                    self._check_stop_strings(req, st, scheduler)
            results.append(self._output(req, st))
        return results

    def finish(self, req: Request) -> RequestOutput:
        """Output of a request finished outside the normal flow (abort, error)."""
        st = self._states.get(req.req_id) or _TextState(None, None)
        return self._output(req, st)

    def _check_stop_strings(self, req: Request, st: _TextState, scheduler: Scheduler) -> None:
        longest = max(len(s) for s in req.params.stop)
        # Only the new text (plus an overlap for stop strings spanning two steps) can contain a new match.
        search_from = max(0, st.num_sent_chars - longest + 1)
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            i = st.text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return
        i, stop = best
        st.text = st.text[: i + len(stop)] if req.params.include_stop_str_in_output else st.text[:i]
        scheduler.finish_request(req.req_id, FinishReason.STOP, stop)

    def _output(self, req: Request, st: _TextState) -> RequestOutput:
        finished = req.is_finished
        visible = len(st.text)
        if not finished and req.params.stop:
            visible = max(st.num_sent_chars, len(st.text) - (max(len(s) for s in req.params.stop) - 1))
        new_text = st.text[st.num_sent_chars : visible]
        st.num_sent_chars = visible
        new_tokens = req.output_token_ids[st.num_sent_tokens :]
        st.num_sent_tokens = len(req.output_token_ids)
        comp = CompletionOutput(
            index=0,
            text=st.text[:visible],
            token_ids=list(req.output_token_ids) if finished else req.output_token_ids,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            logprobs=req.logprobs,
            new_text=new_text,
            new_token_ids=new_tokens,
        )
        if finished:
            self._states.pop(req.req_id, None)
        metrics = RequestMetrics(
            req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time,
            req.num_cached_tokens, req.num_preemptions,
        )
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None:
            prompt_logprobs = [None, *(req.prompt_logprobs or [])]
        return RequestOutput(
            req.req_id, st.prompt, req.prompt_token_ids, [comp], finished, metrics, req.error, prompt_logprobs
        )
