"""An OpenAI-compatible HTTP server over one `Engine` (FastAPI + uvicorn).

    from ouroboros_jax.serving.engine import Engine
    from ouroboros_jax.serving.server import create_app, ServerThread
    app = create_app(Engine(target, draft, method="ouroboros", slots=8))
    with ServerThread(app) as srv:          # uvicorn in a thread; srv.url = http://127.0.0.1:PORT
        ...                                  # or: serve(app, host, port) in the foreground

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events shaped as OpenAI's chunks, ending `data: [DONE]`; `stream_options.
include_usage` adds the usage chunk), GET /health, GET /metrics (Prometheus text, see
`serving/metrics.py`); HEAD wherever GET.

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

Faults: a body that is not JSON (nested too deep included), an unknown model, a bad field
(max_tokens <= 0 or past the cache, a prompt longer than the cache, sampling values out of
range) -> 400 with OpenAI's error body `{"error": {"message", "type": "invalid_request_error",
"param", "code"}}`; a full queue -> 429; a client that disconnects mid-request cancels it (the
engine frees its slot at its next step). Before any handler, the gate (`guard.py`) refuses
foreign Hosts (421) and Origins (403), a missing API key (401), bodies that are not JSON
(415), too large (413) or too slow (408).

Shutdown (`runner.py`): /health and new requests get 503 at once; requests in flight get the
drain time to finish, then the Service ends what is left itself (`end_open`: streams get an
error event and [DONE], non-streamed requests a JSON 503) before uvicorn's own deadline could
cancel a handler; `ServerThread.stop(cancel=True)` cancels them at once.

Structure: `Service` holds what a server knows (the engine, behind the `EngineAPI` interface
of `engine_api.py`, the names it serves, its counters) and answers each endpoint in a method
of its own, callable without HTTP (tests/test_serving_units.py); `create_app` only routes to
it; the wire format (bodies, chunks, error bodies) is `openai_api.py`'s.

Threads: uvicorn's event loop runs the handlers and nothing slow: a request's JSON parsing,
chat template, tokenization and validation run once, on a worker thread (`pump.off_loop`);
the engine runs its own step thread (`Engine.start`); each request gets a small pump thread
that iterates the blocking `RequestHandle` and hands its deltas to the event loop.
"""


from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.cors import CORSMiddleware

from ..request import FieldError, RequestParams
from .engine_api import EngineAPI
from .guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, Guard, Limits
from .handle import QueueFull
from .metrics import CONTENT_TYPE, ServerMetrics, render
from .pump import disconnected, off_loop
from .runner import ServerThread, serve  # noqa: F401  (where callers import them from)
from .openai_api import (APIError, bad, choice_count, chunk, completion, metrics_obj,
                         param_name, parse_body, parse_completion_prompt, parse_messages,
                         sampling_fields, sse, stream_flags, usage)
from .openai_logprobs import CompletionOffsets, chat_logprobs, logprobs_of
from .choices import Call, choice_seed, entry, failure, pumps, shut_down


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
        self.open: dict = {}  # the pump queue of each request being answered -> its Call
        self.ended = False  # the drain time is over (`end_open`)

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
        the queue is full, 503 when stopping). It tokenizes (a chat: its template rendered
        once), so the server calls it on a worker thread (`pump.off_loop`)."""
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
        if r is None:  # ended by the shutdown (`end_open`): no result to measure
            return self.metrics.cancelled("chat" if call.chat else "completions")
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
        if kind == "shutdown":
            self.finished(call, None)
            err = shut_down()
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
            self.open.pop(queue, None)
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
                if kind == "shutdown":
                    self.finished(call, None)
                    raise shut_down()
                if kind == "done":
                    results[i] = item
                else:
                    texts.setdefault(i, []).append(item.text or "")
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            gone.cancel()
            self.open.pop(queue, None)
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

    # -- shutting down -----------------------------------------------------------------------
    def drain(self) -> None:
        """The server's shutdown began: /health answers 503, new requests get 503, those in
        flight go on."""
        self.stopping = True

    def register(self, queue: asyncio.Queue, call) -> None:
        """A request being answered from `queue`: `end_open` ends it (at once when the drain
        time is already over). call: a `Call` (its every choice is cancelled then)."""
        self.open[queue] = call
        if self.ended:
            call.cancel()
            queue.put_nowait(("shutdown", None))

    def end_open(self) -> int:
        """The drain time is over: every request still being answered is cancelled and
        answered now (a stream: an error event and [DONE]; a non-streamed one: a JSON 503),
        whatever the engine is doing, so no handler is left for uvicorn to cancel. On the
        event loop's thread. -> how many."""
        self.stopping = self.ended = True
        ended = list(self.open.items())
        for queue, call in ended:
            call.cancel()
            queue.put_nowait(("shutdown", None))
        return len(ended)

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


def _on_error(svc: Service):
    """The app's one exception handler: every error in OpenAI's error body."""

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

    return on_error


def _routes(app: FastAPI, svc: Service) -> None:
    """The endpoints, each routed to the Service; HEAD wherever GET (load balancers' checks)."""

    async def run(request: Request, chat: bool):
        raw = await request.body()  # the gate (guard.py) has read it already
        # parsing, the chat template and tokenization cost CPU: a worker thread's, not the loop's
        call = await off_loop(lambda: svc.accept(parse_body(raw), chat=chat))
        queue = pumps(call, asyncio.get_running_loop())
        svc.register(queue, call)
        if call.stream:
            return StreamingResponse(svc.events(call, queue),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        out = await svc.answer(call, queue, disconnected(request))
        # 499: nginx's "client closed request"
        return Response(status_code=499) if out is None else JSONResponse(out)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat=True)

    def get(path: str):
        """A GET route, and HEAD on it (uvicorn sends HEAD's headers without the body)."""
        def route(fn):
            app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
            return app.get(path)(fn)
        return route

    @get("/v1/models")
    async def models():
        return svc.models()

    @get("/health")
    async def health():
        status, body = svc.health()
        return JSONResponse(body, status_code=status)

    @get("/metrics")
    async def metrics():
        return Response(svc.metrics_text(), media_type=CONTENT_TYPE)


def create_app(engine: EngineAPI, *, model_names: Optional[list[str]] = None,
               manage_engine: bool = True, stop_timeout: Optional[float] = 30.0,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: Optional[float] = DEFAULT_BODY_TIMEOUT,
               api_key: Optional[str] = None, allowed_hosts: Sequence[str] = (),
               allowed_origins: Sequence[str] = (), docs: bool = False):
    """A FastAPI app serving `engine`: routes to a `Service` (app.state.ouroboros), behind the
    gate of `guard.py`.

    model_names: the names clients may ask for (default: [engine.model_name]); the first is the
    one /v1/models lists first and responses carry. manage_engine: start the engine's thread at
    startup and stop it at shutdown (finishing what is in flight, then cancelling what is left
    after stop_timeout seconds); False when the caller drives the engine.
    max_body_bytes (413 past it), body_timeout (seconds for the whole body; 408 past them),
    api_key (/v1/ requests need `Authorization: Bearer KEY`), allowed_hosts (Host names beyond
    the server's own), allowed_origins (browser origins allowed, with CORS headers for them;
    none by default): see `guard.py`. docs: serve /docs, /redoc and /openapi.json.
    """
    limits = Limits(max_body_bytes, body_timeout, api_key, allowed_hosts, allowed_origins)
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

    app = FastAPI(title="ouroboros-jax", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.ouroboros = svc
    on_error = _on_error(svc)
    for key in (APIError, Exception, 404, 405):
        app.add_exception_handler(key, on_error)
    _routes(app, svc)
    if limits.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                           allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    # added last, so outermost: nothing runs for a request the gate refuses
    app.add_middleware(Guard, limits=limits, metrics=svc.metrics,
                       cors=bool(limits.allowed_origins))
    return app
