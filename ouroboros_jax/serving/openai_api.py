"""OpenAI's wire format, with no engine state: request bodies -> prompts and RequestParams
fields, results -> response objects and server-sent-event chunks, errors -> OpenAI's error
body. Pure functions, so each is testable on its own; `server.py` wires them to an engine.

What a field may hold is checked once, in `request.py` (`RequestParams`, `check_stops`,
`check_fits`); here only what OpenAI's format adds: its field names (`max_completion_tokens`),
its defaults (temperature 1, a random seed), vLLM's `top_k=-1` and `ignore_eos`, its range for
temperature ([0, 2]), `logprobs` / `top_logprobs` (chat: a bool and 0..20; completions: 0..20),
`n` (choices, each its own engine request), `stop` (at most MAX_STOP_STRINGS strings of at most
MAX_STOP_CHARS characters), the message roles (KNOWN_ROLES), the `speculation` switch ("on" /
"off") and the fields this server refuses rather than ignore. The logprob objects of responses are
`openai_logprobs.py`'s.
"""


from __future__ import annotations

import json
import secrets
from typing import Any, Optional

from ..request import MAX_TOP_LOGPROBS, check_stops, is_real

# Fields refused with 400: (name, test that the value asks for something unsupported, why)
UNSUPPORTED = (
    ("best_of", lambda v: v not in (None, 1), "best_of is not supported"),
    ("echo", lambda v: bool(v), "echo is not supported"),
    ("suffix", lambda v: v not in (None, ""), "suffix (insertion) is not supported"),
    ("presence_penalty", lambda v: v not in (None, 0, 0.0),
     "presence_penalty is not supported (it would change the target's distribution)"),
    ("frequency_penalty", lambda v: v not in (None, 0, 0.0),
     "frequency_penalty is not supported (it would change the target's distribution)"),
    ("repetition_penalty", lambda v: v not in (None, 1, 1.0), "repetition_penalty is not supported"),
    ("logit_bias", lambda v: bool(v), "logit_bias is not supported"),
    ("tools", lambda v: bool(v), "tools are not supported"),
    ("functions", lambda v: bool(v), "functions are not supported"),
)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_CHOICES = 32  # n: each choice takes a slot of its own
# stop: every stop string is searched for in each step's new text, and the text that could
# still begin one (its length - 1 characters) is held back from the stream, so both the count
# and the length are bounded (OpenAI takes 4 strings; these are far past what clients send)
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
# the roles of OpenAI's chat messages; a chat template renders any string it is given, so an
# unknown role would reach the model as a turn it was never trained on
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


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


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param, code=code)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _brief(v, limit: int = 40) -> str:
    """repr(v) cut to `limit` characters: an error message never echoes a huge value."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def parse_body(raw: bytes) -> dict:
    """A request's bytes -> its JSON object; 400 (code invalid_json) otherwise: not JSON, not
    UTF-8, nested past Python's recursion limit, an integer past its digit limit."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise bad(f"the request body is not valid JSON: {type(e).__name__}: {e}",
                  code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def parse_completion_prompt(p) -> Any:
    """OpenAI's `prompt` (a string, a list of one string, token ids, or a list of one id
    list) -> a string or a list of ids. Batched prompts are refused: one request, one prompt."""
    if isinstance(p, str):
        if not p:
            raise bad("prompt is empty", "prompt")
        return p
    if isinstance(p, list) and p:
        if all(_is_int(t) for t in p):
            return [int(t) for t in p]
        if len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
            return parse_completion_prompt(p[0])
        if all(isinstance(x, (str, list)) for x in p):
            raise bad("prompt: batched prompts are not supported; send one prompt per "
                      "request (they are batched on the server anyway)", "prompt")
    raise bad("prompt must be a non-empty string, a list of token ids, or a list of one of "
              f"those; got {type(p).__name__}", "prompt")


def _content(i: int, c) -> str:
    """A message's content: a string, or text parts joined; 400 for any other part."""
    if c is None:
        return ""
    if isinstance(c, list):
        if not all(isinstance(part, dict) and part.get("type") == "text"
                   and isinstance(part.get("text"), str) for part in c):
            raise bad(f"messages[{i}].content: only text parts are supported", "messages")
        c = "".join(part["text"] for part in c)
    if not isinstance(c, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return c


def parse_messages(msgs) -> list[dict]:
    """OpenAI's `messages` -> [{"role", "content": str}] (content parts of type "text" joined;
    any other part type refused)."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        if m["role"] not in KNOWN_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(KNOWN_ROLES)}; got "
                      f"{_brief(m['role'])}", f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(i, m.get("content"))})
    return out


def stop_strings(stop) -> tuple:
    """OpenAI's `stop` (a string, a list of strings, or null) -> RequestParams.stop; 400
    naming `stop` past MAX_STOP_STRINGS strings or MAX_STOP_CHARS characters in one."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise bad(f"stop must be a string or a list of strings, got {type(stop).__name__}",
                  "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise bad(f"stop[{i}] must be a non-empty string, got {_brief(s)}", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise bad(f"stop[{i}] is {len(s)} characters long; at most {MAX_STOP_CHARS}",
                      "stop")
    return tuple(stop)


def _stop_ids(body: dict, default_eos: tuple) -> Optional[tuple]:
    """stop_token_ids (vLLM: added to the model's EOS ids unless ignore_eos) -> the request's
    stop ids (None: the model's own)."""
    ids = body.get("stop_token_ids")
    try:
        check_stops(ids if ids is None else tuple(ids) if isinstance(ids, list) else ids, ())
    except ValueError as e:
        raise bad(str(e), "stop_token_ids") from None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad(f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    if ignore_eos:
        return tuple(ids or ())
    if ids:
        return tuple(dict.fromkeys(tuple(default_eos) + tuple(ids)))
    return None


def logprob_count(body: dict, chat: bool) -> Optional[int]:
    """The body's logprobs fields -> RequestParams.logprobs (None: none; else the top tokens
    per position). Chat: `logprobs` a bool, `top_logprobs` 0..20 (only with logprobs);
    completions: `logprobs` 0..20."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    rng = f"[0, {MAX_TOP_LOGPROBS}]"
    if not chat:
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise bad(f"logprobs must be an integer in {rng} (top tokens per position), got "
                      f"{lp!r}", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"logprobs must be a boolean, got {lp!r}", "logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad(f"top_logprobs must be an integer in {rng}, got {top!r}", "top_logprobs")
    if top and not lp:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None


def choice_count(body: dict) -> int:
    """`n`: the choices asked for (1 when absent); 400 naming it otherwise."""
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise bad(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    return n


def speculation_of(body: dict) -> bool:
    """The `speculation` extension ("on", default, or "off": plain decoding for this request,
    the same output) -> RequestParams.speculation."""
    v = body.get("speculation")
    if v not in (None, "on", "off"):
        raise bad(f"speculation must be \"on\" or \"off\", got {v!r}", "speculation")
    return v != "off"


def sampling_fields(body: dict, *, default_max_tokens: Optional[int],
                    default_eos: tuple, chat: bool = False) -> dict:
    """The sampling fields of a request body -> keyword arguments of RequestParams (which
    checks each value, naming it); the fields refused, OpenAI's defaults and vLLM's extensions
    applied here. default_eos: the model's EOS ids, which `stop_token_ids` adds to; chat: the
    body is a chat completion's (its logprobs fields differ)."""
    for name, asks, why in UNSUPPORTED:
        if asks(body.get(name)):
            raise bad(why, name, code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if is_real(temperature) and temperature > MAX_TEMPERATURE:
        raise bad(f"temperature must be in [0, {MAX_TEMPERATURE}], got {temperature}",
                  "temperature")
    top_k = body.get("top_k")
    seed = body.get("seed")
    out = dict(temperature=temperature,
               top_p=1.0 if body.get("top_p") is None else body["top_p"],
               top_k=0 if top_k in (None, -1) else top_k,  # vLLM's -1 = off
               seed=secrets.randbits(31) if seed is None else seed,  # no seed: not reproducible
               stop_token_ids=_stop_ids(body, default_eos),
               stop=stop_strings(body.get("stop")),
               logprobs=logprob_count(body, chat), speculation=speculation_of(body),
               response_format=body.get("response_format"))
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


def param_name(field: str, body: dict, chat: bool) -> str:
    """The body field a RequestParams field stands for in this request."""
    if field == "max_tokens" and "max_completion_tokens" in body:
        return "max_completion_tokens"
    if field == "prompt" and chat:
        return "messages"
    return field


def stream_flags(body: dict) -> tuple[bool, bool]:
    """-> (stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {stream!r}", "stream")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise bad("stream_options must be an object like {\"include_usage\": true}",
                  "stream_options")
    if not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    return stream, bool(so.get("include_usage", False))


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


def usage(*results) -> dict:
    """The usage of one request's choices: the prompt once, their completion tokens summed."""
    prompt = results[0].prompt_tokens
    done = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def merged_spec(specs: list) -> dict:
    """Several choices' RequestResult.spec -> one: histograms and token counts summed, the
    mean acceptance length over all their rounds."""
    if len(specs) == 1:
        return specs[0]
    hist = [sum(col) for col in zip(*(s["acceptance_histogram"] for s in specs))]
    rounds = sum(hist)
    out = {k: sum(s[k] for s in specs) for k in ("draft_tokens", "accepted_tokens")}
    if "accepted_by_source" in specs[0]:
        out["accepted_by_source"] = {k: sum(s["accepted_by_source"][k] for s in specs)
                                     for k in specs[0]["accepted_by_source"]}
    return dict(out, acceptance_histogram=hist, mean_acceptance_length=(
        sum(j * c for j, c in enumerate(hist)) / rounds if rounds else 0.0))


def metrics_obj(*results) -> dict:
    """The response's `metrics`: the speculative figures of its choices (merged), its first
    token's time and its last choice's latency."""
    return {"speculative_decoding": spec_figures(merged_spec([r.spec for r in results])),
            "time_to_first_token_s": min(r.ttft_s for r in results),
            "latency_s": max(r.latency_s for r in results)}


def sse(obj) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def chunk(meta: dict, chat: bool, text: str, ids: list, finish: Optional[str] = None,
          extra: Optional[dict] = None, role: bool = False, include_usage: bool = False,
          index: int = 0, logprobs: Optional[dict] = None) -> str:
    """One streamed chunk (an SSE event) of choice `index` of a completion (`meta`: id,
    object, created, model); logprobs: its tokens' (`openai_logprobs`), or None."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else (
            {} if finish is not None and not text else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    choice["token_ids"] = ids
    c = dict(meta, choices=[choice])
    if include_usage:
        c["usage"] = None
    if extra:
        c.update(extra)
    return sse(c)


def completion(meta: dict, chat: bool, results: list, texts: list,
               logprobs: Optional[list] = None) -> dict:
    """The whole (non-streamed) response for finished requests, one choice each (their
    texts; logprobs: each one's object, `openai_logprobs`, or None)."""
    choices = []
    for i, (r, text) in enumerate(zip(results, texts)):
        lp = None if logprobs is None else logprobs[i]
        if chat:
            choice = {"index": i, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": r.finish_reason}
        else:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": r.finish_reason}
        choice["token_ids"] = list(r.token_ids)
        choices.append(choice)
    return dict(meta, object="chat.completion" if chat else "text_completion",
                choices=choices, usage=usage(*results), metrics=metrics_obj(*results))
