"""Free drafts priced (issue 52): the cost model mixes free rounds (no draft forward) into a
round by the pair's measured free proposals, by hand-computed numbers; config="auto" turns
free drafts on, and picks the threshold, where the measured profile prices them faster, and
keeps them off where free proposals keep nothing; the store pools the counts by match length."""

import dataclasses

import pytest

from ouroboros_jax.auto.agreement import Agreement
from ouroboros_jax.auto.choice import choose
from ouroboros_jax.auto.store import Store, valid_entry
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.decoding.cost import (FREE_OVERHEAD, FREE_PRIOR, DepthAgreement, FreeProfile, RoundModel,
                                         best_free_threshold, free_mix, free_profile,
                                         free_round_model, rate)
from ouroboros_jax.decoding.knobs import recipe_of
from ouroboros_jax.decoding.ouroboros import OuroborosConfig

# a target whose forward costs 10 ms at any width up to 16, a draft 3 ms a forward (the
# real Qwen pair's 0.3 ratio)
TT = {1: 0.010, 16: 0.010, 64: 0.02}
TD = {1: 0.003, 16: 0.003, 64: 0.006}


def test_free_profile_and_mix_by_hand():
    p = free_profile([60, 10, 10, 0, 20], [0, 1, 5, 0, 60])
    assert p.offered == (0.6, 0.1, 0.1, 0.0, 0.2)
    assert p.kept == (0.0, 0.1, 0.5, 0.0, 3.0)
    assert free_profile([0, 0], [0, 0]) is None
    # threshold 2: the rounds at r 2..4 (30%), keeping (0.1 * 0.5 + 0.2 * 3) / 0.3 tokens
    share, tokens = free_mix(p, 2)
    assert share == pytest.approx(0.3)
    assert tokens == pytest.approx(1 + (0.05 + 0.6) / 0.3)
    # a threshold past the profile's longest match counts as its longest
    assert free_mix(p, 9) == free_mix(p, 4)
    assert free_mix(FreeProfile((1.0, 0.0), (0.0, 0.0)), 1) == (0.0, 1.0)


def test_free_round_model_by_hand():
    base = RoundModel(tokens=3.0, draft_forwards=4.0, overhead=0.1)
    p = FreeProfile(offered=(0.5, 0.0, 0.5), kept=(0.0, 0.0, 4.0))
    m = free_round_model(base, p, 2, catch_up_chunk=10)
    # half the rounds free: (3 + 5) / 2 tokens; the other half's 4 draft forwards, plus the
    # free rounds' 5 tokens fed back 10 a forward
    assert m.tokens == pytest.approx(4.0)
    assert m.draft_forwards == pytest.approx(2.0 + 0.5 * 5 / 10)
    assert m.overhead == pytest.approx(base.overhead + FREE_OVERHEAD)
    short = FreeProfile(offered=(0.5, 0.5, 0.0), kept=(0.0, 3.0, 0.0))
    none = free_round_model(base, short, 2, 10)  # no match that long: drafting's tokens
    assert (none.tokens, none.draft_forwards) == (3.0, 4.0)
    sizes = (5, 1)
    assert best_free_threshold(sizes, base, p, 10, TT, TD, (1, 2)) == 1
    # proposals that keep nothing: a free round's one token does not pay for the saved
    # draft forwards here
    useless = FreeProfile(offered=(0.5, 0.5), kept=(0.0, 0.0))
    assert best_free_threshold(sizes, base, useless, 10, TT, TD, (1,)) is None
    assert rate(sizes, free_round_model(base, useless, 1, 10), TT, TD) < rate(sizes, base, TT,
                                                                              TD)


def test_ouroboros_prices_free_drafts_from_the_profile():
    spec = METHODS["ouroboros"]
    sd = OuroborosConfig(gamma=4, window=2, ngram=7, guesses=2, suffixes=1,
                         phrase_drafting=False, lengthening=False, recycling=False,
                         context_phrases=False)
    on = dataclasses.replace(sd, free_drafts=True, free_threshold=3)
    rich = FreeProfile(offered=(0.4, 0, 0, 0.2, 0, 0, 0.4), kept=(0, 0, 0, 3.0, 0, 0, 4.0))
    a = DepthAgreement((0.6, 0.7), 0.8, rich)
    assert spec.priced_round(sd, a) == spec.round_model(sd, _chain(a, sd))  # off: as before
    want = free_round_model(spec.round_model(sd, _chain(a, sd)), rich, 3, 1 + 4)
    assert spec.priced_round(on, a) == want
    # no measured profile: the prior's
    plain = DepthAgreement((0.6, 0.7), 0.8)
    assert spec.priced_round(on, plain) == free_round_model(
        spec.round_model(sd, _chain(plain, sd)), FREE_PRIOR, 3, 5)
    assert spec.rate(on, a, TT, TD) > spec.rate(sd, a, TT, TD)
    # the prior offers nothing: free drafts price below drafting alone until measured
    assert spec.rate(on, plain, TT, TD) < spec.rate(sd, plain, TT, TD)
    assert not choose("ouroboros", TT, TD, plain).config.free_drafts


def _chain(a, cfg):
    from ouroboros_jax.decoding.spec import chain_agreement

    return chain_agreement(a, cfg)


def test_auto_turns_free_drafts_on_where_the_profile_pays_and_off_where_not():
    rich = FreeProfile(offered=(0.3, 0, 0.1, 0.2, 0.1, 0.1, 0.2),
                       kept=(0, 0, 0.1, 2.5, 4.0, 5.0, 6.0))
    got = choose("ouroboros", TT, TD, DepthAgreement((0.8, 0.9), 0.9, rich))
    assert got.method == "ouroboros" and got.config.free_drafts, got
    # at gamma 6 (a free chain keeps at most gamma tokens, so the longest chain prices best)
    # the r = 2 rounds go free too: drafting one keeps 3.65 tokens more than its free
    # proposal's 1.1 for 6 draft forwards (18 ms), 0.2 tokens a ms, under the mix's 0.28
    assert (got.config.gamma, got.config.free_threshold) == (6, 2)
    assert "free_drafts=True" in recipe_of(got.config)
    assert eval(recipe_of(got.config), {"OuroborosConfig": OuroborosConfig}) == got.config
    useless = FreeProfile(offered=(0.5, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05), kept=(0,) * 7)
    got = choose("ouroboros", TT, TD, DepthAgreement((0.8, 0.9), 0.9, useless))
    assert got.method == "ouroboros" and not got.config.free_drafts, got


def test_the_store_pools_free_counts_by_match_length(tmp_path, monkeypatch):
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))

    class Sig:
        def pair(self, t, d):
            return f"{t}|{d}"

    ag = Agreement(Store(), Sig())
    ag.record_free("T", "D", [10, 2, 4], [0, 1, 8])
    assert ag.free_profile("T", "D") is None  # 16 rounds: fewer than it takes
    ag.record_free("T", "D", [10, 2, 4, 0, 4], [0, 1, 8, 0, 12])
    assert ag.free_profile("T", "D") == free_profile([20, 4, 8, 0, 4], [0, 2, 16, 0, 12])
    assert valid_entry("free", [[3, 9], [0, 0]])
    assert not valid_entry("free", [[3, -1]]) and not valid_entry("free", [])
