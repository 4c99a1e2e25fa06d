"""The server's logprobs / top_logprobs, n > 1 and the per-request speculation switch, driven
by the real `openai` client against the engine test_server.py serves (the tiny chat pair,
Ouroboros drafting with the target itself, so rounds accept drafts).

Logprobs are checked against `oj.generate(..., logprobs=True)` of the prompt alone (vanilla:
tests/test_logprobs.py checks those against a full transformers forward)."""

import json

import httpx
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.serving.choices import choice_seed

from test_server import (CACHE, MODEL, PROMPTS, _prom, chat_ids, client,  # noqa: F401
                         expected, served, sse_events)  # the fixtures: this module's own

MESSAGES = [{"role": "user", "content": "abcabcabc"}]


def _vanilla(pair, ids, n, **kw):
    return oj.generate(pair[0], [list(ids)], method="vanilla", max_new_tokens=n,
                       max_cache_len=CACHE, logprobs=True, **kw)


def test_chat_logprobs_are_generates(client, tiny_chat_pair):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    ref = _vanilla(tiny_chat_pair, chat_ids(tiny_chat_pair[0].tokenizer, MESSAGES), 12,
                   top_logprobs=2)
    ids = ch.model_extra["token_ids"]
    assert ids == ref.tokens[0]
    content = ch.logprobs.content
    assert len(content) == len(ids) == r.usage.completion_tokens
    np.testing.assert_allclose([c.logprob for c in content], ref.logprobs[0], atol=1e-4)
    tok = tiny_chat_pair[0].tokenizer
    for c, t, top in zip(content, ids, ref.top_logprobs[0]):
        assert c.token == tok.decode([t]) and c.bytes == list(c.token.encode())
        assert [x.token for x in c.top_logprobs] == [tok.decode([i]) for i, _ in top]
        assert c.top_logprobs[0].token == c.token  # greedy: the most likely token
    off = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                         temperature=0)
    assert off.choices[0].logprobs is None and off.choices[0].message.content == ch.message.content


def test_completion_logprobs_streamed_and_not(served, client, tiny_chat_pair):
    prompt = PROMPTS[0]
    body = dict(model=MODEL, prompt=prompt, max_tokens=60, temperature=0.7, top_k=30, seed=4,
                logprobs=3)
    ref = _vanilla(tiny_chat_pair, prompt, 60, temperature=0.7, top_k=30, seed=4,
                   top_logprobs=3)
    r = client.completions.create(**{k: v for k, v in body.items() if k != "top_k"},
                                  extra_body={"top_k": 30})
    lp = r.choices[0].logprobs
    assert r.choices[0].model_extra["token_ids"] == ref.tokens[0]
    np.testing.assert_allclose(lp.token_logprobs, ref.logprobs[0], atol=1e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    tok = tiny_chat_pair[0].tokenizer
    assert lp.tokens == [tok.decode([t]) for t in ref.tokens[0]]  # special tokens named too
    for top, want in zip(lp.top_logprobs, ref.top_logprobs[0]):
        assert list(top) == [tok.decode([i]) for i, _ in want]
    # streamed: the chunks' logprobs joined are the whole answer's, offsets continuing
    events = sse_events(served[0].url + "/v1/completions", dict(body, stream=True))[:-1]
    chunks = [e["choices"][0]["logprobs"] for e in events if e.get("choices")
              and e["choices"][0]["logprobs"]]
    assert len(chunks) >= 2  # several chunks, so the offsets had to continue
    joined = {k: sum((c[k] for c in chunks), []) for k in chunks[0]}
    assert joined["tokens"] == lp.tokens and joined["text_offset"] == lp.text_offset
    np.testing.assert_allclose(joined["token_logprobs"], lp.token_logprobs, atol=1e-4)


def test_n_choices_greedy_equal_sampled_reproducible(client, tiny_chat_pair):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    want = expected(tiny_chat_pair, PROMPTS[1], 10)
    assert [c.model_extra["token_ids"] for c in r.choices] == [want, want]
    assert r.usage.completion_tokens == 20
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11, n=2)
    a, b = (client.chat.completions.create(**kw) for _ in range(2))
    ids = lambda resp: [c.model_extra["token_ids"] for c in resp.choices]  # noqa: E731
    assert ids(a) == ids(b) and ids(a)[0] != ids(a)[1]
    assert a.usage.completion_tokens == sum(len(x) for x in ids(a))
    # choice i samples with choice_seed(seed, i): what a one-choice request with it gets
    for i in range(2):
        one = client.chat.completions.create(**dict(kw, n=1, seed=choice_seed(11, i)))
        assert one.choices[0].model_extra["token_ids"] == ids(a)[i]


def test_n_choices_streamed_carry_their_index(served, client):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11, n=2,
                stream=True, stream_options={"include_usage": True})
    events = sse_events(served[0].url + "/v1/chat/completions", body)
    assert events.pop() == "[DONE]"
    text, finish = {0: "", 1: ""}, {}
    for e in events:
        for c in e.get("choices", []):
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    whole = client.chat.completions.create(**{k: v for k, v in body.items()
                                              if k not in ("stream", "stream_options")})
    assert text == {c.index: c.message.content for c in whole.choices}
    assert set(finish) == {0, 1}
    assert events[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_speculation_off_gives_the_same_output_without_drafts(client, tiny_chat_pair):
    want = expected(tiny_chat_pair, PROMPTS[0], 24)
    on = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                   temperature=0)
    off = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                    temperature=0, extra_body={"speculation": "off"})
    for r in (on, off):
        assert r.choices[0].model_extra["token_ids"] == want
    spec = lambda r: r.model_extra["metrics"]["speculative_decoding"]  # noqa: E731
    assert spec(on)["num_draft_tokens"] > 0 and spec(on)["num_accepted_draft_tokens"] > 0
    assert spec(off)["num_draft_tokens"] == 0 and spec(off)["mean_acceptance_length"] == 1.0
    # Ouroboros' candidates are deterministic, so sampling is vanilla's token for token
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=9)
    assert (client.completions.create(**kw).choices[0].model_extra["token_ids"]
            == client.completions.create(**kw, extra_body={"speculation": "off"})
            .choices[0].model_extra["token_ids"])


def test_accepted_tokens_by_source_add_up_per_request_and_in_prometheus(served, client):
    """Ouroboros' accepted draft tokens come from the draft's chain and from pool phrases
    (lengthening), and with free drafts from spans of the context (off here, so none): per
    request and in /metrics they add up to the accepted tokens."""
    url = served[0].url
    before = _prom(httpx.get(url + "/metrics").text)
    total = {}
    for p in PROMPTS[:4]:
        r = client.completions.create(model=MODEL, prompt=p * 2, max_tokens=24, temperature=0)
        s = r.model_extra["metrics"]["speculative_decoding"]
        by = s["accepted_by_source"]
        assert set(by) == {"draft_chain", "pool_phrases", "prompt_lookup"}
        assert sum(by.values()) == s["num_accepted_draft_tokens"]
        for k, v in by.items():
            total[k] = total.get(k, 0) + v
    after = _prom(httpx.get(url + "/metrics").text)
    name = "ouroboros:spec_decode_num_accepted_tokens_by_source_total"
    got = {k: after[f'{name}{{source="{k}"}}'] - before.get(f'{name}{{source="{k}"}}', 0)
           for k in total}
    assert got == total and min(total["draft_chain"], total["pool_phrases"]) > 0, total
    assert total["prompt_lookup"] == 0  # free drafts are off by default
    acc = "ouroboros:spec_decode_num_accepted_tokens_total"
    assert sum(after[k] for k in after if k.startswith(name)) == after[acc]
    assert after[f'{name}{{source="prompt_lookup"}}'] == 0


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"speculation": "maybe"}, "speculation"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
])
def test_bad_choice_fields_are_400_naming_them(served, path, fields, param):
    body = dict(model=MODEL, max_tokens=4, temperature=0, **fields)
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPTS[0]})
    r = httpx.post(served[0].url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, json.dumps(r.json())
