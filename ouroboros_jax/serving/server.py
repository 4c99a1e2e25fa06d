"""An OpenAI-compatible HTTP server over one `Engine` (FastAPI + uvicorn).

    from ouroboros_jax.serving.engine import Engine
    from ouroboros_jax.serving.server import create_app, ServerThread
    app = create_app(Engine(target, draft, method="ouroboros", slots=8))
    with ServerThread(app) as srv:          # uvicorn in a thread; srv.url = http://127.0.0.1:PORT
        ...                                  # or: serve(app, host, port) in the foreground

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events shaped as OpenAI's chunks, ending `data: [DONE]`; `stream_options.
include_usage` adds the usage chunk), GET /health, GET /metrics (Prometheus text, see
`serving/metrics.py`).

Every response carries the request's own speculative-decoding figures in a top-level `metrics`
object, `{"speculative_decoding": {"mean_acceptance_length", "acceptance_histogram", ...}}`, where
vLLM puts them (vLLM PR #48915; `acceptance_histogram[j]` = verification rounds that accepted
exactly j draft tokens). Each choice also carries `token_ids` (its generated ids, as vLLM's
`return_token_ids` does), so models without a tokenizer can be served on token-id prompts.

Extensions beyond OpenAI's fields, named as vLLM names them: `top_k`, `stop_token_ids`,
`ignore_eos`; and `speculation: "off"` (plain decoding for that request, the same output).
`logprobs` / `top_logprobs` are the target's, taken from the forward that accepted each token
(`openai_logprobs.py`). `n` > 1 submits n engine requests, choice i with a seed derived from
the request's (`choice_seed`); usage sums their completion tokens. Fields that would change
what is sampled and that the engine does not implement (`echo`, `best_of`, penalties,
`logit_bias`, tools, non-text response formats) are refused with 400 rather than silently
ignored.

Faults: a body that is not JSON, an unknown model, a bad field (max_tokens <= 0 or past the
cache, a prompt longer than the cache, sampling values out of range) -> 400 with OpenAI's error
body `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`; a full queue ->
429; a client that disconnects mid-request cancels it (the engine frees its slot at its next
step); stopping the server either drains the requests in flight (`ServerThread.stop()`, uvicorn's
graceful shutdown) or cancels them (`stop(cancel=True)`: streams get an error event, waiting
non-streamed requests a 503).

Structure: `Service` holds what a server knows (the engine, behind the `EngineAPI` interface,
the names it serves, its counters) and answers each endpoint in a method of its own, callable
without HTTP (tests/test_serving_units.py); `create_app` only routes to it; the wire format
(bodies, chunks, error bodies) is `openai_api.py`'s.

Threads: uvicorn's event loop runs the handlers; the engine runs its own step thread
(`Engine.start`); each request gets a small pump thread that iterates the blocking
`RequestHandle` and hands its deltas to the event loop, so no handler blocks the loop.
"""


from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Optional, Protocol, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..request import FieldError, RequestParams, ValidRequest
from .handle import QueueFull, RequestHandle
from .metrics import CONTENT_TYPE, ServerMetrics, render
from .runner import ServerThread, serve  # noqa: F401  (where callers import them from)
from .openai_api import (APIError, bad, choice_count, chunk, completion, metrics_obj,
                         param_name, parse_body, parse_completion_prompt, parse_messages,
                         sampling_fields, sse, stream_flags, usage)
from .openai_logprobs import CompletionOffsets, chat_logprobs, logprobs_of
from .choices import Pump, choice_seed, entry, pumps  # noqa: F401  (Pump: where it was)


@runtime_checkable
class EngineAPI(Protocol):
    """What the server asks of an engine (`serving.engine.Engine` is one).

    model_name: the default name served. tokenizer: None when the model has none (no chat, no
    text). limit: prompt + max_tokens allowed. default_stop_ids: the model's own EOS ids.
    running: False once the engine can take no more work (/health answers 503).
    tokens(prompt) -> ids: a prompt (text, ids, chat messages) tokenized, chat rendered once;
    FieldError naming the prompt. validate(ids, params) -> ValidRequest: FieldError naming
    the field. submit(ValidRequest) -> RequestHandle: QueueFull when full, RuntimeError when
    stopped. metrics() -> dict (`serving/metrics.py` renders it). start(), stop(cancel,
    timeout): the engine's own thread."""

    model_name: str
    tokenizer: Any
    limit: int
    default_stop_ids: tuple
    running: bool

    def tokens(self, prompt) -> list: ...

    def validate(self, ids: list, params: RequestParams) -> ValidRequest: ...

    def submit(self, request: ValidRequest) -> RequestHandle: ...

    def metrics(self) -> dict: ...

    def start(self) -> None: ...

    def stop(self, cancel: bool = False, timeout: Optional[float] = None) -> None: ...


@dataclasses.dataclass
class Call:
    """One accepted request: its handles (one per choice; `handle` the first) and how to
    answer it."""

    handle: Any
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    handles: Optional[list] = None

    def __post_init__(self):
        self.handles = self.handles or [self.handle]

    def cancel(self) -> None:
        """Cancels every choice (a finished one ignores it)."""
        for h in self.handles:
            h.cancel()

    @property
    def meta(self) -> dict:
        """The fields every chunk and response of this request carries."""
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.handle.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}


def failure(handle, r) -> Optional[APIError]:
    """The error a finished request answers with, or None: the engine failed it (500), or
    the server's shutdown cancelled it (503)."""
    if handle.error is not None:
        return APIError(500, f"generation failed: {handle.error!r}", type_="server_error")
    if r.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down",
                        type_="server_error", code="cancelled")
    return None


class Service:
    """The server's state and one method per endpoint, over an `EngineAPI`; see the module
    docstring. names: the model names clients may ask for (the first is listed first and
    carried by responses)."""

    def __init__(self, engine: EngineAPI, names: Optional[list] = None):
        self.engine = engine
        self.names = tuple(names or [engine.model_name or "ouroboros"])
        self.metrics = ServerMetrics()
        self.stopping = False
        self.created = int(time.time())

    # -- accepting a request ---------------------------------------------------------------
    def model_of(self, body: dict) -> str:
        m = body.get("model")
        if m is None:
            return self.names[0]
        if m not in self.names:
            raise bad(f"The model `{m}` does not exist; this server serves {list(self.names)}",
                      "model", code="model_not_found")
        return m

    def prompt_of(self, body: dict, chat: bool):
        """The body's prompt (completions) or messages (chat), parsed."""
        if chat:
            msgs = parse_messages(body.get("messages"))
            if self.engine.tokenizer is None:
                raise bad("this model has no tokenizer, so it cannot read chat messages; use "
                          "/v1/completions with a prompt of token ids", "messages")
            return msgs
        if "prompt" not in body:
            raise bad("prompt is required", "prompt")
        return parse_completion_prompt(body["prompt"])

    def accept(self, body: dict, *, chat: bool) -> Call:
        """A parsed body -> the submitted request (APIError: 400 naming the field, 429 when
        the queue is full, 503 when stopping)."""
        model = self.model_of(body)
        prompt = self.prompt_of(body, chat)
        stream, include_usage = stream_flags(body)
        try:
            ids = self.engine.tokens(prompt)  # a chat rendered here, once
        except ValueError as e:
            raise bad(str(e), "messages" if chat else "prompt") from None
        default_max = 16
        if chat:  # OpenAI's chat without max_tokens runs to the end of the context
            default_max = max(self.engine.limit - len(ids), 1)
        fields = sampling_fields(body, default_max_tokens=default_max,
                                 default_eos=tuple(self.engine.default_stop_ids), chat=chat)
        handles = []
        try:
            for i in range(choice_count(body)):
                seed = choice_seed(fields["seed"], i)
                handles.append(self.submit(ids, dict(fields, seed=seed), body, chat))
        except APIError:
            for h in handles:  # the choices already queued go with the request
                h.cancel()
            raise
        return Call(handles[0], chat, model, stream, include_usage, handles=handles)

    def submit(self, ids: list, fields: dict, body: dict, chat: bool):
        """Tokenized ids and RequestParams fields -> the engine's handle; APIError by what
        failed (the field a FieldError names -> its param)."""
        if self.stopping:
            raise APIError(503, "the server is shutting down", type_="server_error",
                           code="shutting_down")
        try:
            return self.engine.submit(self.engine.validate(ids, RequestParams(**fields)))
        except QueueFull as e:
            raise APIError(429, f"the request queue is full ({e}); retry later",
                           type_="rate_limit_exceeded", code="queue_full") from None
        except FieldError as e:
            raise bad(str(e), param_name(e.field, body, chat)) from None
        except ValueError as e:
            raise bad(str(e)) from None
        except RuntimeError as e:  # the engine is stopped
            raise APIError(503, f"the engine is not running: {e}", type_="server_error",
                           code="engine_stopped") from None

    # -- answering ---------------------------------------------------------------------------
    def finished(self, call: Call, r) -> None:
        self.metrics.request_done("chat" if call.chat else "completions", r.finish_reason,
                                  r.latency_s, r.ttft_s if r.completion_tokens else None)

    def _last(self, call: Call, kind: str, item, index: int, results: dict
              ) -> tuple[list, bool]:
        """The events a choice's end gives a stream: an error (the stream ends, the other
        choices cancelled) or its final chunk, then, once every choice has ended, the usage
        chunk and [DONE]. -> (events, whether the stream ends)."""
        err = APIError(500, f"generation failed: {item!r}", type_="server_error") \
            if kind == "error" else None
        if kind == "done":
            self.finished(call, item)
            err = failure(call.handles[index], item)
            results[index] = item
        if err is not None:
            call.cancel()
            return [sse(err.body()), "data: [DONE]\n\n"], True
        meta = call.meta
        out = [chunk(meta, call.chat, "", [], finish=item.finish_reason, index=index,
                     extra={"metrics": metrics_obj(item)}, include_usage=call.include_usage)]
        if len(results) < len(call.handles):
            return out, False
        every = [results[i] for i in range(len(call.handles))]
        if call.include_usage:
            out.append(sse(dict(meta, choices=[], usage=usage(*every),
                                metrics=metrics_obj(*every))))
        return out + ["data: [DONE]\n\n"], True

    def _streamed_logprobs(self, call: Call) -> list:
        """Per choice: (token ids, logprobs) -> the chunk's logprobs object."""
        tok = self.engine.tokenizer
        if call.chat:
            return [lambda ids, lps: chat_logprobs(tok, ids, lps)] * len(call.handles)
        return [CompletionOffsets(tok).logprobs for _ in call.handles]

    async def events(self, call: Call, queue: asyncio.Queue):
        """A streamed answer: SSE events from the pumps' queue until [DONE], each chunk
        carrying its choice's index. A client that goes away (the generator is closed)
        cancels the request."""
        meta, done, results = call.meta, False, {}
        fmt = self._streamed_logprobs(call)
        try:
            if call.chat:
                for i in range(len(call.handles)):
                    yield chunk(meta, True, "", [], role=True, index=i,
                                include_usage=call.include_usage)
            while not done:
                kind, item, i = entry(await queue.get())
                if kind != "delta":
                    events, done = self._last(call, kind, item, i, results)
                    for e in events:
                        yield e
                elif item.token_ids or item.text:
                    yield chunk(meta, call.chat, item.text, list(item.token_ids), index=i,
                                include_usage=call.include_usage,
                                logprobs=fmt[i](list(item.token_ids), item.logprobs))
        finally:
            if not done:  # the client went away (the task is being cancelled)
                call.cancel()

    async def answer(self, call: Call, queue: asyncio.Queue, gone) -> Optional[dict]:
        """A non-streamed answer: the whole response once every choice finishes; None when
        the client went away first (`gone`, an awaitable; the request is then cancelled)."""
        n, texts, results, gone = len(call.handles), {}, {}, asyncio.ensure_future(gone)
        try:
            while len(results) < n:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:  # the client went away: free the slots, answer nobody
                    get.cancel()
                    call.cancel()
                    return None
                kind, item, i = entry(get.result())
                if kind == "error":
                    call.cancel()
                    raise APIError(500, f"generation failed: {item!r}", type_="server_error")
                if kind == "done":
                    results[i] = item
                else:
                    texts.setdefault(i, []).append(item.text or "")
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            gone.cancel()
        every = [results[i] for i in range(n)]
        for h, r in zip(call.handles, every):
            self.finished(call, r)
            err = failure(h, r)
            if err is not None:
                raise err
        text = [r.text if r.text is not None else "".join(texts.get(i, []))
                for i, r in enumerate(every)]
        lps = None if call.handle.params.logprobs is None else [
            logprobs_of(self.engine.tokenizer, call.chat, r.token_ids, r.logprobs) for r in every]
        return completion(call.meta, call.chat, every, text, lps)

    # -- the other endpoints -----------------------------------------------------------------
    def models(self) -> dict:
        limit = self.engine.limit
        return {"object": "list",
                "data": [{"id": n, "object": "model", "created": self.created,
                          "owned_by": "ouroboros-jax", "root": self.names[0],
                          **({"max_model_len": int(limit)} if limit else {})}
                         for n in self.names]}

    def health(self) -> tuple[int, dict]:
        """-> (HTTP status, body)."""
        if self.stopping or not self.engine.running:
            return 503, {"status": "stopping" if self.stopping else "engine stopped"}
        return 200, {"status": "ok"}

    def metrics_text(self) -> str:
        return render(self.engine.metrics(), self.metrics, self.names[0])

    def error(self, e: APIError) -> JSONResponse:
        self.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (uvicorn's receive() after the body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: EngineAPI, *, model_names: Optional[list[str]] = None,
               manage_engine: bool = True, stop_timeout: Optional[float] = 30.0):
    """A FastAPI app serving `engine`: routes to a `Service` (app.state.ouroboros).

    model_names: the names clients may ask for (default: [engine.model_name]); the first is the
    one /v1/models lists first and responses carry. manage_engine: start the engine's thread at
    startup and stop it at shutdown (finishing what is in flight, then cancelling what is left
    after stop_timeout seconds); False when the caller drives the engine.
    """
    svc = Service(engine, model_names)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            svc.stopping = True
            if manage_engine:
                # uvicorn has already waited for open connections (its graceful shutdown), so
                # what is left here is cancelled, not waited for again
                await asyncio.to_thread(engine.stop, cancel=True, timeout=stop_timeout)

    app = FastAPI(title="ouroboros-jax", lifespan=lifespan)
    app.state.ouroboros = svc

    async def on_error(request, e):
        if isinstance(e, APIError):
            return svc.error(e)
        status = getattr(e, "status_code", 500)
        if status == 404:
            return svc.error(APIError(404, f"no route {request.method} {request.url.path}",
                                      type_="not_found_error"))
        if status == 405:
            return svc.error(APIError(405, f"method {request.method} not allowed on "
                                      f"{request.url.path}"))
        # a bug: still an OpenAI-shaped 500
        return svc.error(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                  type_="server_error"))

    for key in (APIError, Exception, 404, 405):
        app.add_exception_handler(key, on_error)

    async def run(request: Request, chat: bool):
        call = svc.accept(parse_body(await request.body()), chat=chat)
        queue = pumps(call, asyncio.get_running_loop())
        if call.stream:
            return StreamingResponse(svc.events(call, queue),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await svc.answer(call, queue, _disconnected(request))
        # 499: nginx's "client closed request"
        return Response(status_code=499) if out is None else JSONResponse(out)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return svc.models()

    @app.get("/health")
    async def health():
        status, body = svc.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics_text(), media_type=CONTENT_TYPE)

    return app
