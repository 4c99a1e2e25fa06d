"""Lookahead decoding: greedy equals vanilla token for token, sampling equals vanilla sampling
for the same seed, and the first two sampled tokens follow the exact distribution; the prompt's
n-grams in the pool (context phrases) change how fast, never what."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as sps

import ouroboros_jax as oj
from ouroboros_jax.decoding.lookahead import LookaheadConfig
from ouroboros_jax.pool import PhrasePool, init_pool, insert_many

from conftest import REPEAT, ngram_pool

CFG = LookaheadConfig(window=4, ngram=4, guesses=4)
CTX = {on: dataclasses.replace(CFG, context_phrases=on) for on in (True, False)}


def test_config_validation():
    with pytest.raises(ValueError, match="window"):
        LookaheadConfig(window=0)
    with pytest.raises(ValueError, match="ngram"):
        LookaheadConfig(ngram=2)
    with pytest.raises(ValueError, match="guesses"):
        LookaheadConfig(guesses=0)
    with pytest.raises(ValueError, match="pool_rows"):
        LookaheadConfig(pool_rows=0)
    assert LookaheadConfig() == LookaheadConfig(window=15, ngram=5, guesses=15)


def test_greedy_equals_vanilla_batched(tiny_target, random_prompts):
    prompts = random_prompts[:50] + REPEAT
    kw = dict(max_new_tokens=20, eos_token_id=-1)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    out = oj.generate(tiny_target, prompts, method="lookahead", config=CFG, **kw)
    assert out.tokens == ref
    s = out.stats
    assert s["new_tokens"] == 20 * len(prompts)
    assert s["guess_tokens_accepted"] > 0  # the pool really was used
    assert s["new_tokens"] == sum(k * c for k, c in enumerate(s["acceptance_histogram"]))
    assert s["pool_occupancy"] > 0 and s["pool_bytes"] > 0
    assert isinstance(out.pool, PhrasePool)


def test_greedy_equals_vanilla_unbatched_short_prompts(tiny_target, random_prompts):
    prompts = [[7], [3], [96]] + [p for p in random_prompts if len(p) <= 16][:5] + REPEAT[:2]
    kw = dict(max_new_tokens=16, eos_token_id=-1)
    for p in prompts:
        ref = oj.generate(tiny_target, [p], **kw).tokens[0]
        assert oj.generate(tiny_target, [p], method="lookahead", config=CFG, **kw).tokens[0] \
            == ref, p


def test_max_new_tokens_and_eos_inside_accepted_blocks(tiny_target):
    prompts = REPEAT
    full = oj.generate(tiny_target, prompts, max_new_tokens=24, eos_token_id=-1).tokens
    # a pool holding vanilla's own continuations: guesses are accepted in long blocks
    pool = ngram_pool(97, [p + o for p, o in zip(prompts, full)], CFG.ngram, CFG.guesses)
    etas = []
    for k in range(1, 10):
        out = oj.generate(tiny_target, prompts, method="lookahead", config=CFG, pool=pool,
                          max_new_tokens=k, eos_token_id=-1)
        assert out.tokens == [o[:k] for o in full], k  # never overshoots
        etas.append(out.stats["eta"])
    assert max(etas) > 2.0, etas
    # EOS = a token vanilla emits at some position >= 3: the cut must land mid-block
    n_cut = 0
    for row in range(len(prompts)):
        eos = full[row][5]
        ref = oj.generate(tiny_target, prompts, max_new_tokens=24, eos_token_id=eos).tokens
        got = oj.generate(tiny_target, prompts, method="lookahead", config=CFG, pool=pool,
                          max_new_tokens=24, eos_token_id=eos)
        assert got.tokens == ref
        assert got.stats["eta"] > 1.5
        n_cut += sum(len(r) < 24 for r in ref)
    assert n_cut >= len(prompts)


def test_history_pool_carried_and_reset(tiny_target, random_prompts):
    prompts = REPEAT[:3]
    kw = dict(max_new_tokens=16, eos_token_id=-1, method="lookahead", config=CFG)
    a = oj.generate(tiny_target, prompts, **kw)
    b = oj.generate(tiny_target, prompts, pool=a.pool, **kw)
    assert a.tokens == b.tokens
    assert b.stats["eta"] >= a.stats["eta"]
    off = LookaheadConfig(window=4, ngram=4, guesses=4, history=False)
    c = oj.generate(tiny_target, prompts, pool=a.pool, **{**kw, "config": off})
    assert c.tokens == a.tokens and c.stats["pool_occupancy"] == a.stats["pool_occupancy"]
    with pytest.raises(ValueError, match="pool"):
        oj.generate(tiny_target, prompts, pool=init_pool(97, 4, 5), **kw)


def test_sampling_identical_to_vanilla_same_seed(tiny_target, random_prompts):
    prompts = random_prompts[:12] + REPEAT
    kw = dict(max_new_tokens=20, eos_token_id=-1, temperature=0.8, top_k=20, top_p=0.95,
              seed=77)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    pool = ngram_pool(97, [p + o for p, o in zip(prompts, ref)], CFG.ngram, CFG.guesses)
    # the pre-filled pool alone offers guesses (the prompts' own n-grams, newer, would push
    # some of its phrases out of a key's G slots)
    for pl, cfg in ((None, CFG), (pool, CTX[False])):
        out = oj.generate(tiny_target, prompts, method="lookahead", config=cfg, pool=pl, **kw)
        assert out.tokens == ref
    assert out.stats["eta"] > 1.5  # with the pool, sampled guesses really were accepted


def test_context_phrases_greedy_equals_vanilla(tiny_target, random_prompts):
    """Every prompt's n-grams are in the pool from the first step: guesses copied from prompts
    the target does not continue (random prompts, rows of other lengths in one batch, prompts
    shorter than an n-gram) never change the tokens."""
    prompts = random_prompts[:30] + REPEAT + [[7], [3, 4]]
    kw = dict(max_new_tokens=20, eos_token_id=-1)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    out = oj.generate(tiny_target, prompts, method="lookahead", config=CTX[True], **kw)
    assert out.tokens == ref
    assert out.stats["pool_hit_rate"] > 0.5  # the guesses really came from the prompts


def test_context_phrases_raise_eta_when_the_output_copies_the_prompt(small_vocab, copy_prompts):
    model = small_vocab[0]
    prompts, want = copy_prompts
    on, off = (oj.generate(model, prompts, method="lookahead", config=CTX[c], max_new_tokens=16,
                           eos_token_id=-1) for c in (True, False))
    assert on.tokens == off.tokens == want
    assert on.stats["eta"] > off.stats["eta"]  # measured 2.61 against 2.03
    assert on.stats["guess_tokens_accepted"] > off.stats["guess_tokens_accepted"]


def test_context_phrases_sampling_identical_to_vanilla_same_seed(tiny_target, random_prompts,
                                                                 small_vocab, copy_prompts):
    kw = dict(max_new_tokens=16, eos_token_id=-1, temperature=0.8, top_k=20, top_p=0.95,
              seed=77)
    prompts = random_prompts[:12] + REPEAT
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    assert oj.generate(tiny_target, prompts, method="lookahead", config=CTX[True],
                       **kw).tokens == ref
    # where the output copies the prompt, sampled guesses from it are accepted
    model, prompts = small_vocab[0], copy_prompts[0]
    kw = dict(max_new_tokens=16, eos_token_id=-1, temperature=0.5, seed=3)
    ref = oj.generate(model, prompts, **kw).tokens
    out = oj.generate(model, prompts, method="lookahead", config=CTX[True], **kw)
    assert out.tokens == ref and out.stats["guess_tokens_accepted"] > 0


def _two_token_probs(tm, prompt, temperature):
    """Exact P(t1, t2) under temperature sampling, from transformers (independent code)."""
    with torch.no_grad():
        p1 = torch.softmax(tm(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [t] for t in range(8)])
        p2 = torch.softmax(tm(seqs).logits[:, -1] / temperature, -1)
    return (p1[:, None] * p2).numpy().astype(np.float64)  # [8, 8]


def _chi2_p(counts, probs):
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

def assert_two_token_sampling(tm, prompt, want, tokens):
    """The first two sampled tokens (ids < 8) follow `want` [8, 8] (chi-square), and not the
    distribution at temperature 1: a wrong temperature must be rejected."""
    counts = np.zeros(64)
    for t in tokens:
        counts[t[0] * 8 + t[1]] += 1
    assert _chi2_p(counts, want.ravel()) > 1e-3
    wrong = _two_token_probs(tm, prompt, 1.0)
    assert _chi2_p(counts, wrong.ravel()) < 1e-6



def test_first_two_tokens_distribution(small_vocab):
    model, tm = small_vocab
    prompt = [1, 5, 3, 6]
    temperature, n = 0.7, 4000
    want = _two_token_probs(tm, prompt, temperature)
    cfg = LookaheadConfig(window=3, ngram=3, guesses=4)
    # pre-fill: the 4 likeliest (t1, t2) pairs keyed by the prompt's last token
    top = np.argsort(want.ravel())[::-1][:4]
    pool = init_pool(8, 4, 2)
    pool = insert_many(pool, jnp.full((4,), prompt[-1], jnp.int32),
                       jnp.asarray([[t // 8, t % 8] for t in top], jnp.int32))
    out = oj.generate(model, [prompt] * n, method="lookahead", config=cfg, pool=pool,
                      max_new_tokens=2, temperature=temperature, seed=99, eos_token_id=-1)
    assert out.stats["guess_tokens_accepted"] > n // 4  # guesses were really taken
    assert_two_token_sampling(tm, prompt, want, out.tokens)


def test_no_recompile_and_prompt_near_cache_limit(tiny_target):
    from ouroboros_jax.decoding.lookahead import run_lookahead

    kw = dict(method="lookahead", config=CFG)
    oj.generate(tiny_target, [[5, 6, 7]], max_new_tokens=10, **kw)
    size = run_lookahead._cache_size()
    a = oj.generate(tiny_target, [[9, 8, 7, 6, 5, 4, 3, 9, 8]], max_new_tokens=20,
                    eos_token_id=5, **kw)
    oj.generate(tiny_target, [[3] * 16], pool=a.pool, max_new_tokens=30, method="lookahead",
                config=LookaheadConfig(window=4, ngram=4, guesses=4, history=False))
    assert run_lookahead._cache_size() == size
    rs = np.random.RandomState(9)
    long_prompt = rs.randint(3, 97, size=1000).tolist()  # 1000 + 24 = the 1024 limit
    ref = oj.generate(tiny_target, [long_prompt], max_new_tokens=24, eos_token_id=-1).tokens
    assert oj.generate(tiny_target, [long_prompt], max_new_tokens=24, eos_token_id=-1,
                       **kw).tokens == ref
