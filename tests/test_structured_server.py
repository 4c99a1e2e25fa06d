"""Structured output through the OpenAI server: a continuous batch mixing constrained and
unconstrained requests, chat and completions, streamed and not, every answer equal to its
prompt's solo `oj.generate` (constrained vanilla); bad formats answered 400 naming the field,
the rest of the batch undisturbed."""

import concurrent.futures as cf
import json

import httpx
import pytest

import ouroboros_jax as oj
from ouroboros_jax.serving.engine import Engine
from ouroboros_jax.serving.server import ServerThread, create_app

from test_structured import JSON_FORMAT, REGEX_FORMAT, SCHEMA, json_model  # noqa: F401

jsonschema = pytest.importorskip("jsonschema")
CACHE = 256


@pytest.fixture(scope="module")
def served(json_model):  # noqa: F811
    model, _ = json_model
    engine = Engine(model, model, method="speculative", config=oj.SpeculativeConfig(gamma=3),
                    slots=4, max_cache_len=CACHE, constraint_states=320, constraint_classes=64)
    srv = ServerThread(create_app(engine, model_names=["tiny"])).start()
    yield srv.url, model
    srv.stop()


def post(url, path, body):
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=120)
        return r.status_code, r.json()
    text, ids = "", []
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch:
                    text += ch[0].get("delta", {}).get("content") or ch[0].get("text") or ""
    return 200, {"text": text}


def solo(model, prompt, fmt, n):
    out = oj.generate(model, [prompt], method="vanilla", max_new_tokens=n, response_format=fmt,
                      config=None, max_cache_len=CACHE)
    return out.texts[0]


def test_a_mixed_batch_answers_each_request_as_its_solo_run(served):
    url, model = served
    msgs = [{"role": "user", "content": "give json"}]
    cases = [  # (path, body, solo prompt, format)
        ("/v1/completions", dict(prompt="hello", response_format=JSON_FORMAT), "hello",
         JSON_FORMAT),
        ("/v1/completions", dict(prompt="abc def", stream=True), "abc def", None),
        ("/v1/chat/completions", dict(messages=msgs, response_format=REGEX_FORMAT, stream=True),
         msgs, REGEX_FORMAT),
        ("/v1/chat/completions", dict(messages=msgs, response_format={"type": "json_object"}),
         msgs, {"type": "json_object"}),
        ("/v1/completions", dict(prompt="x", response_format=JSON_FORMAT, stream=True), "x",
         JSON_FORMAT),
    ]
    bodies = [dict(b, model="tiny", max_tokens=60, temperature=0) for _, b, _, _ in cases]
    with cf.ThreadPoolExecutor(len(cases)) as ex:
        got = list(ex.map(lambda pb: post(url, *pb), [(c[0], b) for c, b in zip(cases, bodies)]))
    for (path, body, prompt, fmt), (status, r) in zip(cases, got):
        assert status == 200, r
        text = r["text"] if "text" in r else (r["choices"][0].get("text")
                                              or r["choices"][0]["message"]["content"])
        assert text == solo(model, prompt, fmt, 60), (path, body)
        if fmt is JSON_FORMAT:
            jsonschema.validate(json.loads(text), SCHEMA)
        if fmt == {"type": "json_object"}:
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
     "response_format.json_schema.schema.type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "not": {}}}},
     "response_format.json_schema.schema.not"),
    ({"type": "regex", "pattern": "[a-z]{0,400}"}, "response_format"),  # over the slot bound
    ({"type": "yaml"}, "response_format.type"),
])
def test_bad_formats_get_a_400_naming_the_field(served, fmt, param):
    url, model = served
    status, r = post(url, "/v1/completions", dict(model="tiny", prompt="hello", max_tokens=8,
                                                  response_format=fmt))
    assert status == 400 and r["error"]["param"] == param, r
    ok_status, ok = post(url, "/v1/completions", dict(model="tiny", prompt="x", max_tokens=60,
                                                      temperature=0,
                                                      response_format=JSON_FORMAT))
    assert ok_status == 200 and ok["choices"][0]["text"] == solo(model, "x", JSON_FORMAT, 60)
