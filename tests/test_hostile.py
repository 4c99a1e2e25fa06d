"""Hostile clients against the OpenAI server (serving/guard.py, pump.py, runner.py): oversized,
endless, malformed and abandoned bodies, missing keys, foreign hosts and origins, HEAD, a
shutdown past its drain time, and fields past their bounds (stop strings, message roles). After
each case the server must still be healthy: /health answers, and the greedy request every test
sends first and last gets the same text.

Servers run with uvicorn on 127.0.0.1 in a thread of this process (`ServerThread`) over one
engine (the tiny chat pair, vanilla) that every app shares (manage_engine=False); the shutdown
case runs `ouroboros-jax serve` in a process of its own. Raw sockets send what no client
library would (headers with no body, a chunked body that never ends, a half upload).
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import requests

import ouroboros_jax as oj
from ouroboros_jax.serving.engine import Engine
from ouroboros_jax.serving import guard
from ouroboros_jax.serving.guard import DEFAULT_MAX_BODY_BYTES, Limits, host_name
from ouroboros_jax.serving.openai_api import KNOWN_ROLES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from ouroboros_jax.serving.server import ServerThread, create_app

MODEL = "tiny"
KEY = "sekrit-key"
GREEDY = dict(model=MODEL, prompt="hello there", max_tokens=12, temperature=0)
MB = 2 ** 20


@pytest.fixture(scope="module")
def engine(tiny_chat_pair):
    e = Engine(tiny_chat_pair[0], method="vanilla", slots=4, max_cache_len=512)
    e.start()
    yield e
    e.stop(cancel=True)


def _thread(engine, **kw):
    return ServerThread(create_app(engine, model_names=[MODEL], manage_engine=False, **kw))


@pytest.fixture(scope="module")
def plain(engine):
    """Default limits but a short body timeout."""
    srv = _thread(engine, body_timeout=1.5).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(engine):
    """An API key, a named host, an allowed origin and the docs."""
    srv = _thread(engine, api_key=KEY, allowed_hosts=["serve.example"],
                  allowed_origins=["http://app.example"], docs=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(plain):
    """The greedy text before any hostile case (what every check after one must get)."""
    return _greedy(plain.url)


def _greedy(url: str, key: str = "-") -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    return c.completions.create(**GREEDY).choices[0].text


def healthy(srv, baseline, key: str = "-") -> None:
    """The check after every hostile case."""
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert _greedy(srv.url, key) == baseline


def _raw(srv, data: bytes, timeout: float = 20.0) -> bytes:
    """Sends data on a fresh connection, says it sends no more (so the server does not wait
    for the rest of a refused body, guard.py's drain) and reads until the server closes it."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return _read_to_close(s, timeout)


def _read_to_close(s, timeout: float) -> bytes:
    out, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            got = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not got:
            break
        out += got
    return out


def _status_and_error(resp: bytes) -> tuple[int, dict, bytes]:
    """A raw HTTP response -> (status, its JSON error object, its header block lower case)."""
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"], head.lower()


def _post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n").encode()


def _prom(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, v = line.rsplit(" ", 1)
            out[name] = float(v)
    return out


CANCELLED = 'ouroboros:request_success_total{endpoint="completions",finished_reason="cancelled"}'
ERR500 = 'ouroboros:request_errors_total{status="500"}'


class HealthPoller:
    """GET /health every 20 ms on a thread until stopped (at most `limit` s): the slowest
    answer and how many there were."""

    def __init__(self, url: str, limit: float = 180.0):
        self.url, self.limit, self.times, self.failures = url, limit, [], []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t_end = time.monotonic() + self.limit
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set() and time.monotonic() < t_end:
                t0 = time.perf_counter()
                try:
                    ok = c.get(self.url + "/health").status_code == 200
                except httpx.HTTPError as e:
                    ok = False
                    self.failures.append(repr(e))
                self.times.append(time.perf_counter() - t0)
                if not ok:
                    self.failures.append("status")
                time.sleep(0.02)

    def __enter__(self):
        self._t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


# -- 1. nothing slow on the event loop ------------------------------------------------------

def test_health_stays_fast_while_huge_prompts_are_refused(plain, baseline):
    """/health answers in < 0.5 s while a 4 MB text prompt of the demo pair is tokenized (on a
    worker thread, 2M tokens) and refused as longer than the cache, and while a 16 MB body is
    refused by the default cap (413, from its headers: no byte of it is read). (4 MB, not 16:
    16 MB takes ~1 GB and ~20 s to tokenize, which this shared test machine cannot spare.)"""
    target, _ = oj.demo_pair()
    demo_engine = Engine(target, method="vanilla", slots=1, max_cache_len=256)
    demo = ServerThread(create_app(demo_engine, model_names=["demo"], manage_engine=False,
                                   max_body_bytes=32 * MB)).start()
    try:
        with HealthPoller(demo.url) as hp:
            t0 = time.monotonic()
            r = httpx.post(demo.url + "/v1/completions", timeout=300,
                           json=dict(model="demo", prompt="abcd efgh " * (4 * MB // 10),
                                     max_tokens=4))
            took = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "leaves no room" in r.json()["error"]["message"]
        assert not hp.failures
        # polled all along the tokenization, never kept waiting
        assert len(hp.times) >= took / 0.55 and max(hp.times) < 0.5, (took, max(hp.times))
    finally:
        demo.stop()
    with HealthPoller(plain.url) as hp:
        refused = _raw(plain, _post_head("/v1/completions", f"Content-Length: {16 * MB}\r\n"))
    assert _status_and_error(refused)[0] == 413
    assert not hp.failures and max(hp.times) < 0.5
    healthy(plain, baseline)


def test_16mb_body_under_a_raised_cap_is_admitted(engine, baseline):
    """A 16 MB body (a short prompt, a 16 MB `user` field) under max_body_bytes=20 MB: parsed
    off the loop, answered exactly, /health fast all along."""
    srv = _thread(engine, max_body_bytes=20 * MB).start()
    try:
        with HealthPoller(srv.url) as hp:
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json=dict(GREEDY, user="u" * (16 * MB)))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline
        assert not hp.failures and max(hp.times) < 0.5
    finally:
        srv.stop()


def test_chat_template_rendered_once_off_the_event_loop(plain, baseline, engine, monkeypatch):
    tok = engine.tokenizer
    calls = []
    real = tok.apply_chat_template

    def counted(*a, **kw):
        calls.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    c = openai.OpenAI(base_url=plain.url + "/v1", api_key="-", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert len(calls) == 1, calls  # once per request
    assert calls[0] != "uvicorn", calls  # not on the event loop's thread (ServerThread's)
    healthy(plain, baseline)


# -- 2. limits ----------------------------------------------------------------------------------

def test_content_length_past_the_cap_413_before_any_byte_is_read(plain, baseline):
    status, err, head = _status_and_error(_raw(plain, _post_head(
        "/v1/completions", f"Content-Length: {DEFAULT_MAX_BODY_BYTES + 1}\r\n")))
    assert status == 413 and err["code"] == "body_too_large"
    assert "--max-body-bytes" in err["message"] and err["type"] == "invalid_request_error"
    assert b"connection: close" in head
    healthy(plain, baseline)


def test_chunked_body_past_the_cap_413(engine, baseline):
    cap = 64 * 1024
    srv = _thread(engine, max_body_bytes=cap).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
            s.sendall(_post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"))
            piece = b"x" * 4096
            for _ in range(cap // len(piece) + 1):  # one piece past the cap, never the end
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            s.shutdown(socket.SHUT_WR)  # no more: the server's drain of the rest ends at once
            status, err, head = _status_and_error(_read_to_close(s, 20))
        assert status == 413 and err["code"] == "body_too_large"
        assert b"connection: close" in head
        healthy(srv, baseline)
    finally:
        srv.stop()


ERR413 = 'ouroboros:request_errors_total{status="413"}'


@pytest.mark.parametrize("size", [12 * MB, 60 * MB], ids=["12MB", "60MB"])
def test_body_past_the_cap_sent_whole_gets_its_413(plain, baseline, size):
    """A body past --max-body-bytes (8 MiB), sent in one piece by ordinary clients. Each
    writes the whole body before it reads, so a server that closed with the body unread reset
    the connection under them and they never saw the 413 (http.client: ConnectionResetError or
    BrokenPipeError); guard.py drains the body first."""
    before = _prom(plain.url).get(ERR413, 0)
    payload = json.dumps(dict(GREEDY, user="u" * size)).encode()
    conn = http.client.HTTPConnection("127.0.0.1", plain.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=payload,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        status, closes, err = r.status, r.getheader("connection"), json.loads(r.read())["error"]
    finally:
        conn.close()
    assert status == 413 and closes == "close" and err["code"] == "body_too_large"
    assert f"{len(payload)} bytes" in err["message"] and "--max-body-bytes" in err["message"]
    r = requests.post(plain.url + "/v1/completions", data=payload, timeout=60,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    c = openai.OpenAI(base_url=plain.url + "/v1", api_key="-", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(**GREEDY, user="u" * size)
    assert e.value.status_code == 413 and e.value.body["code"] == "body_too_large"
    assert _prom(plain.url)[ERR413] == before + 3
    healthy(plain, baseline)


def _read_answer(s, timeout: float = 20.0) -> bytes:
    """One response, its headers and its Content-Length of body, not waiting for a close."""
    buf, t_end = b"", time.monotonic() + timeout
    while True:
        head, sep, body = buf.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:"))
            if len(body) >= length:
                return buf
        assert time.monotonic() < t_end, "no whole answer in time"
        got = s.recv(65536)
        assert got, f"closed before the whole answer came: {buf!r}"
        buf += got


def test_413_comes_before_the_body_which_is_then_drained(plain, baseline):
    """The answer is on the wire before any byte of the body; the body sent after it is read
    to its end, and the connection then closes in order (a FIN, not a reset)."""
    n = DEFAULT_MAX_BODY_BYTES + 1
    with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
        s.sendall(_post_head("/v1/completions", f"Content-Length: {n}\r\n"))
        status, err, head = _status_and_error(_read_answer(s))
        assert status == 413 and err["code"] == "body_too_large"
        assert b"connection: close" in head
        s.sendall(b"x" * n)
        assert s.recv(1) == b""  # a reset would raise ConnectionResetError here
    healthy(plain, baseline)


@pytest.fixture
def patient_drain(monkeypatch):
    """The drain's time bounds raised to 30 s each, so a test sees which bound ended it."""
    monkeypatch.setattr(guard, "DRAIN_SECONDS", 30.0)
    monkeypatch.setattr(guard, "DRAIN_IDLE_SECONDS", 30.0)
    return monkeypatch


def _closed_within(s, seconds: float) -> float:
    """Waits (reading and dropping) for the server to close; -> how long that took."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    while True:
        try:
            if not s.recv(65536):
                break
        except ConnectionResetError:
            break
    return time.monotonic() - t0


def test_no_drain_past_its_bounds(plain, baseline, patient_drain):
    """No drain for a body declared bigger than the drain takes, nor for a client that sent
    `Expect: 100-continue` (it sends nothing until told to): closed at once, not after 30 s."""
    cases = (f"Content-Length: {guard.DRAIN_BYTES + 2 * DEFAULT_MAX_BODY_BYTES + 1}\r\n",
             f"Content-Length: {DEFAULT_MAX_BODY_BYTES + 1}\r\nExpect: 100-continue\r\n")
    for extra in cases:
        with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
            s.sendall(_post_head("/v1/completions", extra))
            answer = _read_answer(s)
            assert _closed_within(s, 20) < 10, extra
        assert _status_and_error(answer)[0] == 413 and b"100 continue" not in answer.lower()
    healthy(plain, baseline)


def test_drain_ends_at_its_idle_time_total_time_and_bytes(plain, baseline, patient_drain):
    """Each bound alone ends a drain: a client that goes quiet (DRAIN_IDLE_SECONDS), one that
    trickles (DRAIN_SECONDS), one that sends without end (DRAIN_BYTES: the server closes while
    the client is still writing)."""
    head = _post_head("/v1/completions", f"Content-Length: {DEFAULT_MAX_BODY_BYTES + 1}\r\n")
    patient_drain.setattr(guard, "DRAIN_IDLE_SECONDS", 0.5)
    with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
        s.sendall(head)
        _read_answer(s)
        assert 0.3 < _closed_within(s, 20) < 10
    patient_drain.setattr(guard, "DRAIN_IDLE_SECONDS", 30.0)
    patient_drain.setattr(guard, "DRAIN_SECONDS", 1.0)
    with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
        s.sendall(head)
        _read_answer(s)
        t0, closed = time.monotonic(), False
        while not closed and time.monotonic() - t0 < 15:
            s.sendall(b"x")
            s.settimeout(0.1)
            try:
                closed = s.recv(65536) == b""
            except socket.timeout:
                pass
        assert closed and time.monotonic() - t0 < 10
    patient_drain.setattr(guard, "DRAIN_SECONDS", 30.0)
    patient_drain.setattr(guard, "DRAIN_BYTES", 0)  # the floor: 2 x the 8 MiB cap
    sent, piece = 0, b"%x\r\n%s\r\n" % (MB, b"x" * MB)
    with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
        s.sendall(_post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"))
        with pytest.raises(OSError):  # reset or broken pipe: the server stopped reading
            while sent < 256 * MB:
                s.sendall(piece)
                sent += len(piece)
    # the cap, the drain's 16 MiB, and what the two sockets' buffers hold
    assert sent < 8 * MB + 16 * MB + 24 * MB, sent
    healthy(plain, baseline)


def test_body_that_never_ends_408_and_connection_closed(plain, baseline):
    with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
        s.sendall(_post_head("/v1/completions", "Transfer-Encoding: chunked\r\n")
                  + b"5\r\n{\"a\":\r\n")
        t0 = time.monotonic()
        resp = _read_to_close(s, 20)  # returns when the server closes the connection
        waited = time.monotonic() - t0
    status, err, head = _status_and_error(resp)
    assert status == 408 and err["code"] == "body_timeout"
    assert b"connection: close" in head and waited < 15  # closed, not left open to the 20 s
    healthy(plain, baseline)


@pytest.mark.parametrize("body", [b"[" * 200000, b'{"a":' * 100000 + b"1" + b"}" * 100000,
                                  b'{"prompt": ' + b"9" * 5000 + b"}",
                                  b'{"prompt": "\xff\xfe"}', b"not json"],
                         ids=["deep-array", "deep-object", "int-digits", "bad-utf8", "text"])
def test_json_failures_are_400(plain, baseline, body):
    before = _prom(plain.url).get(ERR500, 0)
    r = httpx.post(plain.url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert _prom(plain.url).get(ERR500, 0) == before
    healthy(plain, baseline)


def test_client_leaving_mid_upload_is_cancelled_not_500(plain, baseline, caplog):
    before = _prom(plain.url)
    with caplog.at_level("DEBUG", logger="ouroboros_jax.serving"):
        with socket.create_connection(("127.0.0.1", plain.port), timeout=20) as s:
            s.sendall(_post_head("/v1/completions", "Content-Length: 1000\r\n") + b'{"a": ')
            time.sleep(0.3)
        t_end = time.monotonic() + 20
        while _prom(plain.url).get(CANCELLED, 0) == before.get(CANCELLED, 0):
            assert time.monotonic() < t_end, "the abandoned upload was not counted"
            time.sleep(0.05)
    after = _prom(plain.url)
    assert after[CANCELLED] == before.get(CANCELLED, 0) + 1
    assert after.get(ERR500, 0) == before.get(ERR500, 0)
    assert any("mid-upload" in r.getMessage() and r.levelname == "DEBUG" for r in caplog.records)
    healthy(plain, baseline)


def test_limits_checked_by_name():
    assert Limits().max_body_bytes == 8 * MB
    for kw, name in ((dict(max_body_bytes=0), "max_body_bytes"),
                     (dict(body_timeout=0), "body_timeout"), (dict(api_key=""), "api_key"),
                     (dict(allowed_hosts="a.example"), "allowed_hosts")):
        with pytest.raises(ValueError, match=name):
            Limits(**kw)
    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost:80") == "localhost"
    assert host_name("::1") == "::1" and host_name("a.example") == "a.example"


# -- 3. access ----------------------------------------------------------------------------------

def test_api_key_required_on_v1_only(keyed, baseline):
    c = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(**GREEDY)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for r in (httpx.get(keyed.url + "/v1/models", timeout=10),  # no key at all
              httpx.post(keyed.url + "/v1/completions", json=GREEDY, timeout=10),
              httpx.get(keyed.url + "/v1/models", headers={"authorization": KEY})):  # no Bearer
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
    assert httpx.get(keyed.url + "/metrics", timeout=10).status_code == 200
    healthy(keyed, baseline, key=KEY)


def test_api_key_from_the_environment(monkeypatch):
    import argparse

    from ouroboros_jax.cli import _serve_gate

    a = argparse.Namespace(max_body_bytes=MB, body_timeout=5.0, api_key=None, docs=False,
                           allowed_hosts="a.example, b.example", allowed_origins=None)
    monkeypatch.setenv("OUROBOROS_JAX_API_KEY", "from-env")
    gate = _serve_gate(a)
    assert gate["api_key"] == "from-env" and gate["allowed_hosts"] == ["a.example", "b.example"]
    with pytest.raises(ValueError, match="--max-body-bytes"):
        _serve_gate(argparse.Namespace(**dict(vars(a), max_body_bytes=0)))
    with pytest.raises(ValueError, match="--body-timeout"):
        _serve_gate(argparse.Namespace(**dict(vars(a), body_timeout=-1.0)))


def test_foreign_host_refused_421(plain, keyed, baseline):
    for path in ("/v1/models", "/metrics", "/health"):
        r = httpx.get(plain.url + path, headers={"host": "evil.example:8000"}, timeout=10)
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", path
    # the issue's probe: a browser's cross-origin text/plain POST under a rebound name
    r = httpx.post(plain.url + "/v1/completions", content=json.dumps(GREEDY), timeout=10,
                   headers={"host": "evil.example:8000", "origin": "http://evil.example:8000",
                            "content-type": "text/plain"})
    assert r.status_code == 421
    for host in ("localhost", f"127.0.0.1:{plain.port}", f"[::1]:{plain.port}"):
        assert httpx.get(plain.url + "/health", headers={"host": host}).status_code == 200
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/v1/models", headers=dict(auth, host="serve.example"),
                     timeout=10).status_code == 200
    assert httpx.get(plain.url + "/health", headers={"host": "serve.example"}).status_code == 421
    healthy(plain, baseline)


def test_cross_origin_requests_and_cors(plain, keyed, baseline):
    # same Host, foreign Origin: refused, and no CORS header lets a page read it
    r = httpx.post(plain.url + "/v1/completions", json=GREEDY, timeout=10,
                   headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = httpx.post(plain.url + "/v1/completions", content=json.dumps(GREEDY), timeout=10,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    # the allowed origin: its preflight is answered, its request gets the CORS header
    pre = httpx.options(keyed.url + "/v1/completions", timeout=10, headers={
        "origin": "http://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.post(keyed.url + "/v1/completions", json=GREEDY, timeout=60, headers={
        "origin": "http://app.example", "authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(keyed.url + "/v1/completions", timeout=10, headers={
        "origin": "http://evil.example", "access-control-request-method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    healthy(plain, baseline)


def test_docs_only_when_asked(plain, keyed, baseline):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(plain.url + path, timeout=10).status_code == 404, path
        assert httpx.get(keyed.url + path, timeout=10).status_code == 200, path
    healthy(plain, baseline)


# -- 5. HEAD ------------------------------------------------------------------------------------

def test_head_wherever_get(plain, keyed, baseline):
    for path in ("/health", "/v1/models", "/metrics"):
        r = httpx.head(plain.url + path, timeout=10)
        assert r.status_code == 200 and r.content == b"", path
    r = httpx.head(keyed.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert httpx.head(keyed.url + "/v1/models").status_code == 401
    healthy(plain, baseline)


# -- 6. fields past their bounds ---------------------------------------------------------------

def test_stop_strings_bounded_400_naming_stop(plain, baseline):
    """Too many stop strings, or one too long, get a 400 naming `stop` (each is searched for at
    every step, and a long one holds back the stream); the message never echoes the value.
    At the bounds, the stop strings still cut the text."""
    c = openai.OpenAI(base_url=plain.url + "/v1", api_key="-", max_retries=0, timeout=60)
    never = [f"{i:02d}" + "\x01" * (MAX_STOP_CHARS - 2) for i in range(MAX_STOP_STRINGS)]
    for stop, says in ((never + ["x"], f"holds {MAX_STOP_STRINGS + 1} strings"),
                       ([f"s{i}" for i in range(20000)], "holds 20000 strings"),
                       ("s" * (MAX_STOP_CHARS + 1), f"stop[0] is {MAX_STOP_CHARS + 1} char"),
                       (["ok", "s" * (2 * MB)], f"stop[1] is {2 * MB} char"),
                       (["ok", 7], "stop[1] must be a non-empty string"),
                       ({"a": "b"}, "a string or a list of strings")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**GREEDY, stop=stop)
        err = e.value.body
        assert err["param"] == "stop" and says in err["message"], err
        assert len(err["message"]) < 200
    assert len(baseline) >= 4, baseline
    cut = baseline[len(baseline) // 2:][:2]
    at_bounds = never[:-1] + [cut]  # MAX_STOP_STRINGS, all but one MAX_STOP_CHARS long
    r = c.completions.create(**GREEDY, stop=at_bounds)
    assert r.choices[0].text == baseline[:baseline.index(cut)]
    assert r.choices[0].finish_reason == "stop"
    healthy(plain, baseline)


def test_unknown_role_400_naming_it(plain, baseline):
    """A message role that is not OpenAI's gets a 400 naming `messages[i].role`; OpenAI's
    roles pass the check."""
    c = openai.OpenAI(base_url=plain.url + "/v1", api_key="-", max_retries=0, timeout=60)
    chat = dict(model=MODEL, max_tokens=4, temperature=0)
    for role, says in (("hacker", "'hacker'"), ("u" * MB, "characters)")):
        msgs = [{"role": "system", "content": "be brief"}, {"role": role, "content": "hi"}]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(messages=msgs, **chat)
        err = e.value.body
        assert err["param"] == "messages[1].role" and says in err["message"], err
        assert "user" in err["message"] and len(err["message"]) < 200
    for role in KNOWN_ROLES:  # the tiny chat template renders any role
        msgs = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
        r = c.chat.completions.create(messages=msgs, **chat)
        assert r.choices[0].finish_reason in ("stop", "length"), role
    healthy(plain, baseline)


# -- 4. a shutdown that keeps its word ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LONG = 2000  # tokens each request of the shutdown case asks for (ignore_eos)


def _stream(url: str, out: list, started: threading.Event) -> None:
    """A long streamed completion read raw: every SSE data line into out."""
    body = dict(model="tiny", prompt=[5, 6, 7, 8], max_tokens=LONG, temperature=0,
                stream=True, ignore_eos=True)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        out.append(f"cut: {e!r}")


def _whole(url: str, out: list) -> None:
    body = dict(model="tiny", prompt=[9, 10, 11], max_tokens=LONG, temperature=0,
                ignore_eos=True)
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        out.append((r.status_code, r.headers.get("content-type"), r.text))
    except httpx.HTTPError as e:
        out.append(("cut", None, repr(e)))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_past_the_drain_time_answers_everyone(sig):
    """`ouroboros-jax serve` (the demo pair, vanilla) with --drain-timeout 1 and two long
    streams and one non-streamed request open: past the drain time the streams get an error
    event and [DONE], the other a JSON 503; the process exits 0 with no traceback in its
    log."""
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(oj.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ouroboros_jax.cli", "serve", "--method", "vanilla", "--slots",
         "4", "--port", str(port), "--max-cache-len", str(LONG + 8), "--served-model-name",
         "tiny", "--drain-timeout", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < t_end, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        streams, whole, started = [[], []], [], [threading.Event(), threading.Event()]
        ts = [threading.Thread(target=_stream, args=(url, streams[i], started[i]))
              for i in range(2)] + [threading.Thread(target=_whole, args=(url, whole))]
        for t in ts:
            t.start()
        assert all(e.wait(60) for e in started)
        t_end = time.monotonic() + 30
        while _prom(url).get("ouroboros:num_requests_running", 0) < 3:
            assert time.monotonic() < t_end, "the non-streamed request never started"
            time.sleep(0.05)
        proc.send_signal(sig)
        for t in ts:
            t.join(60)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "cancelled" and err["type"] == "server_error"
        assert len(events) < LONG  # cut by the shutdown, not run to the end
    status, ctype, text = whole[0]
    assert status == 503 and ctype == "application/json", whole
    assert json.loads(text)["error"]["code"] == "cancelled"
    assert "Traceback" not in log and "CancelledError" not in log, log
