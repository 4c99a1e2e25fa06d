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
`ignore_eos`. Fields that would change what is sampled and that the engine does not implement
(`logprobs`, `echo`, `best_of`, `n` > 1, penalties, `logit_bias`, tools, non-text response
formats) are refused with 400 rather than silently ignored.

Faults: a body that is not JSON, an unknown model, a bad field (max_tokens <= 0 or past the
cache, a prompt longer than the cache, sampling values out of range) -> 400 with OpenAI's error
body `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`; a full queue ->
429; a client that disconnects mid-request cancels it (the engine frees its slot at its next
step); stopping the server either drains the requests in flight (`ServerThread.stop()`, uvicorn's
graceful shutdown) or cancels them (`stop(cancel=True)`: streams get an error event, waiting
non-streamed requests a 503).

Threads: uvicorn's event loop runs the handlers; the engine runs its own step thread
(`Engine.start`); each request gets a small pump thread that iterates the blocking
`RequestHandle` and hands its deltas to the event loop, so no handler blocks the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .metrics import CONTENT_TYPE, ServerMetrics, render

# Fields refused with 400: (name, test that the value asks for something unsupported, why)
_UNSUPPORTED = (
    ("n", lambda v: v not in (None, 1), "only n=1 is supported; send one request per sample"),
    ("best_of", lambda v: v not in (None, 1), "best_of is not supported"),
    ("echo", lambda v: bool(v), "echo is not supported"),
    ("logprobs", lambda v: v not in (None, False), "logprobs are not supported"),
    ("top_logprobs", lambda v: v not in (None, 0), "top_logprobs are not supported"),
    ("suffix", lambda v: v not in (None, ""), "suffix (insertion) is not supported"),
    ("presence_penalty", lambda v: v not in (None, 0, 0.0),
     "presence_penalty is not supported (it would change the target's distribution)"),
    ("frequency_penalty", lambda v: v not in (None, 0, 0.0),
     "frequency_penalty is not supported (it would change the target's distribution)"),
    ("repetition_penalty", lambda v: v not in (None, 1, 1.0), "repetition_penalty is not supported"),
    ("logit_bias", lambda v: bool(v), "logit_bias is not supported"),
    ("tools", lambda v: bool(v), "tools are not supported"),
    ("functions", lambda v: bool(v), "functions are not supported"),
    ("response_format", lambda v: v not in (None, {}) and (not isinstance(v, dict)
                                                          or v.get("type") != "text"),
     "only response_format {'type': 'text'} is supported"),
)
# The field names a ValueError from the engine may name, in the order they are looked for
_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
           "messages", "prompt")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                       type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code=code)


# -- request parsing: JSON body -> (prompt, RequestParams); pure, no engine state --------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get_int(body: dict, name: str, default, minimum: Optional[int] = None):
    v = body.get(name, default)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(f"{name} must be an integer, got {v!r}", name)
    if minimum is not None and v < minimum:
        raise _bad(f"{name} must be >= {minimum}, got {v}", name)
    return v


def _get_num(body: dict, name: str, default: float, lo: float, hi: float,
             lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if not _is_num(v) or v != v:
        raise _bad(f"{name} must be a number, got {v!r}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        lo_s = "(" if lo_open else "["
        raise _bad(f"{name} must be in {lo_s}{lo}, {hi}], got {v}", name)
    return float(v)


def parse_completion_prompt(p) -> Any:
    """OpenAI's `prompt` (a string, a list of one string, token ids, or a list of one id
    list) -> a string or a list of ids. Batched prompts are refused: one request, one prompt."""
    if isinstance(p, str):
        if not p:
            raise _bad("prompt is empty", "prompt")
        return p
    if isinstance(p, list) and p:
        if all(_is_int(t) for t in p):
            return [int(t) for t in p]
        if len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
            return parse_completion_prompt(p[0])
        if all(isinstance(x, (str, list)) for x in p):
            raise _bad("prompt: batched prompts are not supported; send one prompt per "
                       "request (they are batched on the server anyway)", "prompt")
    raise _bad("prompt must be a non-empty string, a list of token ids, or a list of one of "
               f"those; got {type(p).__name__}", "prompt")


def parse_messages(msgs) -> list[dict]:
    """OpenAI's `messages` -> [{"role", "content": str}] (content parts of type "text" joined;
    any other part type refused)."""
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        c = m.get("content")
        if c is None:
            c = ""
        if isinstance(c, list):
            parts = []
            for part in c:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content: only text parts are supported",
                               "messages")
                parts.append(part["text"])
            c = "".join(parts)
        if not isinstance(c, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts",
                       "messages")
        out.append({"role": m["role"], "content": c})
    return out


def _stop_strings(v) -> tuple:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _bad("stop must be a non-empty string or a list of them", "stop")
    return tuple(v)


def sampling_fields(body: dict, *, default_max_tokens: Optional[int],
                    default_eos: Optional[tuple]) -> dict:
    """The sampling fields of a request body -> keyword arguments of RequestParams, each
    checked (type and range) with a 400 naming it. default_eos: the model's EOS ids, which
    `stop_token_ids` adds to (as vLLM does) unless `ignore_eos`."""
    for name, asks, why in _UNSUPPORTED:
        if asks(body.get(name)):
            raise _bad(why, name, code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens <= 0:
        raise _bad(f"{name} must be a positive integer, got {max_tokens!r}", name)
    top_k = _get_int(body, "top_k", 0, minimum=-1)
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(31)  # OpenAI: no seed -> not reproducible
    elif not _is_int(seed) or seed < 0 or seed >= 2 ** 32:
        raise _bad(f"seed must be an integer in [0, 2**32), got {seed!r}", "seed")
    ids = body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) and t >= 0
                                                                 for t in ids)):
        raise _bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad(f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    if ignore_eos:
        stop_ids = tuple(ids or ())
    elif ids:
        stop_ids = tuple(dict.fromkeys(tuple(default_eos or ()) + tuple(ids)))
    else:
        stop_ids = None  # the model's own EOS ids
    out = dict(temperature=_get_num(body, "temperature", 1.0, 0.0, 2.0),
               top_p=_get_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
               top_k=0 if top_k == -1 else top_k,  # vLLM's -1 = off
               seed=int(seed), stop_token_ids=stop_ids, stop=_stop_strings(body.get("stop")))
    if max_tokens is not None:
        out["max_tokens"] = int(max_tokens)
    return out


def _stream_options(body: dict) -> bool:
    """-> include_usage."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise _bad("stream_options must be an object like {\"include_usage\": true}",
                   "stream_options")
    if not body.get("stream"):
        raise _bad("stream_options is only allowed with stream=true", "stream_options")
    return bool(so.get("include_usage", False))


def engine_limit(engine) -> Optional[int]:
    """The engine's prompt + max_tokens limit (`max_cache_len`, else its `limit`)."""
    v = getattr(engine, "max_cache_len", None)
    return v if v is not None else getattr(engine, "limit", None)


def engine_encoder(engine):
    """The engine's prompt -> ids function (the ids submit would use), or None."""
    return getattr(engine, "encode", None) or getattr(engine, "_tokens", None)


def _param_of(message: str) -> Optional[str]:
    low = message.lower()
    for p in _PARAMS:
        if p in low:
            return p
    return "prompt" if ("cache" in low or "token" in low) else None


# -- response shaping ---------------------------------------------------------------------------

def spec_figures(spec: Optional[dict]) -> dict:
    """An engine RequestResult.spec -> vLLM's `metrics.speculative_decoding` object."""
    spec = dict(spec or {})
    hist = [int(x) for x in spec.pop("acceptance_histogram", []) or []]
    drafted = int(spec.pop("draft_tokens", 0) or 0)
    accepted = int(spec.pop("accepted_tokens", 0) or 0)
    out = {"mean_acceptance_length": spec.pop("mean_acceptance_length", None),
           "acceptance_histogram": hist,
           "num_spec_steps": sum(hist),
           "num_draft_tokens": drafted,
           "num_accepted_draft_tokens": accepted,
           "draft_acceptance_rate": accepted / drafted if drafted else None}
    out.update(spec)  # whatever else the engine reports for this request
    return out


def _usage(r) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def _metrics_obj(r) -> dict:
    return {"speculative_decoding": spec_figures(r.spec),
            "time_to_first_token_s": r.ttft_s, "latency_s": r.latency_s}


class _Pump:
    """Iterates a blocking RequestHandle on its own thread and hands ("delta", d), ("done",
    result) or ("error", exc) to the event loop's queue."""

    def __init__(self, handle, loop: asyncio.AbstractEventLoop):
        self.handle, self.loop = handle, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._run, daemon=True, name=f"pump-{handle.id}").start()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.handle.cancel()

    def _run(self) -> None:
        try:
            for d in self.handle:
                self._put(("delta", d))
            self._put(("done", self.handle.result()))
        except Exception as e:  # noqa: BLE001  (reported to the client, never lost)
            self._put(("error", e))


class _State:
    def __init__(self, engine, names: tuple[str, ...]):
        self.engine = engine
        self.names = names
        self.metrics = ServerMetrics()
        self.stopping = False
        self.created = int(time.time())


def create_app(engine, *, model_names: Optional[list[str]] = None, manage_engine: bool = True,
               stop_timeout: Optional[float] = 30.0):
    """A FastAPI app serving `engine`.

    model_names: the names clients may ask for (default: [engine.model_name]); the first is the
    one /v1/models lists first and responses carry. manage_engine: start the engine's thread at
    startup and stop it at shutdown (finishing what is in flight, then cancelling what is left
    after stop_timeout seconds); False when the caller drives the engine.
    """
    names = tuple(model_names or [getattr(engine, "model_name", None) or "ouroboros"])
    st = _State(engine, names)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            st.stopping = True
            if manage_engine:
                # uvicorn has already waited for open connections (its graceful shutdown), so
                # what is left here is cancelled, not waited for again
                await asyncio.to_thread(engine.stop, cancel=True, timeout=stop_timeout)

    app = FastAPI(title="ouroboros-jax", lifespan=lifespan)
    app.state.ouroboros = st

    def error_response(e: APIError):
        st.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):  # a bug: still an OpenAI-shaped 500
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type_="server_error"))

    async def read_body(request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    def check_model(body: dict) -> str:
        m = body.get("model")
        if m is None:
            return names[0]
        if m not in names:
            raise _bad(f"The model `{m}` does not exist; this server serves {list(names)}",
                       "model", code="model_not_found")
        return m

    def default_eos() -> Optional[tuple]:
        target = getattr(engine, "target", None)
        if target is None:
            return None
        from ..request import default_eos_ids

        e = default_eos_ids(target)
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    def chat_default_max_tokens(messages) -> Optional[int]:
        """OpenAI's chat without max_tokens runs to the end of the context: here, what is left
        of the engine's cache after the prompt (None: the engine's default)."""
        limit, enc = engine_limit(engine), engine_encoder(engine)
        if limit is None or enc is None:
            return None
        try:
            n = len(enc(messages))
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        return max(int(limit) - n, 1)

    def check_fits(prompt, fields: dict) -> None:
        """The cache limit and the vocabulary checked here where the server can tell which
        field is at fault (the engine checks again, naming the problem only in words)."""
        limit = engine_limit(engine)
        target = getattr(engine, "target", None)
        ids = prompt if isinstance(prompt, list) and all(_is_int(t) for t in prompt) else None
        if ids is not None and target is not None:
            V = target.config.vocab_size
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise _bad(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {V})",
                           "prompt")
        if limit is None:
            return
        if ids is None:
            enc = engine_encoder(engine)
            if enc is None:
                return
            try:
                n = len(enc(prompt))
            except ValueError as e:
                raise _bad(str(e), "messages" if isinstance(prompt, list) else "prompt") from None
        else:
            n = len(ids)
        mt = fields.get("max_tokens", 0)
        if n >= limit:
            raise _bad(f"prompt: {n} tokens, which leaves no room in the cache of {limit} "
                       "tokens (prompt + max_tokens)", "prompt")
        if n + mt > limit:
            raise _bad(f"max_tokens={mt} with a prompt of {n} tokens exceeds the cache of "
                       f"{limit} tokens; at most {limit - n}", "max_tokens")

    def submit(prompt, fields: dict):
        from .engine import QueueFull, RequestParams

        check_fits(prompt, fields)
        if st.stopping:
            raise APIError(503, "the server is shutting down", type_="server_error",
                           code="shutting_down")
        try:
            params = RequestParams(**fields)
            if hasattr(params, "validate"):
                params.validate()
            return engine.submit(prompt, params)
        except QueueFull as e:
            raise APIError(429, f"the request queue is full ({e}); retry later",
                           type_="rate_limit_exceeded", code="queue_full") from None
        except ValueError as e:
            raise _bad(str(e), _param_of(str(e))) from None
        except RuntimeError as e:  # the engine is stopped
            raise APIError(503, f"the engine is not running: {e}", type_="server_error",
                           code="engine_stopped") from None

    async def run(request, handle, *, chat: bool, model: str, stream: bool,
                  include_usage: bool):
        endpoint = "chat" if chat else "completions"
        rid = ("chatcmpl-" if chat else "cmpl-") + handle.id
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        pump = _Pump(handle, asyncio.get_running_loop())

        def chunk(delta_text, ids, finish=None, extra=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {} if finish is not None and not delta_text else {"content": delta_text})
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text, "logprobs": None,
                          "finish_reason": finish}
            choice["token_ids"] = ids
            c = {"id": rid, "object": obj, "created": created, "model": model,
                 "choices": [choice]}
            if include_usage:
                c["usage"] = None
            if extra:
                c.update(extra)
            return "data: " + json.dumps(c) + "\n\n"

        def finished(r):
            st.metrics.request_done(endpoint, r.finish_reason, r.latency_s,
                                    r.ttft_s if r.completion_tokens else None)

        if stream:
            async def events():
                done = False
                try:
                    if chat:
                        yield chunk("", [], role=True)
                    while True:
                        kind, item = await pump.queue.get()
                        if kind == "delta":
                            if item.token_ids or item.text:
                                yield chunk(item.text, list(item.token_ids))
                        elif kind == "done":
                            done = True
                            finished(item)
                            if getattr(handle, "error", None) is not None:
                                err = APIError(500, f"generation failed: {handle.error!r}",
                                               type_="server_error")
                                yield "data: " + json.dumps(err.body()) + "\n\n"
                            elif item.finish_reason == "cancelled":
                                err = APIError(503, "the request was cancelled: the server is "
                                               "shutting down", type_="server_error",
                                               code="cancelled")
                                yield "data: " + json.dumps(err.body()) + "\n\n"
                            else:
                                yield chunk("", [], finish=item.finish_reason,
                                            extra={"metrics": _metrics_obj(item)})
                                if include_usage:
                                    u = {"id": rid, "object": obj, "created": created,
                                         "model": model, "choices": [], "usage": _usage(item),
                                         "metrics": _metrics_obj(item)}
                                    yield "data: " + json.dumps(u) + "\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            done = True
                            err = APIError(500, f"generation failed: {item!r}",
                                           type_="server_error")
                            yield "data: " + json.dumps(err.body()) + "\n\n"
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if not done:  # the client went away (the task is being cancelled)
                        handle.cancel()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def disconnected():
            """Returns when the client has gone (uvicorn's receive() after the body)."""
            while (await request.receive())["type"] != "http.disconnect":
                pass

        text, ids = [], []
        gone = asyncio.ensure_future(disconnected())
        try:
            while True:
                get = asyncio.ensure_future(pump.queue.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:  # the client went away: free the slot, answer nobody
                    get.cancel()
                    handle.cancel()
                    return Response(status_code=499)  # nginx's "client closed request"
                kind, item = get.result()
                if kind == "delta":
                    text.append(item.text or "")
                    ids.extend(item.token_ids)
                elif kind == "error":
                    raise APIError(500, f"generation failed: {item!r}", type_="server_error")
                else:
                    break
        except asyncio.CancelledError:
            handle.cancel()
            raise
        finally:
            gone.cancel()
        r = item
        finished(r)
        if getattr(handle, "error", None) is not None:
            raise APIError(500, f"generation failed: {handle.error!r}", type_="server_error")
        if r.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is shutting down",
                           type_="server_error", code="cancelled")
        out_text = r.text if r.text is not None else "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out_text},
                      "logprobs": None, "finish_reason": r.finish_reason}
        else:
            choice = {"index": 0, "text": out_text, "logprobs": None,
                      "finish_reason": r.finish_reason}
        choice["token_ids"] = list(r.token_ids)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else
                             "text_completion", "created": created, "model": model,
                             "choices": [choice], "usage": _usage(r),
                             "metrics": _metrics_obj(r)})

    def stream_flags(body: dict) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad(f"stream must be a boolean, got {stream!r}", "stream")
        return stream, _stream_options(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        model = check_model(body)
        if "prompt" not in body:
            raise _bad("prompt is required", "prompt")
        prompt = parse_completion_prompt(body["prompt"])
        stream, include_usage = stream_flags(body)
        fields = sampling_fields(body, default_max_tokens=16, default_eos=default_eos())
        handle = submit(prompt, fields)
        return await run(request, handle, chat=False, model=model, stream=stream,
                         include_usage=include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        model = check_model(body)
        messages = parse_messages(body.get("messages"))
        stream, include_usage = stream_flags(body)
        if getattr(engine, "tokenizer", None) is None:
            raise _bad("this model has no tokenizer, so it cannot read chat messages; use "
                       "/v1/completions with a prompt of token ids", "messages")
        has_max = body.get("max_tokens") is not None or \
            body.get("max_completion_tokens") is not None
        fields = sampling_fields(body, default_max_tokens=None if has_max else
                                 chat_default_max_tokens(messages), default_eos=default_eos())
        handle = submit(messages, fields)
        return await run(request, handle, chat=True, model=model, stream=stream,
                         include_usage=include_usage)

    @app.get("/v1/models")
    async def models():
        limit = engine_limit(engine)
        return {"object": "list",
                "data": [{"id": n, "object": "model", "created": st.created,
                          "owned_by": "ouroboros-jax", "root": names[0],
                          **({"max_model_len": int(limit)} if limit else {})} for n in names]}

    @app.get("/health")
    async def health():
        running = getattr(engine, "running", True)
        if st.stopping or not running:
            return JSONResponse({"status": "stopping" if st.stopping else "engine stopped"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = render(engine.metrics(), st.metrics, names[0])
        return Response(text, media_type=CONTENT_TYPE)

    @app.exception_handler(404)
    async def _not_found(request, exc):
        return error_response(APIError(404, f"no route {request.method} {request.url.path}",
                                       type_="not_found_error"))

    @app.exception_handler(405)
    async def _bad_method(request, exc):
        return error_response(APIError(405, f"method {request.method} not allowed on "
                                       f"{request.url.path}", type_="invalid_request_error"))

    return app


def _config(app, host: str, port: int, log_level: str, drain_timeout: Optional[float]):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=drain_timeout, access_log=False)


def serve(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          drain_timeout: Optional[float] = 30.0) -> None:
    """Runs the app in the foreground until Ctrl-C / SIGTERM. In-flight requests get up to
    drain_timeout seconds to finish; what is left is then cancelled (streams get an error
    event, clients waiting on non-streamed requests a 503)."""
    import uvicorn

    try:
        uvicorn.Server(_config(app, host, port, log_level, drain_timeout)).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after its shutdown
        pass


class ServerThread:
    """uvicorn serving `app` on a thread of this process (tests, the load bench): the server
    shares this process's compiled functions. port=0 picks a free port; `url` says which.

        with ServerThread(create_app(engine)) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", drain_timeout: Optional[float] = 30.0):
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(_config(app, host, port, log_level, drain_timeout))
        self.host = host
        self.port: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread = threading.Thread(target=self.server.run, daemon=True,
                                        name="uvicorn")
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread died during startup (see its log)")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, cancel: bool = False, timeout: float = 60.0) -> None:
        """Stops serving. cancel=False: new connections are refused and requests in flight
        finish (up to drain_timeout); cancel=True: they are cancelled first."""
        if cancel:
            st = self.app.state.ouroboros
            st.stopping = True
            st.engine.stop(cancel=True, timeout=timeout)
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the server thread did not stop within {timeout} s")

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
