"""The server's gate: what a request must pass before a handler sees it (an ASGI middleware).

In the order checked, each refusal in OpenAI's error body, counted in
`request_errors_total{status}`, and answered with `Connection: close` (the body it did not
read would otherwise be taken for the next request):

- **Host** (421 Misdirected Request): the `Host` header must name this server: the address the
  connection reached, the loopback names when it reached a loopback address, or one of
  `allowed_hosts` (`"*"`: any). A web page that rebinds its own DNS name to 127.0.0.1 still
  sends its own name, so it cannot read the answers (DNS rebinding). 421, not 400: the request
  is well formed; it names an authority this server does not answer for (RFC 9110, 15.5.20).
- **Origin** (403): a browser's cross-origin request carries `Origin`; one that is neither an
  `allowed_origins` entry nor this server's own host is refused, so a web page cannot drive the
  server (CSRF). A CORS preflight from an allowed origin passes on to the CORS middleware.
- **API key** (401): with `api_key` set, every `/v1/...` request needs
  `Authorization: Bearer KEY`; `/health` and `/metrics` stay open (as vLLM's do).
- **Content-Type** (415): a `/v1/...` POST must be `application/json` (a browser cannot send
  that cross-origin without a preflight, which fails without CORS).
- **Body** (413, 408): a `Content-Length` past `max_body_bytes` is refused before any byte is
  read; a chunked body is counted as it arrives and refused once it passes the cap; the whole
  body must arrive within `body_timeout` seconds. A client that leaves mid-upload is logged at
  debug level and counted as a cancelled request (`request_success{finished_reason=
  "cancelled"}`), not as an error.

A refusal's body still on its way is drained before the connection closes (`drain`). Closing
a socket with unread bytes in it makes the kernel answer with a reset, which throws away the
answer the client has not read yet. Most clients (`http.client`, and whatever is built on it)
send the whole body before they read anything, so they would see "connection reset" instead of
the 413. So the refusal's headers and body go out first, with the message kept open; the rest
of the upload is then read and dropped, at most DRAIN_BYTES (or 2 x max_body_bytes if that is
more), DRAIN_SECONDS in all and DRAIN_IDLE_SECONDS between pieces; then the message ends and
uvicorn closes. There is no drain for a body that is declared bigger than that, for a client
that sent `Expect: 100-continue` (it waits for a go-ahead, and the refusal tells it not to
send), or after a 408 (the client is too slow to wait for).

The body is read here, once, then handed to the app as one message, so a handler never waits
on a slow client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
from typing import Optional

from .openai_api import APIError

log = logging.getLogger("ouroboros_jax.serving")

DEFAULT_MAX_BODY_BYTES = 8 * 2 ** 20
DEFAULT_BODY_TIMEOUT = 30.0
# the drain of a refused upload (module docstring): a 60 MB body on one connection is read to
# its end; a client that stops sending, or sends more, is cut off soon
DRAIN_BYTES = 128 * 2 ** 20
DRAIN_SECONDS = 10.0
DRAIN_IDLE_SECONDS = 2.0
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the gate enforces (see the module docstring). max_body_bytes: the largest request
    body; body_timeout: seconds the whole body may take to arrive (None: no limit); api_key:
    the key /v1/ requests must carry (None: none needed); allowed_hosts, allowed_origins:
    names beyond this server's own ("*": any)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: Optional[float] = DEFAULT_BODY_TIMEOUT
    api_key: Optional[str] = None
    allowed_hosts: tuple = ()
    allowed_origins: tuple = ()

    def __post_init__(self):
        m = self.max_body_bytes
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"max_body_bytes must be an integer >= 1, got {m!r}")
        t = self.body_timeout
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool)
                              or not 0 < t < float("inf")):
            raise ValueError(f"body_timeout must be a number of seconds > 0 or None, got {t!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        for name in ("allowed_hosts", "allowed_origins"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"{name} must be a list of non-empty strings, got {v!r}")
            object.__setattr__(self, name, tuple(x.lower() for x in v))


def host_name(value: str) -> str:
    """A Host header's name without its port ("[::1]:8000" -> "::1"), lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _headers(scope) -> dict:
    """The request's headers, names lower case (the last of repeated ones)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _refusal(status: int, message: str, code: str, type_: str = "invalid_request_error",
             param: Optional[str] = None) -> APIError:
    return APIError(status, message, param, type_=type_, code=code)


class Guard:
    """The gate around `app` (see the module docstring); `metrics`: the server's
    `ServerMetrics`, which counts the refusals and the uploads cut short."""

    def __init__(self, app, limits: Limits, metrics, cors: bool = False):
        self.app, self.limits, self.metrics, self.cors = app, limits, metrics, cors

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        err = self.refused(scope, headers)
        if err is None and self.cors and scope["method"] == "OPTIONS" \
                and "access-control-request-method" in headers:
            return await self.app(scope, receive, send)  # a preflight: CORS answers it
        err = err or self.unauthorized(scope, headers)
        if err is not None:
            return await self.reply(send, err, receive if self.may_drain(headers) else None)
        try:
            body = await self.read_body(scope, receive, headers)
        except APIError as e:  # a 408 is not drained: that client is too slow to wait for
            drain = e.status == 413 and self.may_drain(headers)
            return await self.reply(send, e, receive if drain else None)
        if body is None:  # the client left mid-upload: nobody to answer
            return None
        await self.app(scope, _replay(body, receive), send)

    # -- the checks ------------------------------------------------------------------------
    def host_ok(self, scope, name: str) -> bool:
        allowed = self.limits.allowed_hosts
        if "*" in allowed or name in allowed:
            return True
        local = (scope.get("server") or ("",))[0] or ""
        return name == local.lower() or (_is_loopback(local) and name in LOOPBACK_NAMES)

    def refused(self, scope, headers: dict) -> Optional[APIError]:
        """421 for a Host this server is not, 403 for a foreign Origin; None when both pass."""
        host = host_name(headers.get("host", ""))
        if "host" in headers and not self.host_ok(scope, host):
            return _refusal(421, f"the Host {host!r} is not a name this server answers to "
                            "(start it with --allowed-hosts to add one)", "host_not_allowed")
        origin = headers.get("origin")
        if origin is None:
            return None
        allowed = self.limits.allowed_origins
        if "*" in allowed or origin.lower() in allowed:
            return None
        bare = origin.lower().split("://", 1)[-1]
        if "host" in headers and bare == headers["host"].strip().lower():  # same origin
            return None
        return _refusal(403, f"cross-origin requests from {origin!r} are refused (start the "
                        "server with --allowed-origins to allow one)", "origin_not_allowed",
                        type_="permission_error")

    def unauthorized(self, scope, headers: dict) -> Optional[APIError]:
        """401 without the API key, 415 for a /v1/ POST that is not JSON; None otherwise."""
        path = scope["path"]
        if not (path == "/v1" or path.startswith("/v1/")):
            return None
        key = self.limits.api_key
        if key is not None:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                return _refusal(401, "a valid API key is required: send the header "
                                "'Authorization: Bearer KEY'", "invalid_api_key")
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            return _refusal(415, f"the request body must be application/json, got "
                            f"{media or 'no Content-Type'!r}", "unsupported_media_type")
        return None

    async def read_body(self, scope, receive, headers: dict) -> Optional[bytes]:
        """The whole body (b"" when there is none); None when the client left first;
        APIError 413 past the cap, 408 past the time limit."""
        cap = self.limits.max_body_bytes
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > cap:
            raise self.too_large(int(length))
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                return await self._receive_all(scope, receive, cap)
        except TimeoutError:
            raise _refusal(408, f"the request body did not arrive within "
                           f"{self.limits.body_timeout:g} s", "body_timeout") from None

    async def _receive_all(self, scope, receive, cap: int) -> Optional[bytes]:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.left(scope, size)
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise self.too_large(None)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def too_large(self, length: Optional[int]) -> APIError:
        size = f"{length} bytes" if length is not None else "more"
        return _refusal(413, f"the request body is {size}; this server takes at most "
                        f"{self.limits.max_body_bytes} (--max-body-bytes)", "body_too_large")

    def left(self, scope, size: int) -> None:
        """A client that disconnected mid-upload: a cancelled request, not a server error."""
        log.debug("client left mid-upload: %s %s after %d bytes", scope["method"],
                  scope["path"], size)
        self.metrics.cancelled(_ENDPOINTS.get(scope["path"], scope["path"]))

    # -- the refusal -----------------------------------------------------------------------
    def drain_bytes(self) -> int:
        return max(DRAIN_BYTES, 2 * self.limits.max_body_bytes)

    def may_drain(self, headers: dict) -> bool:
        """Whether a refused request may still be sending a body worth reading to its end
        (see the module docstring)."""
        if headers.get("expect", "").strip().lower() == "100-continue":
            return False
        length = headers.get("content-length", "").strip()
        if length.isdigit():
            return 0 < int(length) <= self.drain_bytes()
        return "chunked" in headers.get("transfer-encoding", "").lower()

    async def reply(self, send, e: APIError, receive=None) -> None:
        """Answers the refusal `e` and closes the connection; with `receive`, the body still
        on its way is drained first (`drain`)."""
        self.metrics.error(e.status)
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        # the whole answer is on the wire now; ending the message is what makes uvicorn close
        # the connection (and stop giving us the request's body), so that waits for the drain
        await send({"type": "http.response.body", "body": body,
                    "more_body": receive is not None})
        if receive is not None:
            await self.drain(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def drain(self, receive) -> int:
        """Reads and drops the request's body until it ends, the client leaves, or a bound
        is reached (drain_bytes(), DRAIN_SECONDS, DRAIN_IDLE_SECONDS); -> the bytes dropped."""
        loop = asyncio.get_running_loop()
        deadline, dropped = loop.time() + DRAIN_SECONDS, 0
        while dropped <= self.drain_bytes():
            left = min(deadline - loop.time(), DRAIN_IDLE_SECONDS)
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    message = await receive()
            except TimeoutError:
                break
            dropped += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        return dropped


def _replay(body: bytes, receive):
    """An ASGI receive that gives the body read once, then the connection's own messages
    (a handler waiting for the client to go away still hears it)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
