"""Free drafts' profile learned without exploring (issue 52): the host replays, from a greedy
call's output, what the context's free proposal would have kept at each round; its ranking
is the device's (`free_drafts.context_match`), its counts are checked by hand, any greedy call
on a pair feeds the store's free section (sampled calls and free-drafts calls, whose own
counters are exact, do not), and auto prices free drafts from a profile that rides on a
one-number agreement."""

import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto.choice import choose, with_free_profile
from ouroboros_jax.auto.free_profile import context_proposal, replay_row
from ouroboros_jax.auto.tuner import AutoTuner
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.decoding.common import Sequences
from ouroboros_jax.decoding.cost import DepthAgreement, FreeProfile
from ouroboros_jax.decoding.free_drafts import context_match
from ouroboros_jax.decoding.ouroboros import OuroborosConfig

from conftest import REPEAT

TT = {1: 0.010, 16: 0.010, 64: 0.02}
TD = {1: 0.003, 16: 0.003, 64: 0.006}


def _seqs(rows, S):
    tokens = np.zeros((len(rows), S), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)
    z = jnp.zeros((len(rows),), jnp.int32)
    return Sequences(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths),
                     prompt_lengths=z, done=jnp.zeros((len(rows),), bool))


@pytest.mark.parametrize("gamma,max_match", [(4, 3), (6, 6), (2, 1)])
def test_the_hosts_proposal_is_the_devices(gamma, max_match):
    rs = np.random.RandomState(gamma * 10 + max_match)
    # a 4-token vocabulary repeats itself: matches of every length, ties to break
    rows = [rs.randint(0, 4, size=rs.randint(1, 40)).tolist() for _ in range(24)]
    rows += [r * 3 for r in REPEAT]
    S = max(len(r) for r in rows) + 3
    tok, count, run = (np.asarray(x) for x in context_match(_seqs(rows, S), gamma, max_match))
    for b, r in enumerate(rows):
        prop, got_run = context_proposal(np.array(r), len(r), gamma, max_match)
        assert got_run == run[b], (b, r)
        assert prop.tolist() == tok[b, :count[b]].tolist(), (b, r)


def test_replay_by_hand():
    # prompt 1 2 3 4 5 6; output 1 2 3 4 5 8 8
    t = np.array([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 8, 8])
    offered, kept = replay_row(t, 6, len(t), step=1, gamma=12, max_match=3)
    # round 1 (..6, 1): the 1 at 0 matches one token, proposes 2 3 4 5 6 1, keeps 2 3 4 5;
    # round 2 starts 5 on (..5, 8): no 8 before, nothing offered; then the end
    assert offered.tolist() == [1, 1, 0, 0] and kept.tolist() == [0, 4, 0, 0]
    # a proposal of 2 tokens keeps both; the round after starts 3 on, at (.. 2 3 4): the
    # prompt's 2 3 4 match 3 tokens, propose 5 6, keep the 5; then (.. 8): nothing
    offered, kept = replay_row(t, 6, len(t), step=1, gamma=2, max_match=3)
    assert offered.tolist() == [1, 1, 0, 1] and kept.tolist() == [0, 2, 0, 1]
    # a round without a proposal keeping anything moves on by the call's tokens per round
    offered, _ = replay_row(np.array([7, 8, 9, 1, 2, 3, 4, 5, 6]), 3, 9, step=3)
    assert offered.sum() == 2  # rounds at 4 and 7 tokens


def _free_counts(tuner, target, draft):
    key = tuner.signatures.pair(target, draft)
    return [list(x) for x in tuner.store.read().get("free", {}).get(key, [])]


def test_any_greedy_call_on_a_pair_teaches_the_free_profile(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))
    target, draft, _ = tiny_pair
    tuner = AutoTuner()
    prompts = [REPEAT[0], REPEAT[1]]
    kw = dict(max_new_tokens=24, eos_token_id=-1, tuner=tuner)
    oj.generate(target, prompts, draft=draft, method="speculative", temperature=1.0, seed=1,
                **kw)
    assert _free_counts(tuner, target, draft) == []  # sampled: not the greedy continuation
    out = oj.generate(target, prompts, draft=draft, method="speculative", **kw)
    counts = _free_counts(tuner, target, draft)
    # every replayed round counted once; no more rounds than output tokens
    rounds = sum(o for o, _ in counts)
    assert 2 <= rounds <= 2 * 24 and len(counts) == 7
    assert all(0 <= k <= 12 * o for o, k in counts)
    assert out.stats["new_tokens"] == 48
    # a free-drafts call adds its own (exact) device counters, not a replay
    cfg = OuroborosConfig(gamma=3, window=2, ngram=4, guesses=2, suffixes=1,
                          free_drafts=True, free_threshold=1)
    o = oj.generate(target, prompts, draft=draft, method="ouroboros", config=cfg, **kw)
    after = _free_counts(tuner, target, draft)
    dev = list(zip(o.stats["free_offered"], o.stats["free_would_accept"]))
    want = [[a[0] + (dev[r][0] if r < len(dev) else 0), a[1] + (dev[r][1] if r < len(dev)
                                                                else 0)]
            for r, a in enumerate(counts)]
    assert after == want


def test_auto_prices_free_drafts_from_a_profile_on_a_one_number_agreement():
    spec = METHODS["ouroboros"]
    sd = OuroborosConfig(gamma=6, window=2, ngram=7, guesses=2, suffixes=1,
                         phrase_drafting=False, lengthening=False, recycling=False,
                         context_phrases=False)
    notes = {"measured": [], "assumed": []}
    assert with_free_profile(0.8, None, notes) == 0.8 and notes["measured"] == []
    # a number at every depth prices a chain as the number does
    assert spec.rate(sd, DepthAgreement((), 0.8), TT, TD) == pytest.approx(
        spec.rate(sd, 0.8, TT, TD), rel=1e-6)
    rich = FreeProfile(offered=(0.3, 0, 0.1, 0.2, 0.1, 0.1, 0.2),
                       kept=(0, 0, 0.1, 2.5, 4.0, 5.0, 6.0))
    a = with_free_profile(0.8, rich, notes)
    assert a == DepthAgreement((), 0.8, rich) and "free proposals" in notes["measured"][0]
    got = choose("ouroboros", TT, TD, a)
    assert got.config.free_drafts, got
    assert not choose("ouroboros", TT, TD, 0.8).config.free_drafts
    by_depth = DepthAgreement((0.7, 0.8), 0.9)
    assert with_free_profile(by_depth, rich, notes) == by_depth._replace(free=rich)
