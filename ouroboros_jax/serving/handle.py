"""A request as its submitter sees it: the handle it iterates for Deltas and waits on for the
RequestResult. The engine feeds it (`deliver`, `finish`); the handle turns tokens into text
(`output.TextStream`) and keeps the request's own speculative figures."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Optional

from ..request import ValidRequest
from .output import TextStream


class QueueFull(Exception):
    """submit() when max_queue requests are already waiting."""


@dataclasses.dataclass
class Delta:
    """Tokens that arrived for a request: token_ids and their newly decoded text (stop strings
    already cut; "" without a tokenizer); logprobs: per token (logprob, [(id, logprob), ...
    the top ones]) when the request asked for them (`RequestParams.logprobs`), else None."""

    token_ids: list
    text: str
    logprobs: Optional[list] = None


@dataclasses.dataclass
class RequestResult:
    """A finished request.

    Attributes:
        token_ids: the generated tokens (a stop id included when produced).
        text: their decoded text, cut before a stop string (None without a tokenizer).
        finish_reason: "stop" (a stop id or stop string), "length" (max_tokens) or "cancelled".
        prompt_tokens, completion_tokens: token counts.
        spec: this request's own speculative figures: mean_acceptance_length (tokens per
            round), acceptance_histogram (rounds by tokens kept), draft_tokens (draft tokens
            offered for verification), accepted_tokens (tokens past the target's own one per
            round), accepted_by_source ({source: accepted tokens from there}, summing to
            accepted_tokens; absent for a method without drafts: `decoding.common.SOURCES`).
        ttft_s, latency_s: seconds from submit to the first token and to the end.
        logprobs: per token (logprob, [(id, logprob), ...]) as in `Delta`, or None.
    """

    token_ids: list
    text: Optional[str]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spec: dict
    ttft_s: float
    latency_s: float
    logprobs: Optional[list] = None


_ids = itertools.count()


class RequestHandle:
    """A submitted request: iterate for its Deltas, `result()` for the whole, `cancel()`.

    Attributes:
        id: "req-N". request: the ValidRequest (prompt ids, params, stop ids).
        prompt, params: the request's.
        tokens: the tokens generated so far.
        error: the exception that failed the request (its result is then "cancelled"), or
            None.
        kept: tokens per round this request took part in; proposed: draft tokens offered.
    """

    def __init__(self, request: ValidRequest, tokenizer=None,
                 wake: Callable[[], None] = lambda: None):
        self.id = f"req-{next(_ids)}"
        self.request = request
        self.prompt = request.ids
        self.params = request.params
        self.error: Optional[BaseException] = None
        self.tokens: list = []
        self.logprobs: Optional[list] = None if request.params.logprobs is None else []
        self.kept: list = []
        self.proposed = 0
        self.sources: dict = {}
        self.t_submit = time.perf_counter()
        self.t_first: Optional[float] = None
        self._wake = wake
        self._text = TextStream(tokenizer, request.params.stop)
        # SimpleQueue (C): a tenth of Queue.put's host time, paid per request per step
        self._deltas: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._result: Optional[RequestResult] = None
        self._cancel = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        """cancel() was called (the engine frees the slot at its next step)."""
        return self._cancel

    def cancel(self) -> None:
        """Frees the slot at the next step (a disconnected client)."""
        self._cancel = True
        self._wake()

    def __iter__(self):
        while True:
            d = self._deltas.get()
            if d is None:
                self._deltas.put(None)  # a second iteration ends at once
                return
            yield d

    def result(self, timeout: Optional[float] = None) -> RequestResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._result

    # -- fed by the engine ----------------------------------------------------------------
    def deliver(self, new: list, now: float, reason: Optional[str],
                logprobs: Optional[list] = None) -> Optional[str]:
        """Streams new tokens (their text incremental, stop strings cut) and their logprobs
        (as `Delta.logprobs`; None: not asked for). reason: the device ended the request
        ("stop" or "length"). -> why it ends now (a stop string: "stop"), or None while it
        goes on."""
        if new and self.t_first is None:
            self.t_first = now
        self.tokens.extend(new)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs or [])
        piece, stopped = self._text.push(new)
        if reason is not None and not stopped:
            tail, stopped = self._text.close()
            piece += tail
        if new or piece:
            self._deltas.put(Delta(new, piece, logprobs))
        return "stop" if stopped else reason

    def record(self, kept: list, proposed: int, sources: Optional[dict] = None) -> None:
        """One step's rounds for this request: tokens kept per round, draft tokens offered,
        accepted draft tokens by source."""
        self.kept.extend(kept)
        self.proposed += proposed
        for s, n in (sources or {}).items():
            self.sources[s] = self.sources.get(s, 0) + n

    def finish(self, reason: str, hist_len: int,
               error: Optional[BaseException] = None) -> Optional[RequestResult]:
        """Ends the request with `reason` (histogram of `hist_len` bins); None if it had
        ended already."""
        if self.done:
            return None
        now = time.perf_counter()
        self.error = error
        if not self._text.closed:  # cancelled: the text held back joins the result
            self._text.close()
        hist = [0] * hist_len
        for k in self.kept:
            hist[min(k, hist_len - 1)] += 1
        rounds = len(self.kept)
        spec = dict(mean_acceptance_length=(sum(self.kept) / rounds) if rounds else 0.0,
                    acceptance_histogram=hist, draft_tokens=self.proposed,
                    accepted_tokens=sum(max(k - 1, 0) for k in self.kept))
        if self.sources:
            spec["accepted_by_source"] = dict(self.sources)
        self._result = RequestResult(
            token_ids=list(self.tokens), text=self._text.text, finish_reason=reason,
            prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens), spec=spec,
            ttft_s=(self.t_first or now) - self.t_submit, latency_s=now - self.t_submit,
            logprobs=None if self.logprobs is None else list(self.logprobs))
        self._done.set()
        self._deltas.put(None)
        return self._result
