"""Agreement by depth (decoding/cost.py `DepthAgreement`, `auto.agreement.depth_agreement`,
`auto.choice.Chooser.explore`): a pair whose agreement comes in runs accepts the deeper tokens
of a chain more often than the first, so one agreement fitted to short chains underprices long
ones. Calls record their acceptance by depth, auto prices each chain length with it, and a
greedy first call at a short chain drafts deeper once so that the depths past the first are
measured."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner, prices
from ouroboros_jax.auto.agreement import MIN_REALISED_ROUNDS
from ouroboros_jax.auto.choice import EXPLORE_DEPTH, EXPLORE_ROUNDS, Choice, choose, teaches
from ouroboros_jax.auto.store import valid_entry
from ouroboros_jax.decoding import cost
from ouroboros_jax.decoding.cost import DepthAgreement
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig

SIZES = (1, 4, 8, 16, 64)
# 2-core CPU, demo pair (as in test_auto.py): each extra token costs the target about 5%
CPU_T = {n: 3.7e-3 * (1 + 0.05 * (n - 1)) for n in SIZES}
CPU_D = {n: 0.47e-3 * (1 + 0.06 * (n - 1)) for n in SIZES}


def _markov_rounds(first: float, later: float, gamma: int, n: int, seed: int = 0):
    """Accepted draft tokens per round of n simulated rounds: the first token accepted with
    `first`, each later one (after an acceptance) with `later`."""
    rs = np.random.RandomState(seed)
    p = np.array([first] + [later] * (gamma - 1))
    ok = rs.rand(n, gamma) < p
    return np.argmin(np.concatenate([ok, np.zeros((n, 1), bool)], 1), axis=1)


def test_depth_counts_read_a_histogram():
    # gamma 3: rounds kept 1, 2, 3, 4 tokens (accepted 0..3) 10, 6, 3, 1 times
    assert cost.depth_counts([0, 10, 6, 3, 1], 3) == [[20, 10], [10, 4], [4, 1]]
    # the conditional agreements recovered from simulated runs are the simulated ones
    acc = _markov_rounds(0.55, 0.85, 4, 200000)
    hist = np.bincount(acc + 1, minlength=6)
    counts = cost.depth_counts(hist, 4)
    rates = [a / r for r, a in counts]
    assert rates[0] == pytest.approx(0.55, abs=0.01)
    assert rates[1:] == pytest.approx([0.85] * 3, abs=0.01)


@pytest.mark.parametrize("method", ["speculative", "ouroboros"])
def test_a_chain_the_rows_end_cut_short_is_not_a_rejection(tiny_pair, method):
    """Draft = target: every chain the draft offers whole is accepted whole. A budget of 12 at
    gamma 4 ends each row with a 2-token round (5 + 5 + 2): counted in acceptance_histogram,
    it must not reach the lesson, which would read it as a rejection at depth 2."""
    target = tiny_pair[0]
    cfg = (SpeculativeConfig(gamma=4) if method == "speculative" else
           OuroborosConfig(gamma=4, phrase_drafting=False, lengthening=False, recycling=False,
                           context_phrases=False))
    out = oj.generate(target, [[3, 9, 4, 1], [7, 2, 8]], draft=target, method=method,
                      config=cfg, max_new_tokens=12, eos_token_id=-1)
    s = out.stats
    assert s["acceptance_histogram"][:6] == [0, 0, 2, 0, 0, 4]
    whole = s["whole_histogram" if method == "speculative" else "draft_histogram"]
    assert whole[:6] == [0, 0, 0, 0, 0, 4] and sum(whole) == 4
    a, rounds, depth = oj.decoding.METHODS[method].learn(cfg, s, True)
    assert rounds == 4 and depth == [[4, 4]] * 4
    assert a > 0.99


def test_chain_tokens_match_simulated_runs():
    a = DepthAgreement((0.55,), 0.85)
    for gamma in (1, 2, 4, 8):
        acc = _markov_rounds(0.55, 0.85, gamma, 200000, seed=gamma)
        assert np.mean(acc + 1) == pytest.approx(cost.chain_tokens(a, gamma), rel=0.01)


def test_one_agreement_at_every_depth_is_one_number():
    for a in (0.3, 0.6, 0.9):
        same = DepthAgreement((a, a), a)
        for gamma in (1, 3, 6):
            assert cost.agreement_for(same, gamma) == pytest.approx(a, abs=1e-6)
    assert cost.agreement_for(0.7, 5) == 0.7 and cost.agreement_for(None, 5) is None
    # runs: the longer the chain, the higher the one number that prices it
    runs = DepthAgreement((0.55, 0.75, 0.8), 0.85)
    priced = [cost.agreement_for(runs, g) for g in (1, 2, 4, 8)]
    assert priced == sorted(priced) and priced[0] == pytest.approx(0.55, abs=1e-6)


def test_runs_of_agreement_lengthen_the_chosen_chain():
    """Priced with the first token's agreement alone, the demo pair's CPU tables give a short
    chain; with the deeper tokens' (measured on that pair: about 0.58, then 0.75-0.9) a longer
    one, and the stats say by depth what the choice was priced with."""
    flat = choose("speculative", CPU_T, CPU_D, 0.58)
    runs = choose("speculative", CPU_T, CPU_D, DepthAgreement((0.58, 0.75, 0.77), 0.8))
    assert runs.config.gamma > flat.config.gamma
    assert runs.predicted_speedup > flat.predicted_speedup
    s = runs.as_stats("speculative")
    assert s["agreement_by_depth"] == [0.58, 0.75, 0.77, 0.8]
    assert s["agreement"] == pytest.approx(cost.agreement_for(runs.agreement, runs.config.gamma),
                                           abs=1e-3)
    json.dumps(s)


@pytest.fixture
def fresh_auto(tmp_path, monkeypatch):
    """An empty auto disk store (its directory returned)."""
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def tuner(fresh_auto):
    """A fresh AutoTuner over the empty store: nothing remembered, as in a fresh process."""
    return AutoTuner()


def test_the_store_pools_depths_and_drops_bad_entries(tiny_pair, fresh_auto, tuner):
    target, draft, _ = tiny_pair
    assert tuner.agreement.depth_agreement(target, draft) is None
    tuner.agreement.record_realised(target, draft, 0.6, 5, [[5, 3]])
    assert tuner.agreement.depth_agreement(target, draft) is None  # 5 rounds < MIN_DEPTH_ROUNDS
    tuner.agreement.record_realised(target, draft, 0.6, 20, [[20, 12], [12, 9], [6, 5]])
    store = json.loads((fresh_auto / "auto.json").read_text())
    assert list(store["depth"].values()) == [[[25, 15], [12, 9], [6, 5]]]
    a = tuner.agreement.depth_agreement(target, draft)
    # depths 1 (25 rounds) and 2 (12) measured; depth 3 (6) not on its own; past the first
    # the pooled 14/18
    assert a == DepthAgreement((0.6, 0.75), round(14 / 18, 2))
    assert tuner.agreement.known_agreement(target, draft) == a
    assert valid_entry("depth", [[30, 18], [12, 9]])
    for bad in ([[3, 4]], [], [[1, 1, 1]], [[-1, 0]], [[2.5, 1]], {"1": 2}):
        assert not valid_entry("depth", bad), bad


def test_explore_drafts_deeper_once(tiny_pair, tuner):
    target, draft, _ = tiny_pair
    short = Choice("speculative", SpeculativeConfig(gamma=1), 1.3, 0.6, "predicted")
    out = tuner.chooser.explore(short, target, draft)
    assert out.config == SpeculativeConfig(gamma=EXPLORE_DEPTH) and "exploring" in out.reason
    long = Choice("speculative", SpeculativeConfig(gamma=EXPLORE_DEPTH), 1.3, 0.6, "predicted")
    off = Choice("vanilla", None, 1.0, 0.2, "off")
    ouro = Choice("ouroboros", OuroborosConfig(gamma=1), 1.3, 0.6, "predicted")
    for c in (long, off, ouro):  # already deep, nothing to draft, or a round that learns nothing
        assert tuner.chooser.explore(c, target, draft) is c
    sd = OuroborosConfig(gamma=1, window=2, suffixes=1, phrase_drafting=False, lengthening=False,
                         recycling=False, context_phrases=False)  # Ouroboros' SD step: a chain
    out = tuner.chooser.explore(Choice("ouroboros", sd, 1.3, 0.6, "predicted"), target, draft)
    assert out.config == dataclasses.replace(sd, gamma=EXPLORE_DEPTH)
    tuner.agreement.record_realised(target, draft, 0.6, 20, [[20, 12], [12, 9], [9, 8], [8, 4]])
    assert tuner.chooser.explore(short, target, draft) is short  # depths past the first measured
    _, draft2, _ = tiny_pair
    cold = Choice("speculative", SpeculativeConfig(gamma=2), 1.3, 0.1, "predicted")
    tuner.store.put("depth", f"{tuner.signatures(target)}|{tuner.signatures(target)}",
                    [[EXPLORE_ROUNDS, 5], [5, 1]])
    assert tuner.chooser.explore(cold, target, target) is cold  # a pair that rarely passes token 1


def test_a_greedy_call_explores_then_runs_the_choice(tiny_target, fresh_auto, tuner,
                                                      monkeypatch):
    """A first greedy call whose choice drafts 1 token drafts EXPLORE_DEPTH instead and records
    its acceptance at every depth; the next call keeps that loop while the choice's compiles
    in the background (a first call builds its own loop only), and the call after runs the
    choice. Tokens equal vanilla's in all (the target is its own draft here: every token accepted, so depths fill at once;
    auto's own choice is fixed, so what is tested is what a call does with it)."""
    t = tiny_target
    # at agreement 0.3 a chain of 1 is clearly faster than one of 4 (past the sticky rule)
    monkeypatch.setattr(tuner.chooser, "current", lambda *a, **k: Choice(
        "speculative", SpeculativeConfig(gamma=1), 1.3, 0.3, "predicted", (CPU_T, CPU_D)))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    N = 8 * (EXPLORE_DEPTH + 1)  # whole rounds, 8 a row: past MIN_DEPTH_ROUNDS at 2 rows
    ref = oj.generate(t, prompts, max_new_tokens=N, eos_token_id=-1)
    # a sampled call teaches auto nothing (`MethodSpec.learn` is greedy only): no exploring
    sampled = oj.generate(t, prompts, draft=t, method="speculative", max_new_tokens=8,
                          temperature=1.0, seed=3, tuner=tuner)
    assert sampled.stats["auto"]["config"] == "SpeculativeConfig(gamma=1)"
    assert "exploring" not in sampled.stats["auto"]["reason"]
    first = oj.generate(t, prompts, draft=t, method="speculative", max_new_tokens=N,
                        eos_token_id=-1, tuner=tuner)
    assert first.tokens == ref.tokens
    assert first.stats["auto"]["config"] == f"SpeculativeConfig(gamma={EXPLORE_DEPTH})"
    assert "exploring" in first.stats["auto"]["reason"]
    counts = list(json.loads((fresh_auto / "auto.json").read_text())["depth"].values())[0]
    assert len(counts) == EXPLORE_DEPTH and all(r == a > 0 for r, a in counts)
    assert counts[0][0] == sum(first.stats["acceptance_histogram"])  # every round reached 1
    again = dict(draft=t, method="speculative", max_new_tokens=N, eos_token_id=-1, tuner=tuner)
    second = oj.generate(t, prompts, **again)
    assert second.tokens == ref.tokens
    assert second.stats["auto"]["config"] == f"SpeculativeConfig(gamma={EXPLORE_DEPTH})"
    assert "compiles in the background" in second.stats["auto"]["reason"]
    tuner.switch.wait_for_background()
    third = oj.generate(t, prompts, **again)
    assert third.tokens == ref.tokens
    assert third.stats["auto"]["config"] == "SpeculativeConfig(gamma=1)"


def test_a_pair_never_measured_on_its_outputs_is_explored_not_turned_off(tiny_target, tuner,
                                                                         monkeypatch):
    """A greedy first call priced below vanilla on the prompts' argmax agreement alone runs the
    method once anyway (`explore`'s vanilla case): vanilla teaches nothing, so a pair whose
    prompts mislead (the real Qwen pair read 0.41 on a chat template, 0.91-0.94 on its outputs)
    would otherwise run vanilla for ever. Once measured, the next call is priced with what it
    realised; a sampled call, which teaches nothing, is not explored; a pair measured and bad
    is not explored again."""
    t = tiny_target  # its own draft: every token accepted on its outputs
    # a misleading prompt
    monkeypatch.setattr(tuner.agreement, "pair_agreement", lambda *a, **k: (0.05, 40))
    # by hand first: Ouroboros explores with a config whose round teaches (its SD step)
    off = Choice("vanilla", None, 1.0, 0.05, "no ouroboros setting is predicted to beat "
                 "vanilla here", (CPU_T, CPU_D))
    out = tuner.chooser.explore(off, t, t, "ouroboros")
    assert out.method == "ouroboros" and teaches("ouroboros", out.config)
    assert out.config.gamma >= EXPLORE_DEPTH and out.reason.startswith("exploring")
    assert tuner.chooser.explore(off, t, t) is off  # the asked method unknown: nothing to explore
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    N = 8 * (EXPLORE_DEPTH + 1)  # whole rounds, 8 a row: past MIN_DEPTH_ROUNDS at 2 rows
    ref = oj.generate(t, prompts, max_new_tokens=N, eos_token_id=-1)
    kw = dict(draft=t, method="speculative", max_new_tokens=N, eos_token_id=-1, tuner=tuner)
    sampled = oj.generate(t, prompts, temperature=1.0, seed=3, **kw)
    assert sampled.stats["auto"]["method"] == "vanilla"
    first = oj.generate(t, prompts, **kw)
    a = first.stats["auto"]
    assert a["method"] == "speculative" and a["reason"].startswith("exploring")
    assert eval(a["config"], {"SpeculativeConfig": SpeculativeConfig}).gamma >= EXPLORE_DEPTH
    assert first.tokens == ref.tokens
    # measured on its outputs: 1.0 at each depth
    assert tuner.agreement.depth_agreement(t, t) is not None
    # the next call is priced with the agreement realised by depth, not explored again (the
    # model drafting for itself costs what it saves here: whatever it runs, it chose it)
    second = oj.generate(t, prompts, **kw)
    assert second.stats["auto"]["agreement_by_depth"][0] == 1.0
    assert "exploring" not in second.stats["auto"]["reason"] and second.tokens == ref.tokens
    # a pair whose outputs were measured and disagree is left to vanilla
    bad = f"{tuner.signatures(t)}|{tuner.signatures(t)}"
    tuner.store.put("depth", bad, [[EXPLORE_ROUNDS, 5], [5, 1]])
    assert tuner.chooser.explore(off, t, t, "speculative") is off


def test_calls_with_explicit_configs_teach_loop_prices(tiny_pair, random_prompts, fresh_auto,
                                                       tuner, monkeypatch):
    """A call with an explicit config that compiled nothing teaches auto its loop's prices
    from the first, never measuring anything (priced from priors on an empty store: pooled
    under the priors' own key, `Prices.timing_key`); calls of two chain lengths tell the
    draft's share from the target's, which calls of one config cannot."""
    target, draft, _ = tiny_pair
    prompts = random_prompts[:1]
    monkeypatch.setattr(prices, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    monkeypatch.setattr(prices, "forward_seconds", lambda *a, **k: pytest.fail("probed"))
    timing = lambda: json.loads(  # noqa: E731
        (fresh_auto / "auto.json").read_text()).get("timing", {})
    kw = dict(draft=draft, method="speculative", max_new_tokens=12, tuner=tuner)
    for g in (2, 5, 2, 5, 2, 5):
        oj.generate(target, prompts, config=SpeculativeConfig(gamma=g), **kw)
    store = json.loads((fresh_auto / "auto.json").read_text())
    assert not {"device", "anchor"} & set(store)
    # each gamma's first call compiled its loop: its time is the compiler's, not learned
    sums = list(timing().values())
    assert len(sums) == 1 and list(timing())[0].endswith("|prior") and sums[0][5] == 4
    # what they taught is priced per model: the calls' draft shares differ (gamma 2 and 5)
    assert sums[0][2] > 0
    s_t, s_s, calls, separated = tuner.prices.learned_scales(target, draft, 1)
    assert calls == 4


def test_ouroboros_sd_step_teaches_what_speculative_teaches(tiny_pair, random_prompts,
                                                            fresh_auto, tuner):
    """Ouroboros with phrase drafting and lengthening off drafts and verifies one chain, as
    speculative decoding does: a greedy call of it records the same realised agreement and
    acceptance by depth as speculative's call at the same gamma on the same prompts (so a user
    of Ouroboros alone teaches auto the pair). With lengthening on it records nothing: its
    rounds keep pool tokens past the chain."""
    target, draft, _ = tiny_pair
    prompts = random_prompts[:2]
    store = lambda: json.loads((fresh_auto / "auto.json").read_text())  # noqa: E731
    kw = dict(draft=draft, method="ouroboros", max_new_tokens=24, eos_token_id=-1, tuner=tuner)
    sd = OuroborosConfig(gamma=3, window=2, ngram=3, guesses=2, suffixes=1,
                         phrase_drafting=False, lengthening=False, recycling=False,
                         context_phrases=False)
    ouro = oj.generate(target, prompts, config=sd, **kw)
    once = store()
    (depth,) = once["depth"].values()
    # the rounds whose chain was offered whole (the last ones of each row, where the budget
    # stops the chain short, are not)
    assert len(depth) == 3 and depth[0][0] == sum(ouro.stats["draft_histogram"])
    assert 0 < sum(ouro.stats["draft_histogram"]) < sum(ouro.stats["acceptance_histogram"])
    lengthening = dataclasses.replace(sd, lengthening=True, suffixes=2)
    oj.generate(target, prompts, config=lengthening, **kw)
    assert store() == once
    spec = oj.generate(target, prompts, draft=draft, method="speculative", max_new_tokens=24,
                       eos_token_id=-1, config=SpeculativeConfig(gamma=3), tuner=tuner)
    assert spec.tokens == ouro.tokens
    twice = store()
    assert list(twice["depth"].values()) == [[[2 * r, 2 * a] for r, a in depth]]
    ((s1, n1),), ((s2, n2),) = once["realised"].values(), twice["realised"].values()
    assert n2 == 2 * n1 and s2 == pytest.approx(2 * s1)


def test_rounds_short_of_the_threshold_move_the_prompt_estimate(tiny_pair, tuner):
    """A first call's rounds count before MIN_REALISED_ROUNDS of them have run: the prompts'
    estimate moves toward what they realised by their share of the threshold (the real pair's
    first call explored 15 rounds at 0.92 where its prompts said 0.64, and priced at 0.64 it
    ran vanilla from then on, never realising the rest)."""
    target, draft, _ = tiny_pair
    key = f"{tuner.signatures(target)}|{tuner.signatures(draft)}"
    tuner.store.add("agreement", key, (40, 80), (0, 0))  # the prompts: 0.5 over 80 positions
    assert tuner.agreement.known_agreement(target, draft) == pytest.approx(0.5)
    half = MIN_REALISED_ROUNDS // 2
    tuner.agreement.record_realised(target, draft, 0.9, half)
    assert tuner.agreement.realised_agreement(target, draft) is None
    assert tuner.agreement.known_agreement(target, draft) == pytest.approx(0.5 * 0.9 + 0.5 * 0.5)
    tuner.agreement.record_realised(target, draft, 0.9, MIN_REALISED_ROUNDS - half)
    assert tuner.agreement.known_agreement(target, draft) == pytest.approx(0.9)


def _timing_sums(calls):
    sums = [0.0] * 5 + [0]
    for x_t, x_s, y in calls:
        sums = [a + b for a, b in zip(sums, (x_t * x_t, x_t * x_s, x_s * x_s, x_t * y,
                                              x_s * y, 1))]
    return sums


def test_the_drafts_own_scale_waits_for_three_calls_that_ran_it(tiny_pair, tuner):
    """Eleven vanilla calls at 1.08x their price and one speculative call 19% over its price
    (the real pair's store): solved freely, that one call alone sets the draft's scale (1.37x);
    below MIN_SPLIT_CALLS calls with the draft, one scale prices both models. Three calls that
    say the draft is dearer than its price give it its own."""
    target, draft, _ = tiny_pair
    alone = tuner.prices.timing_key(target, None, 1)
    pair = tuner.prices.timing_key(target, draft, 1)
    tuner.store.add("timing", alone, tuple(_timing_sums([(15.5, 0.0, 15.5 * 1.08)] * 11)),
                    (0.0,) * 5 + (0,))
    one_call = _timing_sums([(7.44, 4.76, 1.19 * 1.08 * (7.44 + 4.76))])
    tuner.store.add("timing", pair, tuple(one_call), (0.0,) * 5 + (0,))
    free = prices.solve_scales([a + b for a, b in zip(
        _timing_sums([(15.5, 0.0, 15.5 * 1.08)] * 11), one_call)])
    assert free[2] and free[1] > 1.3  # what the lone call would have said
    s_t, s_s, calls, separated = tuner.prices.learned_scales(target, draft, 1)
    assert calls == 12 and not separated and s_t == s_s
    assert s_t == pytest.approx(1.08, rel=0.03)
    more = _timing_sums([(7.0, 4.0, 1.08 * 7.0 + 1.3 * 4.0), (6.0, 6.0, 1.08 * 6.0 + 1.3 * 6.0)])
    tuner.store.add("timing", pair, tuple(more), (0.0,) * 5 + (0,))
    s_t, s_s, calls, separated = tuner.prices.learned_scales(target, draft, 1)
    assert calls == 14 and separated and s_s > s_t


def test_ouroboros_with_its_mechanisms_off_runs_as_speculative():
    """`as_run`: Ouroboros' SD step (every own mechanism off) is speculative decoding's round
    and runs as its loop, chain and confidence kept; any own mechanism on, or a pool the call
    passes (whose shape the call returns), keeps Ouroboros."""
    from ouroboros_jax.auto.choice import OWN_MECHANISMS, as_run

    sd = OuroborosConfig(gamma=6, window=2, suffixes=1, phrase_drafting=False,
                         lengthening=False, recycling=False, context_phrases=False,
                         confidence=0.3)
    out = as_run(Choice("ouroboros", sd, 1.4, 0.8, "predicted"), None)
    assert (out.method, out.config) == ("speculative", SpeculativeConfig(gamma=6,
                                                                         confidence=0.3))
    assert out.reason.startswith("predicted") and "speculative" in out.reason
    for m in OWN_MECHANISMS:
        on = Choice("ouroboros", dataclasses.replace(sd, **{m: True}), 1.4, 0.8, "p")
        assert as_run(on, None) is on, m
    sd_choice = Choice("ouroboros", sd, 1.4, 0.8, "p")
    assert as_run(sd_choice, (2, 2)) is sd_choice
    off = Choice("vanilla", None, 1.0, 0.2, "off")
    assert as_run(off, None) is off


def test_a_server_keeps_ouroboros_sd_step_as_ouroboros(tiny_pair, tuner, monkeypatch):
    """`generate` runs Ouroboros' SD step as speculative's loop; a server's engine runs the
    asked method's loop only (`keep_method`, what `scheduler.auto_levels` asks), so there the
    choice stays Ouroboros' (else the level would turn speculation off)."""
    target, draft, _ = tiny_pair
    sd = OuroborosConfig(gamma=4, window=2, suffixes=1, phrase_drafting=False,
                         lengthening=False, recycling=False, context_phrases=False)
    server = AutoTuner()  # another process's tuner (a tuner keeps its own choices)
    for t in (tuner, server):
        monkeypatch.setattr(t.chooser, "current", lambda *a, **k: Choice(
            "ouroboros", sd, 1.3, 0.8, "predicted", (CPU_T, CPU_D)))
    prompt, plens = jnp.asarray([[5, 6, 7]], jnp.int32), jnp.asarray([3], jnp.int32)
    ran = tuner.auto_config("ouroboros", target, draft, prompt, plens, 64, use_cache=False)
    assert (ran.method, ran.config) == ("speculative", SpeculativeConfig(gamma=4))
    served = server.auto_config("ouroboros", target, draft, prompt, plens, 64, use_cache=False,
                                keep_method=True)
    assert (served.method, served.config) == ("ouroboros", sd)
