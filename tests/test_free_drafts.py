"""Ouroboros' free drafts (issue 52): the sources propose what a brute-force reference finds;
greedy output equals vanilla's at B = 1 and B > 1 at every threshold, from one where every
round is free (the draft never runs) to one where none is; sampling equals vanilla sampling
for the same seed and follows the exact distribution through a free chain; the stats count
free and draft rounds apart, and free rounds save draft forwards where the output copies its
context."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.decoding.common import init_sequences
from ouroboros_jax.decoding.free_drafts import context_match, free_proposal, pool_match
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.pool import init_pool, insert_many

from conftest import REPEAT, TINY_VOCAB, noisy_copy
from test_ouroboros import _chi2_p, _three_token_probs

CFG = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
M = CFG.ngram - 1


def free(threshold, cfg=CFG, **kw):
    return dataclasses.replace(cfg, free_drafts=True, free_threshold=threshold, **kw)


def ouro(target, draft, prompts, cfg, **kw):
    return oj.generate(target, prompts, draft=draft, method="ouroboros", config=cfg, **kw)


def check_counts(s, threshold=None):
    """Every live row round is free or drafted; accepted tokens add up by source; every row
    round is counted once in free_offered, and at a match of at least the threshold its
    would-be accepted tokens are the free tokens accepted."""
    hist = s["acceptance_histogram"]
    assert s["free_rounds"] + s["draft_rounds"] == sum(hist)
    assert sum(s["free_offered"]) == sum(hist)
    if threshold is not None:
        assert sum(s["free_offered"][threshold:]) == s["free_rounds"]
        assert sum(s["free_would_accept"][threshold:]) == s["free_tokens_accepted"]
    accepted = sum(max(j - 1, 0) * n for j, n in enumerate(hist))
    assert accepted == (s["accepted_from_draft_chain"] + s["accepted_from_pool_phrases"]
                        + s["accepted_from_prompt_lookup"])
    assert s["free_tokens_accepted"] <= accepted
    assert s["catch_up_forwards"] <= s["draft_forwards"]


def test_config_validation():
    assert OuroborosConfig().free_drafts is False  # off by default
    for field, bad in [("free_drafts", 1), ("free_drafts", None), ("free_threshold", 0),
                       ("free_threshold", True), ("free_threshold", 1.0)]:
        with pytest.raises(ValueError, match=rf"OuroborosConfig\.{field}"):
            OuroborosConfig(**{field: bad})
    with pytest.raises(ValueError, match=r"free_threshold must be an integer in \[1, 3\]"):
        OuroborosConfig(ngram=4, free_threshold=4)  # a match can be at most ngram - 1 long


# ------------------------------------------------------------------------- the free sources


def _seq(rows, S=40):
    tokens = np.zeros((len(rows), S), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
        tokens[i, len(r):] = r[-1]  # garbage past the row's end that would match: ignored
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    return init_sequences(jnp.asarray(tokens), lengths, S)


def _context_reference(row, gamma, max_match):
    """Brute force: (run, tokens) of the best earlier match of the row's last tokens: the
    longest (<= max_match), then the most tokens inside the row (<= gamma), then the latest."""
    L, best = len(row), (0, 0, -1, [])
    for j in range(L - 1):
        k = 0
        while k < max_match and j - k >= 0 and row[j - k] == row[L - 1 - k]:
            k += 1
        if k:
            cont = row[j + 1:j + 1 + gamma]
            best = max(best, (k, len(cont), j, cont))
    return best[0], best[3]


def _pool_reference(phrases_by_key, row, m):
    """Brute force: (run, tokens) of the pool's best continuation: under the key j tokens
    back, the newest phrase whose first j tokens are the row's last j, longest j first."""
    for j in reversed(range(min(m, len(row)))):
        key, last = row[len(row) - 1 - j], row[len(row) - j:]
        for p in reversed(phrases_by_key.get(key, [])):  # newest first
            if p[:j] == last:
                return j + 1, p[j:]
    return 0, []


ROWS = [list(r) for r in REPEAT] + [[4], [4, 4], [5, 6, 5, 6, 5], [7, 8, 9, 10, 11],
                                    [3, 9, 3, 9, 9, 3, 9]]


def test_context_match_is_prompt_lookups_best_candidate():
    rs = np.random.RandomState(0)
    rows = ROWS + [rs.randint(3, 8, size=n).tolist() for n in (3, 9, 20, 33)]
    for gamma in (2, 5):
        tok, count, run = (np.asarray(x) for x in context_match(_seq(rows), gamma, M))
        for i, r in enumerate(rows):
            want_run, want = _context_reference(r, gamma, M)
            assert (run[i], tok[i, :count[i]].tolist()) == (want_run, want), r


def test_pool_match_takes_the_longest_key_then_the_newest_phrase():
    rs = np.random.RandomState(1)
    rows = ROWS + [rs.randint(3, 8, size=n).tolist() for n in (3, 9, 20)]
    keys = rs.randint(3, 12, size=120)
    phrases = rs.randint(3, 12, size=(120, M))
    pool = insert_many(init_pool(TINY_VOCAB, 8, M), jnp.asarray(keys, jnp.int32),
                       jnp.asarray(phrases, jnp.int32))
    by_key: dict = {}
    for k, p in zip(keys.tolist(), phrases.tolist()):
        lst = by_key.setdefault(k, [])
        if p in lst:
            lst.remove(p)  # LRU: a repeated phrase is refreshed to newest
        lst.append(p)
        del lst[:-8]  # G = 8 slots per key: the oldest evicted
    tok, count, run = (np.asarray(x) for x in pool_match(pool, _seq(rows)))
    n_long = 0
    for i, r in enumerate(rows):
        want_run, want = _pool_reference(by_key, r, M)
        assert (run[i], tok[i, :count[i]].tolist()) == (want_run, want), r
        n_long += want_run > 1
    assert n_long > 0  # matches past the key were found and preferred
    # per-request key ranges: the same rows under offset keys find the same phrases
    off = np.arange(len(rows), dtype=np.int32) * TINY_VOCAB
    shifted = insert_many(init_pool(TINY_VOCAB * len(rows), 8, M, rows=TINY_VOCAB * len(rows)),
                          jnp.asarray(np.concatenate([keys + o for o in off]), jnp.int32),
                          jnp.asarray(np.concatenate([phrases] * len(rows)), jnp.int32))
    got = pool_match(shifted, _seq(rows), jnp.asarray(off))
    assert np.asarray(got[2]).tolist() == run.tolist()


def test_shadow_accepted_is_the_leading_agreement_within_the_kept_tokens():
    """A proposal's would-be accepted tokens: its leading agreement with what the round
    emitted, within its count and the kept tokens (a free row: all but the round's own)."""
    from ouroboros_jax.decoding.free_drafts import FreeDraft
    from ouroboros_jax.decoding.ouroboros import shadow_accepted

    prop = FreeDraft(tokens=jnp.asarray([[5, 6, 7, 8]] * 5, jnp.int32),
                     count=jnp.asarray([4, 4, 2, 4, 4], jnp.int32),
                     run=jnp.ones((5,), jnp.int32), from_context=jnp.ones((5,), bool))
    emitted = jnp.asarray([[5, 6, 9, 9, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [4, 6, 7, 8, 9],
                           [5, 6, 7, 8, 9]], jnp.int32)
    kept = jnp.asarray([5, 3, 5, 5, 3], jnp.int32)
    drafted = shadow_accepted(prop, emitted, kept, jnp.zeros((5,), bool))
    assert drafted.tolist() == [2, 3, 2, 0, 3]
    freed = shadow_accepted(prop, emitted, kept, jnp.ones((5,), bool))
    assert freed.tolist() == [2, 2, 2, 0, 2]


def test_free_proposal_prefers_the_longer_match():
    # the context repeats "5 6 7" (run 3); the pool knows only the key 7 (run 1) -> context
    row = [5, 6, 7, 8, 9, 5, 6, 7]
    pool = insert_many(init_pool(TINY_VOCAB, 4, M), jnp.asarray([7], jnp.int32),
                       jnp.asarray([[40, 41, 42]], jnp.int32))
    p = free_proposal(_seq([row]), pool, 4)
    assert (int(p.run[0]), bool(p.from_context[0])) == (3, True)
    assert np.asarray(p.tokens)[0, :int(p.count[0])].tolist() == [8, 9, 5, 6]
    # the pool holds "6 7 | 40 41 42" under 6: run 2 but the context's 3 still wins; a row
    # whose context offers nothing takes the pool's
    pool = insert_many(pool, jnp.asarray([6], jnp.int32), jnp.asarray([[7, 40, 41]], jnp.int32))
    p = free_proposal(_seq([row, [3, 6, 7]]), pool, 4)
    assert p.from_context.tolist() == [True, False] and p.run.tolist() == [3, 2]
    assert np.asarray(p.tokens)[1, :int(p.count[1])].tolist() == [40, 41]


# ---------------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def noisy_draft(tiny_target):
    return noisy_copy(tiny_target)


@pytest.fixture(scope="module")
def repeat_ref(tiny_target):
    return oj.generate(tiny_target, REPEAT, max_new_tokens=32, eos_token_id=-1).tokens


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_greedy_equals_vanilla_batched(tiny_pair, noisy_draft, repeat_ref, threshold):
    """B = 6, rows free and drafting side by side in the same rounds (the draft runs for some
    rows while others verify their free proposals)."""
    target, unrelated, _ = tiny_pair
    kw = dict(max_new_tokens=32, eos_token_id=-1)
    for draft in (unrelated, noisy_draft):
        out = ouro(target, draft, REPEAT, free(threshold), **kw)
        assert out.tokens == repeat_ref
        s = out.stats
        check_counts(s, threshold)
        assert s["free_rounds"] > 0 and s["draft_rounds"] > 0, s
        assert s["free_tokens_accepted"] > 0


@pytest.mark.parametrize("threshold", [1, 3])
def test_greedy_equals_vanilla_one_row(tiny_target, noisy_draft, repeat_ref, threshold):
    """B = 1: the round's lax.cond runs the draft or not."""
    kw = dict(max_new_tokens=32, eos_token_id=-1)
    n_free = 0
    for p, want in zip(REPEAT, repeat_ref):
        out = ouro(tiny_target, noisy_draft, [p], free(threshold), **kw)
        assert out.tokens[0] == want, p
        check_counts(out.stats, threshold)
        n_free += out.stats["free_rounds"]
    assert n_free > 0


def _full_pool(g=CFG.guesses, m=M):
    """Every key of the vocabulary holds g random phrases: a free proposal for every row in
    every round at threshold 1."""
    rs = np.random.RandomState(0)
    keys = np.repeat(np.arange(TINY_VOCAB), g)
    return insert_many(init_pool(TINY_VOCAB, g, m), jnp.asarray(keys, jnp.int32),
                       jnp.asarray(rs.randint(3, TINY_VOCAB, (len(keys), m)), jnp.int32))


@pytest.mark.parametrize("rows", [1, 6])
def test_every_round_free_never_runs_the_draft(tiny_target, noisy_draft, repeat_ref, rows):
    kw = dict(max_new_tokens=32, eos_token_id=-1)
    prompts, want = REPEAT[:rows], repeat_ref[:rows]
    out = ouro(tiny_target, noisy_draft, prompts, free(1), pool=_full_pool(), **kw)
    assert out.tokens == want
    s = out.stats
    check_counts(s, 1)
    assert s["draft_rounds"] == 0 and s["free_rounds"] == sum(s["acceptance_histogram"])
    assert s["draft_forwards"] == 0 and s["draft_calls"] == 0


def test_no_round_free_is_the_plain_run(tiny_target, noisy_draft, random_prompts):
    """Where no proposal reaches the threshold the run is free drafts off's, to the counter:
    no catch-up forward, the same draft forwards and rounds."""
    prompts = [p for p in random_prompts if len(p) >= 8][:4]
    kw = dict(max_new_tokens=12, eos_token_id=-1)
    off = ouro(tiny_target, noisy_draft, prompts, CFG, **kw)
    on = ouro(tiny_target, noisy_draft, prompts, free(M), **kw)
    assert on.tokens == off.tokens == oj.generate(tiny_target, prompts, **kw).tokens
    assert on.stats["free_rounds"] == 0
    for k in ("draft_forwards", "draft_calls", "target_calls", "acceptance_histogram",
              "suffix_tokens_accepted", "draft_rounds"):
        assert on.stats[k] == off.stats[k], k
    assert on.stats["catch_up_forwards"] == 0


@pytest.fixture(scope="module")
def bigram(tiny_target):
    """The tiny target with every attention output and MLP zeroed: its next token depends on
    the last token only, so its greedy output soon cycles and repeats its context."""
    layers = dict(tiny_target.params["layers"])
    layers["wo"] = jnp.zeros_like(layers["wo"])
    layers["w_down"] = jnp.zeros_like(layers["w_down"])
    return oj.Model(tiny_target.config, {**tiny_target.params, "layers": layers})


def _cycling_prompts(model):
    """Starts followed by 16 tokens of the model's greedy orbit: its output goes on
    repeating them (one row's orbit has 3 tokens, the others' 14)."""
    starts = [[3], [17, 40], [77], [90, 5, 6]]
    orbit = oj.generate(model, starts, max_new_tokens=16, eos_token_id=-1).tokens
    return [s + o for s, o in zip(starts, orbit)]


@pytest.mark.parametrize("phrase_drafting", [True, False])
def test_copying_output_saves_draft_forwards(bigram, tiny_pair, phrase_drafting):
    """Where the output repeats its context most rounds are free: fewer draft forwards than
    with free drafts off for the same tokens, the free chains' tokens accepted and counted
    under the context's and the pool's sources."""
    kw = dict(max_new_tokens=40, eos_token_id=-1)
    prompts = _cycling_prompts(bigram)
    ref = oj.generate(bigram, prompts, **kw).tokens
    cfg = dataclasses.replace(CFG, phrase_drafting=phrase_drafting)
    draft = tiny_pair[1]
    off = ouro(bigram, draft, prompts, cfg, **kw)
    on = ouro(bigram, draft, prompts, free(2, cfg), **kw)
    assert on.tokens == off.tokens == ref
    s = on.stats
    check_counts(s, 2)
    assert s["free_rounds"] > 2 * s["draft_rounds"], s
    assert s["draft_forwards"] < off.stats["draft_forwards"], (s, off.stats)
    assert s["free_tokens_accepted"] > 0 and s["accepted_from_prompt_lookup"] > 0
    assert s["eta"] > off.stats["eta"]  # an unrelated draft's chains are rarely accepted
    assert off.stats["free_rounds"] == 0 and off.stats["accepted_from_prompt_lookup"] == 0
    # one row at a time: the same tokens, the rounds that skip the draft skip it
    for p, want in zip(prompts[:2], ref):
        one = ouro(bigram, draft, [p], free(2, cfg), **kw)
        assert one.tokens[0] == want
        check_counts(one.stats)
        assert one.stats["free_rounds"] > 0


def test_eos_max_new_tokens_and_adaptive_drafting_with_free_chains(bigram, tiny_pair):
    """Cut-offs land inside accepted free chains (the context copies whole chains here), and
    adaptive drafting's cut chains mix with free ones: the tokens stay vanilla's."""
    prompts = _cycling_prompts(bigram)
    draft = tiny_pair[1]
    full = oj.generate(bigram, prompts, max_new_tokens=24, eos_token_id=-1).tokens
    for k in (1, 2, 3, 5, 8):
        out = ouro(bigram, draft, prompts, free(2), max_new_tokens=k, eos_token_id=-1)
        assert out.tokens == [o[:k] for o in full], k
        check_counts(out.stats, 2)
    n_cut = 0
    for pos in (2, 4, 7):
        eos = full[1][pos]
        ref = oj.generate(bigram, prompts, max_new_tokens=24, eos_token_id=eos).tokens
        got = ouro(bigram, draft, prompts, free(2), max_new_tokens=24, eos_token_id=eos)
        assert got.tokens == ref, pos
        check_counts(got.stats, 2)
        assert got.stats["free_tokens_accepted"] > 0
        n_cut += sum(len(r) < 24 for r in ref)
    assert n_cut >= 3
    adaptive = ouro(bigram, draft, prompts, free(2, confidence=0.5), max_new_tokens=24,
                    eos_token_id=-1)
    assert adaptive.tokens == full and adaptive.stats["free_rounds"] > 0


def test_greedy_logprobs_equal_vanillas(bigram, tiny_pair):
    kw = dict(max_new_tokens=24, eos_token_id=-1, logprobs=True, top_logprobs=2)
    prompts = _cycling_prompts(bigram)[::3]
    van = oj.generate(bigram, prompts, **kw)
    got = ouro(bigram, tiny_pair[1], prompts, free(1), **kw)
    assert got.tokens == van.tokens and got.stats["free_rounds"] > 0
    for a, b in zip(got.logprobs, van.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-5)


# ----------------------------------------------------------------------------------- sampling


def test_sampling_identical_to_vanilla_same_seed(tiny_target, noisy_draft, bigram, tiny_pair):
    """Free proposals are fixed before the target's forward and every draw is keyed by (row,
    position): the very tokens of vanilla sampling with the same seed."""
    kw = dict(max_new_tokens=32, eos_token_id=-1, temperature=0.7, top_k=30, top_p=0.95,
              seed=5)
    ref = oj.generate(tiny_target, REPEAT, **kw).tokens
    for thr in (1, 2):
        out = ouro(tiny_target, noisy_draft, REPEAT, free(thr), **kw)
        assert out.tokens == ref
        assert out.stats["free_rounds"] > 0
    kw.update(temperature=0.3)
    prompts = _cycling_prompts(bigram)
    ref = oj.generate(bigram, prompts, **kw).tokens
    out = ouro(bigram, tiny_pair[1], prompts, free(2), **kw)
    assert out.tokens == ref
    assert out.stats["free_tokens_accepted"] > 0  # sampled free chains really were accepted


def test_first_three_tokens_distribution_through_a_free_chain(small_vocab):
    """The pool holds the likeliest first two tokens under the prompt's last token (which the
    context never saw before): every row's first round verifies that free chain (no draft
    forward), token 3 from the round's bonus; the three tokens follow the exact distribution."""
    model, tm = small_vocab
    prompt, temperature, n = [1, 5, 3, 6], 0.7, 4000
    want = _three_token_probs(tm, prompt, temperature)
    top = int(np.argmax(want.sum(2)))
    pool = insert_many(init_pool(8, 4, 2), jnp.asarray([6], jnp.int32),
                       jnp.asarray([[top // 8, top % 8]], jnp.int32))
    cfg = OuroborosConfig(gamma=2, window=3, ngram=3, guesses=4, suffixes=3,
                          context_phrases=False, free_drafts=True, free_threshold=1)
    out = ouro(model, noisy_copy(model), [prompt] * n, cfg, pool=pool, max_new_tokens=3,
               temperature=temperature, seed=31, eos_token_id=-1)
    s = out.stats
    assert s["free_rounds"] >= n  # every row's first round
    assert s["free_tokens_accepted"] > n // 10  # the free chain really was accepted
    counts = np.zeros(512)
    for t in out.tokens:
        counts[t[0] * 64 + t[1] * 8 + t[2]] += 1
    assert _chi2_p(counts, want.ravel()) > 1e-3
    wrong = _three_token_probs(tm, prompt, 1.0)
    assert _chi2_p(counts, wrong.ravel()) < 1e-6


# ------------------------------------------------------------------------------- the forwards


def test_a_free_round_traces_a_catch_up_forward_and_a_skippable_draft(monkeypatch, tiny_pair):
    """With free drafts a round traces, before the usual draft forwards, one catch-up forward
    of 1 + gamma + M tokens (reading one row of logits), and the same target forward; off,
    the round's forwards are unchanged."""
    from ouroboros_jax.decoding.common import make_pair

    from test_ouroboros import _round, _traced_forwards

    pair = make_pair(tiny_pair[0], tiny_pair[1])
    plain = _traced_forwards(monkeypatch, pair, *_round("ouroboros", pair, CFG))
    ours = _traced_forwards(monkeypatch, pair, *_round("ouroboros", pair, free(2)))
    assert ours == [("draft", 1 + CFG.gamma + M, 1)] + plain


# ------------------------------------------------------------------------------------ serving


@pytest.mark.parametrize("shared_pool", [True, False])
def test_serving_engine_requests_equal_vanilla(tiny_pair, shared_pool):
    """The engine's continuous batching over free drafts: requests admitted as slots free up
    and mid-generation, load levels switching (gamma 4, gamma 6, speculation off: plain rounds
    that leave the draft's lag as it was), shared or per-request pools (keys offset per slot):
    each request's tokens are vanilla's."""
    from ouroboros_jax.serving import Engine, RequestParams

    target, draft, _ = tiny_pair
    levels = {1: free(1), 2: free(1, gamma=6), 3: "off"}
    eng = Engine(target, draft, method="ouroboros", config=levels, slots=3, max_cache_len=96,
                 rounds_per_step=3, shared_pool=shared_pool)
    prompts = REPEAT + [[9, 10, 11], [44]]
    lengths = [14, 3, 9, 20, 6, 11, 16, 5]
    first = [eng.submit(p, RequestParams(max_tokens=n)) for p, n in zip(prompts[:5], lengths)]
    eng.step()
    second = [eng.submit(p, RequestParams(max_tokens=n))
              for p, n in zip(prompts[5:], lengths[5:])]
    while eng.step():
        pass
    for p, n, h in zip(prompts, lengths, first + second):
        want = oj.generate(target, [p], max_new_tokens=n).tokens[0]
        assert h.result(timeout=0).token_ids == want, (p, n)
    m = eng.metrics()
    assert m["requests_finished"] == len(prompts)
    assert m["accepted_by_source"]["prompt_lookup"] > 0  # free chains from the context
    # rounds by kind: free and drafted apart, the draft forwards and their catch-up share
    assert m["free_rounds"] > 0 and m["draft_rounds"] > 0, m
    assert m["catch_up_forwards"] <= m["draft_forwards"] and m["draft_forwards"] > 0, m
    from ouroboros_jax.serving.metrics import render

    text = render(m)
    for name in ("free_rounds", "draft_rounds", "draft_forwards", "catch_up_forwards"):
        assert f"ouroboros:spec_decode_num_{name}_total {m[name]}" in text, name


def test_metrics_count_rounds_by_kind_as_the_steps_increase():
    from ouroboros_jax.serving.metrics import EngineCounters

    c = EngineCounters(8, ("draft_chain", "pool_phrases", "prompt_lookup"), True)
    c.step(2, "a", 0, 4, {"free_rounds": 3, "draft_rounds": 1, "draft_forwards": 5,
                          "catch_up_forwards": 1, "pool_hits": 0})
    c.step(2, "a", 0, 4, {"free_rounds": 4, "draft_rounds": 4, "draft_forwards": 9,
                          "catch_up_forwards": 2, "pool_hits": 0})
    m = c.snapshot()
    assert [m[k] for k in ("free_rounds", "draft_rounds", "draft_forwards",
                           "catch_up_forwards")] == [4, 4, 9, 2]
    # a method without a draft model's chain (lookahead) or a pool (speculative): none
    for sources, pool in ((("pool_phrases",), True), (("draft_chain",), False)):
        assert "free_rounds" not in EngineCounters(8, sources, pool).snapshot()
