"""Engine-level choices (the dtype load_model picks by backend) and the serving engine
(`oj.serving.Engine`): continuous batching over the method seam."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.models import loading
from ouroboros_jax.serving import Engine, QueueFull, RequestParams
from ouroboros_jax.serving import engine as engine_mod

from conftest import REPEAT

LA = oj.LookaheadConfig(window=4, ngram=4, guesses=4)
OU = oj.OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
OU_LONG = dataclasses.replace(OU, gamma=6)  # same state layout, another gamma
SP = oj.SpeculativeConfig(gamma=3)
KW = dict(slots=3, max_cache_len=64, rounds_per_step=3)
PROMPTS = [REPEAT[0], [9, 10, 11], REPEAT[2], [30, 31, 32, 33, 34, 35, 36], REPEAT[5], [44]]
LENGTHS = [14, 3, 9, 20, 6, 11]


def test_auto_dtype_by_backend(capsys, tiny_pair):
    from ouroboros_jax import notices

    notices._said.clear()
    assert loading.resolve_dtype("auto", "cpu") == "float32"
    assert loading.resolve_dtype("auto", "cpu") == "float32"
    assert loading.resolve_dtype("auto", "gpu") == "bfloat16"
    assert loading.resolve_dtype("auto", "tpu") == "bfloat16"
    said = [line for line in capsys.readouterr().err.splitlines() if "dtype='auto'" in line]
    assert len(said) == 3 and "float32 on cpu" in said[0]  # on stderr, once per backend
    assert loading.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    target = tiny_pair[0]
    m = loading.load_model(target.path)  # the default is "auto": fp32 on this CPU
    assert m.dtype == jnp.float32


def _drain(engine):
    while engine.step():
        pass


def _reference(target, draft, method, cfg, prompt, n, **kw):
    return oj.generate(target, [prompt], draft=draft, method=method, config=cfg,
                       max_new_tokens=n, **kw).tokens[0]


@pytest.mark.parametrize("method,config", [
    ("vanilla", None),
    ("speculative", SP),
    # three load levels: gamma 4 alone, gamma 6 with two busy slots, speculation off at three;
    # rows switch level mid-request as others come and go
    ("ouroboros", {1: OU, 2: OU_LONG, 3: "off"}),
])
def test_greedy_requests_equal_generate(tiny_pair, method, config):
    """Requests of different lengths submitted together (more than there are slots, so they
    are admitted as slots free up) and a second wave arriving mid-generation: each equals
    `generate` of its prompt alone, with the model's default EOS ids."""
    target, draft, _ = tiny_pair
    draft = draft if method != "vanilla" else None
    eng = Engine(target, draft, method=method, config=config, **KW)
    first = [eng.submit(p, RequestParams(max_tokens=n)) for p, n in zip(PROMPTS[:4], LENGTHS)]
    eng.step()
    eng.step()
    assert not all(h.done for h in first)
    second = [eng.submit(p, RequestParams(max_tokens=n))
              for p, n in zip(PROMPTS[4:], LENGTHS[4:])]
    _drain(eng)
    cfg = OU if method == "ouroboros" else config
    for p, n, h in zip(PROMPTS, LENGTHS, first + second):
        r = h.result(timeout=0)
        want = _reference(target, draft, method, cfg, p, n)
        assert r.token_ids == want, (p, n)
        assert r.finish_reason == ("stop" if len(want) < n else "length")
        assert r.completion_tokens == len(want) and r.prompt_tokens == len(p)
        assert sum(r.spec["acceptance_histogram"]) >= 1
    m = eng.metrics()
    assert m["requests_finished"] == 6 and m["busy_slots"] == 0 and m["queue_length"] == 0
    assert m["generation_tokens"] == sum(len(h.result().token_ids) for h in first + second)
    if method == "ouroboros":  # every load level ran
        assert {k.split(":")[0] for k in m["steps_per_level"]} == {"1 busy", "2 busy", "3 busy"}
        assert m["num_drafts"] > 0 and m["num_draft_tokens"] >= 4 * m["num_drafts"]


def test_request_arriving_mid_generation(tiny_pair):
    target = tiny_pair[0]
    eng = Engine(target, method="vanilla", config=None, **KW)
    a = eng.submit(REPEAT[1], RequestParams(max_tokens=20, stop_token_ids=()))
    eng.step()
    assert len(a.tokens) == KW["rounds_per_step"] and not a.done
    b = eng.submit(REPEAT[3], RequestParams(max_tokens=5, stop_token_ids=()))
    eng.step()  # b is prefilled into a free slot while a keeps going
    assert len(a.tokens) == 2 * KW["rounds_per_step"] and len(b.tokens) == 3
    _drain(eng)
    assert b.result().latency_s < a.result().latency_s
    for p, n, h in ((REPEAT[1], 20, a), (REPEAT[3], 5, b)):
        assert h.result().token_ids == _reference(target, None, "vanilla", None, p, n,
                                                  eos_token_id=-1)


def test_cancel_frees_the_slot_and_spares_the_others(tiny_pair):
    target = tiny_pair[0]
    eng = Engine(target, method="vanilla", config=None, **KW)
    params = RequestParams(max_tokens=30, stop_token_ids=())
    hs = [eng.submit(p, params) for p in PROMPTS[:5]]  # 3 run, 2 wait
    eng.step()
    assert eng.metrics()["busy_slots"] == 3 and eng.metrics()["queue_length"] == 2
    hs[1].cancel()  # running
    hs[4].cancel()  # waiting
    eng.step()
    assert hs[1].done and hs[1].result().finish_reason == "cancelled"
    assert hs[4].done and hs[4].result().finish_reason == "cancelled"
    assert hs[4].result().token_ids == []
    assert len(hs[3].tokens) == KW["rounds_per_step"]  # took the freed slot at once
    assert eng.metrics()["busy_slots"] == 3 and eng.metrics()["queue_length"] == 0
    _drain(eng)
    for i in (0, 2, 3):
        assert hs[i].result().token_ids == _reference(target, None, "vanilla", None,
                                                      PROMPTS[i], 30, eos_token_id=-1)
    assert eng.metrics()["requests_cancelled"] == 2


def test_no_recompilation_as_requests_come_and_go(tiny_pair, caplog):
    """After `warmup` has compiled the step of both load levels (greedy and mixed sampling)
    and the insert of the 16-token prompt bucket, requests of different lengths, limits,
    seeds and sampling knobs arriving and leaving compile nothing."""
    target, draft, _ = tiny_pair
    eng = Engine(target, draft, method="ouroboros", config={1: OU, 3: "off"}, **KW)
    eng.warmup()
    sizes = (engine_mod._device_step._cache_size(), engine_mod._device_insert._cache_size())
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
        hs = [eng.submit(p, RequestParams(max_tokens=n, temperature=t, seed=s, top_k=k,
                                          top_p=tp, stop_token_ids=ids))
              for p, n, t, s, k, tp, ids in zip(
                  PROMPTS, [7, 2, 12, 5, 9, 3], [0, 0.5, 0, 1.3, 0.9, 0],
                  [0, 5, 0, 2**31, 9, 0], [0, 5, 0, 0, 40, 0], [1, 0.9, 1, 1, 0.5, 1],
                  [None, (), (3, 4), None, (7,), ()])]
        _drain(eng)
    assert all(h.done for h in hs)
    assert len(eng.metrics()["steps_per_level"]) >= 2  # both levels ran
    assert (engine_mod._device_step._cache_size(),
            engine_mod._device_insert._cache_size()) == sizes
    compiled = [r.getMessage() for r in caplog.records if "_device_" in r.getMessage()
                and "ompil" in r.getMessage()]
    assert compiled == []


def test_sampled_output_is_independent_of_the_batch(tiny_pair):
    """A sampled request's tokens depend on its seed alone: the same alone, beside greedy and
    sampled neighbours in another slot, and equal to `generate` of it alone with that seed
    (whose sampling is lossless, tests/test_speculative.py); a greedy neighbour in the mixed
    batch still equals greedy `generate`."""
    target, draft, _ = tiny_pair
    p, n = [12, 13, 14, 15, 16], 16
    knobs = dict(temperature=0.9, top_k=30, top_p=0.95)
    params = RequestParams(max_tokens=n, seed=11, stop_token_ids=(), **knobs)
    eng = Engine(target, draft, method="speculative", config=SP, **KW)
    alone = eng.submit(p, params)
    _drain(eng)
    greedy = eng.submit(PROMPTS[0], RequestParams(max_tokens=12, stop_token_ids=()))
    other = eng.submit(PROMPTS[1], RequestParams(max_tokens=9, seed=3, stop_token_ids=(),
                                                 **knobs))
    eng.step()
    again = eng.submit(p, params)  # slot 2, later, beside two others
    _drain(eng)
    want = oj.generate(target, [p], draft=draft, method="speculative", config=SP,
                       max_new_tokens=n, seed=11, eos_token_id=-1, **knobs).tokens[0]
    assert alone.result().token_ids == again.result().token_ids == want
    assert other.result().token_ids != want[:9]
    assert greedy.result().token_ids == _reference(target, draft, "speculative", SP,
                                                   PROMPTS[0], 12, eos_token_id=-1)


@pytest.mark.parametrize("shared", [True, False])
def test_shared_pool_serves_another_requests_phrases(tiny_target, shared):
    """One slot, one round per step. Request A fills the pool; request B's prompt ends in a
    key A left there, and B's single round looks it up before B has harvested anything: a hit
    with the shared pool, none with per-request pools (B's key range was cleared for it)."""
    eng = Engine(tiny_target, method="lookahead", config=LA, slots=1, max_cache_len=64,
                 rounds_per_step=1, shared_pool=shared)
    eng.submit(REPEAT[1], RequestParams(max_tokens=24, stop_token_ids=()))
    _drain(eng)
    keys = np.asarray(eng.pool.keys)
    key = int(keys[keys >= 0][0])
    assert key < tiny_target.config.vocab_size  # slot 0's range starts at 0
    before = eng.metrics()["pool_hits"]
    eng.submit([3, key], RequestParams(max_tokens=1, stop_token_ids=()))
    _drain(eng)
    assert eng.metrics()["pool_hits"] - before == (1 if shared else 0)
    assert eng.metrics()["pool_lookups"] > 0


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"), (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"), (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(9))), "stop_token_ids"), (dict(stop="x"), "stop"),
    (dict(stop=("",)), "stop"),
])
def test_bad_request_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RequestParams(**kwargs)


class _CharTokenizer:
    """Token t <-> the character chr(ord('a') + t % 26): enough to test stop strings."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) - ord("a") for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_cut_the_text_and_bad_prompts_are_refused(tiny_target):
    target = dataclasses.replace(tiny_target, tokenizer=_CharTokenizer())
    eng = Engine(target, method="vanilla", config=None, slots=2, max_cache_len=64,
                 rounds_per_step=3, max_queue=2)
    full = eng.submit("hello", RequestParams(max_tokens=20, stop_token_ids=()))
    _drain(eng)
    text = full.result().text
    stop = text[7:9]
    cut = text.find(stop)
    h = eng.submit("hello", RequestParams(max_tokens=20, stop_token_ids=(), stop=(stop, "zzzz")))
    deltas = []
    while eng.step():
        pass
    deltas = list(h)
    r = h.result()
    assert r.finish_reason == "stop" and r.text == text[:cut]
    assert "".join(d.text for d in deltas) == text[:cut]
    assert r.token_ids == full.result().token_ids[:len(r.token_ids)]
    for prompt, match in (([], "empty"), ([5, 97], "outside the vocabulary"),
                          ([1.5], "integers"), (3, "prompt is neither a string")):
        with pytest.raises(ValueError, match=match):
            eng.submit(prompt, RequestParams(max_tokens=5))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.submit([5] * 40, RequestParams(max_tokens=30))
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.submit([5], RequestParams(max_tokens=5, stop_token_ids=(200,)))
    small = RequestParams(max_tokens=5)
    eng.submit([5], small)
    eng.submit([6], small)
    with pytest.raises(QueueFull):
        eng.submit([7], small)
    eng.stop(cancel=True)


def test_background_thread_streams_and_stops(tiny_target):
    eng = Engine(tiny_target, method="vanilla", config=None, **KW)
    with eng:
        hs = [eng.submit(p, RequestParams(max_tokens=n, stop_token_ids=()))
              for p, n in zip(PROMPTS[:4], LENGTHS)]
        streamed = [sum((d.token_ids for d in h), []) for h in hs]
    for p, n, h, s in zip(PROMPTS, LENGTHS, hs, streamed):
        assert s == h.result(timeout=60).token_ids == _reference(
            tiny_target, None, "vanilla", None, p, n, eos_token_id=-1)
    eng2 = Engine(tiny_target, method="vanilla", config=None, **KW)
    eng2.start()
    long = [eng2.submit(PROMPTS[0], RequestParams(max_tokens=40, stop_token_ids=()))
            for _ in range(5)]
    eng2.stop(cancel=True, timeout=60)
    assert all(h.done for h in long)
    assert {h.result().finish_reason for h in long} <= {"cancelled", "length"}
    assert "cancelled" in {h.result().finish_reason for h in long}
    with pytest.raises(RuntimeError, match="stopping"):
        eng2.submit([5], RequestParams(max_tokens=5))


def test_per_request_pools_when_speculation_is_off_at_every_load(tiny_pair):
    """shared_pool=False with every load level off runs plain decoding (no pool to split into
    per-slot ranges) and still answers exactly."""
    target, draft, _ = tiny_pair
    eng = Engine(target, draft, method="ouroboros", config={1: "off"}, shared_pool=False, **KW)
    assert eng.method == "vanilla"
    h = eng.submit(PROMPTS[1], RequestParams(max_tokens=6))
    _drain(eng)
    assert h.result().token_ids == _reference(target, None, "vanilla", None, PROMPTS[1], 6)


@pytest.mark.parametrize("shared", [True, False])
def test_context_phrases_enter_the_pool_when_a_request_is_admitted(tiny_target, shared):
    """A request's prompt n-grams are in the pool from its first round: the shared pool, or its
    slot's own key range, which is cleared of the slot's previous request before the insert
    (not after it). warmup()'s dummy prompts leave nothing behind; tokens are generate's."""
    from ouroboros_jax.pool import lookup, pool_occupancy

    cfg = dataclasses.replace(LA, context_phrases=True)
    eng = Engine(tiny_target, method="lookahead", config=cfg, slots=2, max_cache_len=64,
                 rounds_per_step=1, shared_pool=shared)
    eng.warmup()
    assert int(pool_occupancy(eng.pool)) == 0
    first = eng.submit(REPEAT[1], RequestParams(max_tokens=8, stop_token_ids=()))
    _drain(eng)  # slot 0 then holds its phrases
    assert first.result().token_ids == _reference(tiny_target, None, "lookahead", cfg,
                                                  REPEAT[1], 8, eos_token_id=-1)
    prompt = REPEAT[5]  # [3, 4, 50, 3, 4, 51, 3, 4]
    eng.submit(prompt, RequestParams(max_tokens=1, stop_token_ids=()))
    _drain(eng)  # slot 0 again, one round: the window is still warming up (no harvest)
    pool = eng.pool
    phrases, found = lookup(pool, jnp.int32(3), 2)
    assert np.asarray(found).all()
    assert np.asarray(phrases).tolist() == [[4, 51, 3], [4, 50, 3]]  # the later one first
    if not shared:  # slot 0's range holds this prompt's n-grams and nothing else
        V = tiny_target.config.vocab_size
        mine = (np.asarray(pool.stamps) > 0) & (np.asarray(pool.keys) < V)
        held = sorted(zip(np.asarray(pool.keys)[mine].tolist(),
                          map(tuple, np.asarray(pool.phrases)[mine].tolist())))
        want = sorted({(prompt[i], tuple(prompt[i + 1:i + 4])) for i in range(len(prompt) - 3)})
        assert held == want
