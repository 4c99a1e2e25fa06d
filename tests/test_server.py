"""The OpenAI-compatible server (serving/server.py) driven by the real `openai` client against
uvicorn on 127.0.0.1 in a thread of this process (so it shares the compiled engine step).

The model is the tiny random target with a character-level tokenizer and a chat template
(conftest.tiny_chat_pair), served with Ouroboros drafting with the target itself (so drafts
are accepted and deltas carry several tokens): every greedy output is checked against `oj.generate` of that prompt
alone (vanilla), the exactness the engine promises whatever else is in the batch.
"""

import json
import threading
import time

import httpx
import openai
import pytest

import ouroboros_jax as oj
from ouroboros_jax.serving.engine import Engine
from ouroboros_jax.serving.server import ServerThread, create_app

MODEL = "tiny"
SLOTS = 8
CACHE = 512
CONFIG = oj.OuroborosConfig(gamma=4, window=4, ngram=3, guesses=4, suffixes=2)
# prompts made of repeated patterns, so the phrase pool gets hits (conftest.REPEAT's spirit)
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [20, 21] * 7, [30, 31, 32, 33, 34] * 3, [40] * 12,
           [3, 4, 50, 3, 4, 51, 3, 4], [60, 61, 62] * 2, [70, 71, 72, 73, 74, 75, 76, 77, 78]]
LENGTHS = [320, 48, 192, 96, 264, 72, 144, 224]  # max_tokens of each, all different


def make_engine(pair, **kw):
    """The target drafting for itself: the tiny pair's random draft never agrees with it, and
    accepted drafts are what exercise multi-token deltas and the acceptance counters."""
    target = pair[0]
    draft = target
    args = dict(method="ouroboros", config=CONFIG, slots=SLOTS, max_cache_len=CACHE)
    args.update(kw)
    return Engine(target, draft, **args)


@pytest.fixture(scope="module")
def served(tiny_chat_pair):
    """(ServerThread, Engine) serving the tiny chat pair with Ouroboros, 8 slots."""
    engine = make_engine(tiny_chat_pair)
    srv = ServerThread(create_app(engine, model_names=[MODEL])).start()
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


_expected_cache: dict = {}


def expected(pair, prompt, n, ignore_eos=False) -> list[int]:
    """generate's greedy tokens for one prompt alone (vanilla: every method's greedy output)."""
    key = (tuple(prompt), n, ignore_eos)
    if key not in _expected_cache:
        out = oj.generate(pair[0], [list(prompt)], method="vanilla", max_new_tokens=n,
                          max_cache_len=CACHE, eos_token_id=-1 if ignore_eos else None)
        _expected_cache[key] = out.tokens[0]
    return _expected_cache[key]


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def serves_correctly(client, pair):
    """The check after every fault: a fresh request still gets its exact output."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert r.choices[0].token_ids == expected(pair, PROMPTS[1], 10)


def sse_events(url, body) -> list:
    """POSTs a streaming request and returns the parsed `data:` events ("[DONE]" as is)."""
    out = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_models_and_health(served, client):
    srv, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 200 and h.json() == {"status": "ok"}


def test_completion_equals_generate(client, tiny_chat_pair):
    p, n = PROMPTS[0], 20
    want = expected(tiny_chat_pair, p, n)
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)
    c = r.choices[0]
    assert c.token_ids == want
    assert c.text == tiny_chat_pair[0].tokenizer.decode(want, skip_special_tokens=True)
    assert c.finish_reason == ("length" if len(want) == n else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), len(want))
    assert r.object == "text_completion" and r.model == MODEL
    spec = r.metrics["speculative_decoding"]
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"])


def test_completion_text_prompt(client, tiny_chat_pair):
    tok = tiny_chat_pair[0].tokenizer
    text = "def f(x):\n    return x"
    ids = tok(text)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0)
    assert r.choices[0].token_ids == expected(tiny_chat_pair, ids, 12)
    assert r.usage.prompt_tokens == len(ids)


def test_completion_stream_equals_non_stream(served, client, tiny_chat_pair):
    p, n = PROMPTS[3], 16
    want = expected(tiny_chat_pair, p, n)
    chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert ids == want
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == tiny_chat_pair[0].tokenizer.decode(want, skip_special_tokens=True)
    finals = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finals == ["length" if len(want) == n else "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert all(c.usage is None for c in chunks[:-1])
    # the raw stream: OpenAI's chunk shape, one request id, ending in data: [DONE]
    ev = sse_events(served[0].url + "/v1/completions",
                    dict(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True))
    assert ev[-1] == "[DONE]" and all(isinstance(e, dict) for e in ev[:-1])
    assert {e["object"] for e in ev[:-1]} == {"text_completion"}
    assert len({e["id"] for e in ev[:-1]}) == 1
    assert "usage" not in ev[-2]  # no include_usage, no usage chunk
    assert "speculative_decoding" in ev[-2]["metrics"]


def test_chat_stream_and_not(served, client, tiny_chat_pair):
    tok = tiny_chat_pair[0].tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc abc"}]
    n = 14
    want = expected(tiny_chat_pair, chat_ids(tok, msgs), n)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(chat_ids(tok, msgs))
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert content == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(want)
    ev = sse_events(served[0].url + "/v1/chat/completions",
                    dict(model=MODEL, messages=msgs, max_tokens=n, temperature=0, stream=True))
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert ev[-2]["choices"][0]["delta"] == {}


def _one(client, p, n, out, i, stream=False, ignore_eos=False):
    extra = {"ignore_eos": True} if ignore_eos else None
    if stream:
        ids = [t for c in client.completions.create(model=MODEL, prompt=p, max_tokens=n,
                                                     temperature=0, stream=True,
                                                     extra_body=extra)
               for ch in c.choices for t in ch.token_ids]
    else:
        ids = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                        extra_body=extra).choices[0].token_ids
    out[i] = (ids, time.perf_counter())


def _concurrent(client, jobs, stream=False, ignore_eos=False):
    out = [None] * len(jobs)
    threads = [threading.Thread(target=_one, args=(client, p, n, out, i, stream, ignore_eos))
               for i, (p, n) in enumerate(jobs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out, time.perf_counter() - t0


def test_eight_concurrent_each_equal_generate(served, client, tiny_chat_pair):
    jobs = list(zip(PROMPTS, LENGTHS))
    # greedy with EOS: each stops where generate stops
    assert [o[0] for o in _concurrent(client, jobs)[0]] == \
        [expected(tiny_chat_pair, p, n) for p, n in jobs]
    # timed at their full lengths (ignore_eos), streamed, after the warm-up above
    want = [expected(tiny_chat_pair, p, n, ignore_eos=True) for p, n in jobs]
    engine = served[1]
    steps = lambda: engine.metrics()["steps"]  # noqa: E731
    s0 = steps()
    out, t_conc = _concurrent(client, jobs, stream=True, ignore_eos=True)
    assert [o[0] for o in out] == want and [len(w) for w in want] == LENGTHS
    s1 = steps()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(jobs):
        assert client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}
                                         ).choices[0].token_ids == want[i]
    t_seq = time.perf_counter() - t0
    conc, seq = s1 - s0, steps() - s1
    print(f"8 concurrent: {t_conc:.2f} s in {conc} steps, one after another: {t_seq:.2f} s "
          f"in {seq} steps")
    # served together, the requests share device steps (the longest request's steps and a
    # few while they arrive), one after another each takes its own: a count, not a time (a
    # lone request runs one-row steps, `row_buckets`, so its steps are cheaper on a CPU; the
    # throughput is measured by `ouroboros-jax bench --serve`)
    assert seq > 2 * conc


def test_request_arriving_mid_generation(served, client, tiny_chat_pair):
    long_p = PROMPTS[4]
    long_n = CACHE - len(long_p)
    want_long = expected(tiny_chat_pair, long_p, long_n, ignore_eos=True)
    got, seen, done_at = [], threading.Event(), {}

    def long_request():
        for c in client.completions.create(model=MODEL, prompt=long_p, max_tokens=long_n,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
            for ch in c.choices:
                got.extend(ch.token_ids)
                if len(got) >= 3:
                    seen.set()
        done_at["long"] = time.perf_counter()

    t = threading.Thread(target=long_request)
    t.start()
    assert seen.wait(60), "the long request never streamed"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=5, temperature=0)
    done_at["short"] = time.perf_counter()
    t.join(120)
    assert r.choices[0].token_ids == expected(tiny_chat_pair, PROMPTS[5], 5)
    assert got == want_long and len(got) == long_n
    assert done_at["short"] < done_at["long"]  # it joined the batch, not the end of a queue


def _wait_for(pred, timeout=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_stream_disconnect_cancels(served, client, tiny_chat_pair):
    srv, engine = served
    before = engine.metrics()["requests_cancelled"]
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=CACHE - len(PROMPTS[0]),
                temperature=0, stream=True, ignore_eos=True)
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 2:
                break  # leaving the block closes the connection mid-stream
    assert _wait_for(lambda: engine.metrics()["requests_cancelled"] == before + 1)
    assert _wait_for(lambda: engine.metrics()["busy_slots"] == 0)
    serves_correctly(client, tiny_chat_pair)


def test_non_stream_disconnect_cancels(served, client, tiny_chat_pair):
    srv, engine = served
    before = engine.metrics()["requests_cancelled"]
    body = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=CACHE - len(PROMPTS[2]),
                temperature=0, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    assert _wait_for(lambda: engine.metrics()["requests_cancelled"] == before + 1)
    assert _wait_for(lambda: engine.metrics()["busy_slots"] == 0)
    serves_correctly(client, tiny_chat_pair)


BAD = [  # (body fields over a good completion request, the param the error names)
    ({"model": "no-such-model"}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": CACHE}, "max_tokens"),  # prompt + max_tokens past the cache
    ({"prompt": [5] * (CACHE + 1), "max_tokens": 1}, "prompt"),  # prompt alone past the cache
    ({"prompt": [7, 1000]}, "prompt"),  # an id outside the vocabulary
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_request_400_then_serves(served, client, tiny_chat_pair, fields, param):
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    body.update(fields)
    r = httpx.post(served[0].url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    serves_correctly(client, tiny_chat_pair)


def test_bad_json_and_chat_errors_400_then_serve(served, client, tiny_chat_pair):
    url = served[0].url
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": [5,',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:  # what the openai client raises
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=0)
    assert e.value.status_code == 400
    serves_correctly(client, tiny_chat_pair)


def test_sampled_request_reproducible_by_seed(client, tiny_chat_pair):
    kw = dict(model=MODEL, prompt=PROMPTS[6], max_tokens=16, temperature=0.8, top_p=0.9,
              seed=1234)
    out, _ = [None, None], None
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, client.completions.create(**kw).choices[0].token_ids)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    alone = client.completions.create(**kw).choices[0].token_ids
    assert out[0] == out[1] == alone  # a seed fixes the sample whatever shares the batch


def _prom(text: str) -> dict:
    """Prometheus text -> {sample name with labels: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, v = line.rsplit(" ", 1)
            out[name] = float(v)
    return out


def test_metrics_count_accepted_tokens(served, client, tiny_chat_pair):
    url = served[0].url
    before = _prom(httpx.get(url + "/metrics").text)
    accepted = drafted = 0
    for p in PROMPTS[:4]:
        r = client.completions.create(model=MODEL, prompt=p * 2, max_tokens=24, temperature=0)
        s = r.metrics["speculative_decoding"]
        accepted += s["num_accepted_draft_tokens"]
        drafted += s["num_draft_tokens"]
    res = httpx.get(url + "/metrics")
    assert res.headers["content-type"].startswith("text/plain")
    after = _prom(res.text)
    acc = "ouroboros:spec_decode_num_accepted_tokens_total"
    assert after[acc] - before[acc] == accepted > 0  # repeated prompts: the pool hits
    drf = "ouroboros:spec_decode_num_draft_tokens_total"
    assert after[drf] - before[drf] == drafted > 0
    per_pos = [k for k in after if k.startswith(
        "ouroboros:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert per_pos and sum(after[k] for k in per_pos) == after[acc]
    for k in ("ouroboros:spec_decode_num_drafts_total", "ouroboros:num_requests_running",
              "ouroboros:num_requests_waiting", "ouroboros:pool_hit_rate",
              "ouroboros:e2e_request_latency_seconds_count",
              'ouroboros:time_to_first_token_seconds_bucket{le="+Inf"}'):
        assert k in after, k
    assert after["ouroboros:e2e_request_latency_seconds_count"] >= \
        before["ouroboros:e2e_request_latency_seconds_count"] + 4


def test_queue_full_429_then_serves(tiny_chat_pair):
    """An engine not yet stepping keeps what it is given waiting: max_queue=2 waiting requests
    fill it, the third gets 429; once the engine runs, the two finish exactly."""
    engine = make_engine(tiny_chat_pair, max_queue=2)
    srv = ServerThread(create_app(engine, model_names=[MODEL], manage_engine=False)).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
        out = [None, None]
        ts = [threading.Thread(target=_one, args=(c, PROMPTS[i], 8, out, i)) for i in range(2)]
        for t in ts:
            t.start()
        assert _wait_for(lambda: engine.metrics()["queue_length"] == 2)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0)
        assert e.value.status_code == 429
        assert e.value.body["code"] == "queue_full"
        engine.start()
        for t in ts:
            t.join(60)
        assert [o[0] for o in out] == [expected(tiny_chat_pair, PROMPTS[i], 8) for i in range(2)]
        serves_correctly(c, tiny_chat_pair)
    finally:
        srv.stop(cancel=True)
        engine.stop(cancel=True)


def test_stop_drains_in_flight(tiny_chat_pair):
    """stop(): no new connections, but a stream in flight runs to its end, exactly."""
    engine = make_engine(tiny_chat_pair)
    srv = ServerThread(create_app(engine, model_names=[MODEL])).start()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
    p = PROMPTS[0]
    n = CACHE - len(p)
    got, started = [], threading.Event()

    def stream():
        for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}):
            for x in ch.choices:
                got.extend(x.token_ids)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    mid = len(got) < n
    srv.stop()  # blocks until the stream is done
    t.join(60)
    assert mid, "the stream ended before the stop: nothing was drained"
    assert got == expected(tiny_chat_pair, p, n, ignore_eos=True)
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)


def test_stop_cancel_ends_streams_cleanly(tiny_chat_pair):
    """stop(cancel=True): a stream in flight ends with an error event the client raises, not a
    hang or a cut connection."""
    engine = make_engine(tiny_chat_pair)
    srv = ServerThread(create_app(engine, model_names=[MODEL])).start()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=120)
    errors, started = [], threading.Event()

    def stream():
        try:
            for _ in c.completions.create(model=MODEL, prompt=PROMPTS[0],
                                          max_tokens=CACHE - len(PROMPTS[0]), temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}):
                started.set()
        except openai.APIError as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    srv.stop(cancel=True)
    t.join(60)
    assert not t.is_alive()
    assert len(errors) == 1 and "cancelled" in str(errors[0])
    assert engine.metrics()["busy_slots"] == 0


def test_smollm2_streamed_chat_equals_non_streamed_and_generate(smollm2):
    """SmolLM2-135M-Instruct from its GGUF (conftest.smollm2): a streamed chat completion's
    text and ids equal the non-streamed one's, and both equal generate's on the conversation."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    n, cache = 24, 256
    want = oj.generate(smollm2, [msgs], max_new_tokens=n, max_cache_len=cache).tokens[0]
    engine = Engine(smollm2, method="vanilla", slots=2, max_cache_len=cache)
    srv = ServerThread(create_app(engine, model_names=["smollm2"])).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=n,
                                      temperature=0)
        assert r.choices[0].token_ids == want
        text = r.choices[0].message.content
        assert text == smollm2.tokenizer.decode(want, skip_special_tokens=True)
        assert "Paris" in text  # a real model answering, not just equal noise
        chunks = list(c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=n,
                                                temperature=0, stream=True))
        assert "".join(ch.delta.content or "" for k in chunks for ch in k.choices) == text
        assert [t for k in chunks for ch in k.choices for t in ch.token_ids] == want
    finally:
        srv.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_then_ctrl_c(tiny_chat_pair):
    """`ouroboros-jax serve --model DIR` in its own process: it answers exactly, and Ctrl-C
    (SIGINT) stops it cleanly (exit status 0)."""
    import os
    import signal
    import subprocess
    import sys

    target = tiny_chat_pair[0]
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(oj.__file__)))] +
        ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.Popen([sys.executable, "-m", "ouroboros_jax.cli", "serve", "--model",
                             target.path, "--method", "vanilla", "--slots", "2", "--port",
                             str(port), "--max-cache-len", str(CACHE)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return proc.poll() is None and False

        assert _wait_for(lambda: up() or proc.poll() is not None, timeout=240), "no server"
        assert proc.poll() is None, proc.stdout.read()
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        name = os.path.basename(target.path)
        assert [m.id for m in c.models.list().data] == [name]
        r = c.completions.create(model=name, prompt=PROMPTS[2], max_tokens=12, temperature=0)
        assert r.choices[0].token_ids == expected(tiny_chat_pair, PROMPTS[2], 12)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
