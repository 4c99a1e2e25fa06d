"""The serving layer's units on their own: incremental detokenization and stop strings
(`serving/output.py`), the one validation path's field names (`request.py`), and the
server's handlers called directly (`serving/server.py`'s service)."""

import json
import random

import pytest

from ouroboros_jax.serving.output import Detokenizer, StopMatcher, TextStream


def byte_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, a few merges): characters outside
    ASCII are two to four tokens, so one character's bytes arrive over several steps."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1}
    vocab.update({c: 2 + i for i, c in enumerate(sorted(alphabet))})
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab, merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


def metaspace_tokenizer():
    """A SentencePiece-like tokenizer (words start with '▁', decoding drops the first one's
    space) with byte fallback: a lone token's text differs from its text after a neighbour."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁cat", "▁sat", "s", "at", "▁on", "t", "h", "e", "c", "a", "o", "n"]
    vocab = [(p, -float(i)) for i, p in enumerate(pieces)]
    t = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


TEXTS = ["the cat sat on the mat", "café – naïve résumé", "日本語のテキスト and ascii",
         "emoji 🐍🦀 mixed with ü", "the cat 😀 sat"]


def _streamed(tok, ids, chunk_sizes):
    d, parts, i = Detokenizer(tok), [], 0
    for n in chunk_sizes:
        parts.append(d.push(ids[i:i + n]))
        i += n
    parts.append(d.push(ids[i:]))
    parts.append(d.flush())
    return parts


@pytest.mark.parametrize("make", [byte_tokenizer, metaspace_tokenizer])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(make, text):
    """Pieces joined equal one decode of all the tokens, whatever the step sizes: one token a
    step (a multi-byte character's bytes in separate steps), random steps, all at once; no
    piece shows a half character."""
    tok = make()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in full
    rng = random.Random(len(text))
    for sizes in ([1] * len(ids), [rng.randint(1, 4) for _ in range(len(ids))], [len(ids)]):
        parts = _streamed(tok, ids, sizes)
        assert "".join(parts) == full, (sizes, parts)
        assert not any("\ufffd" in p for p in parts)


@pytest.mark.parametrize("cleanup", [False, True])
@pytest.mark.parametrize("make", [byte_tokenizer, metaspace_tokenizer])
def test_the_fast_decoder_equals_the_tokenizers_decode(make, cleanup):
    """`output.decoder` gives tokenizer.decode(ids, skip_special_tokens=True), special tokens
    and spaces before punctuation included, whether the tokenizer cleans up spaces (then
    through transformers) or not (then through its Rust backend directly)."""
    from ouroboros_jax.serving.output import decoder

    tok = make()
    tok.clean_up_tokenization_spaces = cleanup
    dec = decoder(tok)
    for text in TEXTS + ["the cat . sat , on"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = [tok.bos_token_id] + ids + [tok.eos_token_id]
        assert dec(ids) == tok.decode(ids, skip_special_tokens=True), text


def test_a_split_character_waits_for_its_last_byte():
    tok = byte_tokenizer()
    ids = tok("a🐍", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # 'a' and the snake's four bytes
    d = Detokenizer(tok)
    assert d.push(ids[:1]) == "a"
    assert [d.push([t]) for t in ids[1:]] == ["", "", "", "🐍"]


def test_work_per_step_does_not_grow_with_the_output():
    """Each step decodes a window of the last steps' tokens, not the whole list."""
    tok = byte_tokenizer()
    seen = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok("the cat sat on the mat " * 40, add_special_tokens=False)["input_ids"]
    d = Detokenizer(Counting())
    for i in range(0, len(ids), 3):
        d.push(ids[i:i + 3])
    assert len(ids) > 300 and max(seen) <= 6


@pytest.mark.parametrize("stops,pieces,want,stopped", [
    (("STOP",), ["abc ST", "O", "P more"], "abc ", True),  # spans three pieces
    (("xy", "bc"), ["ab", "cxy"], "a", True),  # the earliest match wins
    (("zz",), ["hello", " world"], "hello world", False),
    (("é!",), ["caf", "é", "!"], "caf", True),
])
def test_stop_strings_across_pieces(stops, pieces, want, stopped):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert (out, m.stopped) == (want, stopped)


def test_text_stream_cuts_a_stop_string_split_over_tokens():
    """A stop string whose characters (and a multi-byte character's bytes) arrive in separate
    tokens: the text sent is the full decode cut before it, and nothing after."""
    tok = byte_tokenizer()
    ids = tok("the café end. the rest", add_special_tokens=False)["input_ids"]
    full = tok.decode(ids)
    s = TextStream(tok, stops=("é end",))
    sent, hit = [], False
    for t in ids:
        piece, hit = s.push([t])
        sent.append(piece)
        if hit:
            break
    assert hit and "".join(sent) == full[:full.index("é end")] == s.text
    plain = TextStream(tok)
    for t in ids:
        plain.push([t])
    assert plain.close() == ("", False) and plain.text == full


# ------------------------------------------------------------------ one validation path
from ouroboros_jax.request import (FieldError, RequestParams, check_fits,  # noqa: E402
                                   validate_scalars)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens="5"), "max_tokens"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=True), "top_k"), (dict(seed=2**32), "seed"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids"), (dict(stop=("a", 3)), "stop"),
])
def test_request_params_errors_carry_the_field(kwargs, field):
    with pytest.raises(FieldError) as e:
        RequestParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_generate_names_its_budget_max_new_tokens():
    with pytest.raises(FieldError) as e:
        validate_scalars(0, 0.0, 1.0, 0, 0)
    assert e.value.field == "max_new_tokens"


@pytest.mark.parametrize("n,max_tokens,field", [(64, 1, "prompt"), (70, 1, "prompt"),
                                                (40, 25, "max_tokens")])
def test_cache_fit_names_the_prompt_or_the_budget(n, max_tokens, field):
    with pytest.raises(FieldError) as e:
        check_fits(n, max_tokens, 64)
    assert e.value.field == field
    check_fits(40, 24, 64)  # fits exactly


def test_prompt_errors_name_the_prompt_field(tiny_target):
    from ouroboros_jax.request import prompt_ids

    for p, name in (([], "prompt"), ([1, 10**6], "prompt"), ("text", "prompts[2]"),
                    ([{"role": "user", "content": "x"}], "prompt")):
        with pytest.raises(FieldError) as e:
            prompt_ids(tiny_target, p, name)
        assert e.value.field == name.split("[")[0], p


# ------------------------------------------------------------------ the service, without HTTP
import asyncio  # noqa: E402

from ouroboros_jax.request import validate_request  # noqa: E402
from ouroboros_jax.serving.handle import Delta, QueueFull, RequestHandle  # noqa: E402
from ouroboros_jax.serving.openai_api import APIError  # noqa: E402
from ouroboros_jax.serving.server import EngineAPI, Service  # noqa: E402


class FakeEngine:
    """An EngineAPI over no model: prompts are token ids below 100, the cache holds 64."""

    model_name, limit, default_stop_ids, running = "fake", 64, (2,), True

    def __init__(self, tokenizer=None, full=False):
        self.tokenizer, self.full, self.submitted = tokenizer, full, []

    def tokens(self, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise FieldError("prompt", "prompt is a chat conversation but no template")
            return [5] * len(prompt[0]["content"])
        if not all(isinstance(t, int) and 0 <= t < 100 for t in prompt):
            raise FieldError("prompt", f"prompt holds an id outside [0, 100): {prompt}")
        return list(prompt)

    def validate(self, ids, params):
        import numpy as np

        return validate_request(ids, params, limit=self.limit, vocab_size=100,
                                default_eos=np.array([2] + [-1] * 7, np.int32))

    def submit(self, request):
        if self.full:
            raise QueueFull("1 request is already waiting (max_queue=1)")
        self.submitted.append(request)
        return RequestHandle(request, self.tokenizer)

    def metrics(self):
        return {}

    def start(self):
        pass

    def stop(self, cancel=False, timeout=None):
        pass


GOOD = dict(model="fake", prompt=[5, 6, 7], max_tokens=8, temperature=0)


@pytest.mark.parametrize("fields,param", [
    (dict(max_tokens="8"), "max_tokens"), (dict(max_tokens=70), "max_tokens"),
    (dict(max_tokens=None, max_completion_tokens=62), "max_completion_tokens"),
    (dict(prompt=[5] * 64), "prompt"), (dict(prompt=[5, 500]), "prompt"),
    (dict(temperature=2.5), "temperature"), (dict(temperature="0"), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"), (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[1, -1]), "stop_token_ids"),
    (dict(stop_token_ids=[150]), "stop_token_ids"), (dict(model="other"), "model"),
    (dict(n=0), "n"), (dict(stream="yes"), "stream"),
])
def test_service_refuses_a_bad_field_by_its_name(fields, param):
    svc = Service(FakeEngine(), ["fake"])
    with pytest.raises(APIError) as e:
        svc.accept(dict(GOOD, **fields), chat=False)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert svc.accept(dict(GOOD), chat=False).handle.prompt == [5, 6, 7]


def test_service_accepts_with_openai_defaults():
    eng = FakeEngine(tokenizer=object())
    svc = Service(eng, ["fake", "alias"])
    call = svc.accept(dict(model="alias", prompt=[5], top_k=-1, stop="x",
                           stop_token_ids=[9]), chat=False)
    p = eng.submitted[-1].params
    assert (call.model, p.max_tokens, p.temperature, p.top_k, p.stop) == ("alias", 16, 1.0, 0,
                                                                          ("x",))
    assert p.stop_token_ids == (2, 9) and eng.submitted[-1].stop_ids == {2, 9}
    chat = svc.accept({"messages": [{"role": "user", "content": "abcd"}]}, chat=True)
    # chat without max_tokens: what the cache leaves after the 4-token prompt
    assert chat.model == "fake" and eng.submitted[-1].params.max_tokens == 60
    with pytest.raises(APIError) as e:
        Service(FakeEngine(), ["fake"]).accept(
            {"messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert e.value.param == "messages"


def test_service_queue_full_stopping_health_and_models():
    svc = Service(FakeEngine(full=True))
    with pytest.raises(APIError) as e:
        svc.accept(dict(GOOD), chat=False)
    assert e.value.status == 429 and e.value.code == "queue_full"
    assert svc.health() == (200, {"status": "ok"})
    svc.stopping = True
    assert svc.health()[0] == 503
    with pytest.raises(APIError) as e:
        svc.accept(dict(GOOD), chat=False)
    assert e.value.status == 503
    down = FakeEngine()
    down.running = False
    assert Service(down).health() == (503, {"status": "engine stopped"})
    m = Service(FakeEngine(), ["a", "b"]).models()
    assert [d["id"] for d in m["data"]] == ["a", "b"]
    assert {d["max_model_len"] for d in m["data"]} == {64}
    assert isinstance(FakeEngine(), EngineAPI)


def _finished_queue(handle, deltas, reason):
    q = asyncio.Queue()
    for d in deltas:
        q.put_nowait(("delta", d))
    q.put_nowait(("done", handle.finish(reason, hist_len=3)))
    return q


def test_service_streams_and_answers_from_the_queue():
    async def run():
        svc = Service(FakeEngine(), ["fake"])
        call = svc.accept(dict(GOOD, stream=True, stream_options={"include_usage": True}),
                          chat=False)
        call.handle.tokens = [8, 9]
        q = _finished_queue(call.handle, [Delta([8], "a"), Delta([9], "b")], "length")
        events = [e async for e in svc.events(call, q)]
        call2 = svc.accept(dict(GOOD), chat=False)
        call2.handle.tokens = [8]
        q2 = _finished_queue(call2.handle, [Delta([8], "a")], "stop")
        body = await svc.answer(call2, q2, asyncio.sleep(60))
        return events, body

    events, body = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [p["choices"][0]["text"] for p in payloads[:3]] == ["a", "b", ""]
    assert payloads[2]["choices"][0]["finish_reason"] == "length"
    assert payloads[3]["usage"]["completion_tokens"] == 2
    assert body["choices"][0]["token_ids"] == [8] and body["choices"][0]["text"] == "a"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_service_reports_a_cancelled_request_as_503():
    async def run():
        svc = Service(FakeEngine(), ["fake"])
        call = svc.accept(dict(GOOD), chat=False)
        return await svc.answer(call, _finished_queue(call.handle, [], "cancelled"),
                                asyncio.sleep(60))

    with pytest.raises(APIError) as e:
        asyncio.run(run())
    assert e.value.status == 503 and e.value.code == "cancelled"


# ------------------------------------------------------------------ serve's sizing by memory
from ouroboros_jax.bounds import kv_bytes_per_token  # noqa: E402
from ouroboros_jax.serving.sizing import DEFAULT_MAX_MODEL_LEN, plan_cache  # noqa: E402


def _token_bytes(m):
    """By hand: k and v, per layer, per kv head, per head dim, fp32."""
    c = m.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def test_kv_bytes_per_token_is_the_memory_plans_formula(tiny_target):
    from ouroboros_jax.sharding import memory_plan

    c = tiny_target.config
    assert kv_bytes_per_token(c, 4) == _token_bytes(tiny_target)
    plan = memory_plan(c, 1, 1, batch=3, cache_len=512, dtype="float32")
    assert plan["kv_cache_per_device_bytes"] == 3 * 512 * kv_bytes_per_token(c, 4)


def test_plan_caps_requests_and_fits_slots_to_the_budget(tiny_pair):
    target, draft, _ = tiny_pair
    context = target.config.max_position_embeddings  # 1024 < the default cap
    assert context < DEFAULT_MAX_MODEL_LEN
    per = _token_bytes(target)
    slot = 256 * per  # a 256-token request's cache (a power of two already)
    # room for 3 slots at a fraction of 0.5: 8 asked, 3 run
    p = plan_cache(target, None, slots=8, memory_fraction=0.5, max_model_len=256,
                   memory=2 * 3 * slot + 1)
    assert (p.slots, p.max_model_len, p.cache_tokens, p.token_bytes) == (3, 256, 256, per)
    assert p.kv_bytes == 3 * slot and p.budget_bytes == 3 * slot
    assert "3 slots (--slots 8 do not fit --memory-fraction) x 256 cache tokens" in p.describe()
    # the default cap is the model's context here; enough memory: the slots asked for
    p = plan_cache(target, None, slots=4, memory=2**40)
    assert (p.slots, p.max_model_len, p.cache_tokens) == (4, context, context)
    assert p.source == "default --max-model-len"
    # --max-cache-len wins over --max-model-len; the method's margin rounds the cache up
    p = plan_cache(target, None, slots=2, max_model_len=256, max_cache_len=100, margin=30,
                   memory=2**40)
    assert (p.max_model_len, p.cache_tokens, p.source) == (100, 256, "--max-cache-len")
    # a draft the method runs has a cache of its own
    both = plan_cache(target, draft, slots=1, max_model_len=256, memory=2**40)
    assert both.token_bytes == per + _token_bytes(draft)


def test_plan_refuses_by_flag(tiny_target):
    per = _token_bytes(tiny_target)
    with pytest.raises(ValueError, match=r"--memory-fraction 0.5 gives the KV caches .* less "
                                         r"than one slot of 512 cache tokens .* lower "
                                         r"--max-model-len"):
        plan_cache(tiny_target, None, slots=8, memory_fraction=0.5, max_model_len=512,
                   memory=512 * per)
    with pytest.raises(ValueError, match="--max-model-len 4096 exceeds the model's context "
                                         "of 1024 tokens"):
        plan_cache(tiny_target, None, slots=1, max_model_len=4096, memory=2**40)
    with pytest.raises(ValueError, match=r"--memory-fraction must be in \(0, 1\]"):
        plan_cache(tiny_target, None, slots=1, memory_fraction=0.0)


def test_sized_engine_queues_what_its_slots_cannot_hold_and_caps_requests(tiny_target):
    """Memory for one slot of 64 tokens: requests beyond it wait (none fails) and each equals
    generate's; one over the cap is refused naming max_tokens, as the server's 400 does."""
    import ouroboros_jax as oj
    from ouroboros_jax.serving.engine import Engine

    plan = plan_cache(tiny_target, None, slots=4, max_model_len=64,
                      memory=10 * 64 * _token_bytes(tiny_target) + 1, memory_fraction=0.1)
    assert plan.slots == 1
    eng = Engine(tiny_target, method="vanilla", config=None, slots=plan.slots,
                 max_cache_len=plan.max_model_len, rounds_per_step=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    hs = [eng.submit(p, RequestParams(max_tokens=6, stop_token_ids=())) for p in prompts]
    eng.step()
    m = eng.metrics()
    assert (m["busy_slots"], m["queue_length"]) == (1, 2)
    while eng.step():
        pass
    for p, h in zip(prompts, hs):
        assert h.result().finish_reason == "length"
        assert h.result().token_ids == oj.generate(tiny_target, [p], max_new_tokens=6,
                                                   eos_token_id=-1).tokens[0]
    with pytest.raises(FieldError) as e:
        eng.validate([5] * 10, RequestParams(max_tokens=55))
    assert e.value.field == "max_tokens" and "cache limit of 64 tokens; at most 54" in str(e.value)


# ------------------------------------------------------------------ compile progress
def test_warmup_reports_each_program_with_its_time(tiny_target):
    from ouroboros_jax.serving.engine import Engine
    from ouroboros_jax.serving.warmup import default_widths

    assert default_widths(2048) == (16, 32, 64, 128, 256)
    assert default_widths(40) == (16, 32, 64)  # prompts up to 39 tokens: bucket 64
    assert default_widths(16) == (16,)
    eng = Engine(tiny_target, method="vanilla", config=None, slots=2, max_cache_len=64)
    seen = []
    eng.warmup((16, 20), progress=lambda name, s: seen.append((name, s)))
    # slots 2: row buckets of 1 and 2 (all) rows
    names = ["insert (prompt width 16)", "insert (prompt width 32)",
             "step (1+ busy slots, plain, greedy, 1 row)",
             "step (1+ busy slots, plain, sampling, 1 row)",
             "step (1+ busy slots, plain, greedy)", "step (1+ busy slots, plain, sampling)"]
    # each program announced, then timed
    assert [n for n, _ in seen] == [n for n in names for _ in range(2)]
    assert [s is None for _, s in seen] == [True, False] * 6
    assert all(s >= 0 for _, s in seen[1::2])
    h = eng.submit([5, 6, 7], RequestParams(max_tokens=3, stop_token_ids=()))
    while eng.step():
        pass
    assert len(h.result().token_ids) == 3  # the warm-up's dummy rows left nothing behind
