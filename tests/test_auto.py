"""config="auto" (ouroboros_jax/auto/): the choice follows the latency shape of the device (flat
tables, as on an accelerator, give the paper's large trees; steep CPU-like tables give small
trees or no speculation), the probe and the agreement are kept on disk, and auto never changes
the tokens."""

import dataclasses
import functools
import json

import jax

import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner, prices
from ouroboros_jax.auto import choice as choice_mod
from ouroboros_jax.auto.agreement import MIN_REALISED_ROUNDS
from ouroboros_jax.auto.choice import (STICKY_GAIN, TRY_CALLS, TRY_GAIN, MIN_GAIN,
                                       Choice, choose, fits_pool, predicted_rate,
                                       predicted_speedup)
from ouroboros_jax.auto.keys import Signatures, signature_of
from ouroboros_jax.decoding import METHODS, cost
from ouroboros_jax.decoding.lookahead import LookaheadConfig
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig

SIZES = (1, 4, 8, 16, 64, 256)
# Accelerator at batch 1: a forward costs its weights, whatever the input (weights-bound); the
# draft has 1/10 of the target's parameters.
FLAT_T = {n: 1.0 for n in SIZES}
FLAT_D = {n: 0.1 for n in SIZES}
# 2-core CPU (demo pair, measured by the probe): the target's forward grows by about 5% per
# extra token and the draft's by about 6%.
CPU_T = {n: 3.7e-3 * (1 + 0.05 * (n - 1)) for n in SIZES}
CPU_D = {n: 0.47e-3 * (1 + 0.06 * (n - 1)) for n in SIZES}


def test_flat_latency_gives_the_papers_large_trees():
    # the paper's pairs on code agree about 90% of the time
    o = choose("ouroboros", FLAT_T, FLAT_D, 0.9)
    assert o.method == "ouroboros" and isinstance(o.config, OuroborosConfig)
    c = o.config
    # the paper's code recipe (γ 12, W 20, N 7, X 3); its tuning grid stopped at γ 12, auto's
    # reaches 16, which a flat device at 0.9 prices a little higher
    assert c.gamma in (12, 16) and (c.window, c.ngram, c.suffixes) == (20, 7, 3)
    assert c.phrase_drafting and c.lengthening and c.recycling  # every mechanism pays here
    la = choose("lookahead", FLAT_T, None, None)
    assert isinstance(la.config, LookaheadConfig) and la.config.window >= 15 and la.config.ngram >= 5
    sd = choose("speculative", FLAT_T, FLAT_D, 0.8)
    assert isinstance(sd.config, SpeculativeConfig) and 4 <= sd.config.gamma <= 8  # paper: 4-6+
    o = choose("ouroboros", FLAT_T, FLAT_D, 0.8)
    assert o.predicted_speedup > sd.predicted_speedup > 1.5


def test_steep_cpu_latency_gives_small_trees():
    o = choose("ouroboros", CPU_T, CPU_D, 0.75)
    assert o.method == "ouroboros"
    c = o.config
    assert c.window <= 4 and c.ngram <= 4 and c.gamma <= 6
    n_t = 1 + c.gamma + c.suffixes * (c.ngram - 1)
    assert n_t < 20  # far from the paper's 247-token trees
    sd = choose("speculative", CPU_T, CPU_D, 0.75)
    assert sd.method == "speculative" and 2 <= sd.config.gamma <= 6


def test_ouroboros_auto_drops_mechanisms_that_cost_more_than_they_bring():
    """On steep CPU latencies at the demo pair's agreement, wide draft forwards and branches
    cost more than they bring: auto runs Ouroboros with its mechanisms off (speculative
    decoding, the ablation's SD step), predicted as fast as speculative, instead of falling
    back to vanilla; the recipe says which mechanisms are off."""
    sd = choose("speculative", CPU_T, CPU_D, 0.65)
    o = choose("ouroboros", CPU_T, CPU_D, 0.65)
    assert sd.method == "speculative" and o.method == "ouroboros"
    c = o.config
    assert not c.phrase_drafting and not c.lengthening and not c.recycling and c.history
    assert "phrase_drafting=False" in o.as_stats("auto")["config"]
    assert c.gamma == sd.config.gamma
    assert o.predicted_speedup == pytest.approx(sd.predicted_speedup, rel=1e-6)
    # the same rate as speculative decoding at any gamma: the SD step's round model
    for g in (1, 3, 6):
        off = OuroborosConfig(gamma=g, window=2, ngram=3, guesses=2, suffixes=1,
                              phrase_drafting=False, lengthening=False, recycling=False)
        assert predicted_rate("ouroboros", off, CPU_T, CPU_D, 0.7) == pytest.approx(
            predicted_rate("speculative", SpeculativeConfig(gamma=g), CPU_T, CPU_D, 0.7))
    # a mechanism switched on costs its forwards and brings its tokens in the model
    on = OuroborosConfig(gamma=3, window=2, ngram=3, guesses=2, suffixes=1)
    pd_off = OuroborosConfig(gamma=3, window=2, ngram=3, guesses=2, suffixes=1,
                             phrase_drafting=False)
    from ouroboros_jax.decoding import METHODS
    rm = METHODS["ouroboros"].round_model
    assert rm(pd_off, 0.7).draft_forwards == 3 > rm(on, 0.7).draft_forwards
    assert rm(pd_off, 0.7).tokens == rm(on, 0.7).tokens


def test_auto_keeps_the_shape_of_a_pool_the_call_passes(tiny_pair, random_prompts, tuner):
    """A pool from an earlier call (here ngram 4: phrases of 3 tokens) goes on serving later
    config="auto" calls: auto chooses among the configs it fits, whatever it would pick
    without it, and a pool that fits none is refused by name."""
    target, draft, _ = tiny_pair
    first = oj.generate(target, random_prompts[:1], draft=draft, method="ouroboros",
                        max_new_tokens=8, tuner=tuner,
                        config=OuroborosConfig(gamma=2, window=2, ngram=4, guesses=2,
                                               suffixes=1))
    assert first.pool.phrase_len == 3
    # a pair that agrees (as if speculative calls had realised it), so speculation pays
    tuner.agreement.record_realised(target, draft, 0.9, 4 * MIN_REALISED_ROUNDS)
    out = oj.generate(target, random_prompts[:1], draft=draft, method="ouroboros",
                      max_new_tokens=8, pool=first.pool, tuner=tuner)
    assert out.stats["auto"]["method"] == "ouroboros"
    cfg = eval(out.stats["auto"]["config"], {"OuroborosConfig": OuroborosConfig})
    assert cfg.ngram == 4 and out.pool.phrase_len == 3
    if not (cfg.recycling or cfg.context_phrases):  # nothing wrote it: it comes back as given
        for a, b in zip(jax.tree.leaves(first.pool), jax.tree.leaves(out.pool)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # where the unconstrained pick has another phrase length, the pool's shape wins
    assert choose("ouroboros", CPU_T, CPU_D, 0.65).config.ngram == 3
    assert choose("ouroboros", CPU_T, CPU_D, 0.65, pool_shape=(2, 3)).config.ngram == 4
    assert fits_pool(OuroborosConfig(ngram=4, guesses=2, window=2, suffixes=1), (2, 3))
    assert not fits_pool(OuroborosConfig(ngram=3, guesses=2, window=2, suffixes=1), (2, 3))
    assert not fits_pool(OuroborosConfig(ngram=4, guesses=3, window=3, suffixes=1), (2, 3))
    with pytest.raises(ValueError, match="pool: its phrases of 8 tokens"):
        choose("ouroboros", CPU_T, CPU_D, 0.65, pool_shape=(20, 8))


def test_each_method_describes_its_own_auto_grid():
    # the candidates come from the method's MethodSpec, so a registered method is sized by auto
    # with nothing added to auto/; vanilla has no knobs and is refused by name
    from ouroboros_jax.decoding import METHODS

    grid = {"gamma": (2, 5), "window": (3,), "ngram": (4,), "suffixes": (1, 4)}
    assert [c.gamma for c in METHODS["speculative"].auto_grid(grid)] == [2, 5]
    assert [(c.window, c.guesses) for c in METHODS["lookahead"].auto_grid(grid)] == [(3, 3)]
    # Ouroboros' grid comes once with its mechanisms on, then once per switch variant, then
    # the free-drafts variants: the SD step at each threshold, every mechanism at 3 and 6
    from ouroboros_jax.decoding.ouroboros_config import FREE_THRESHOLDS

    og = METHODS["ouroboros"].auto_grid(grid)
    assert [(c.gamma, c.suffixes) for c in og] == [(2, 1), (5, 1)] * (4 + len(FREE_THRESHOLDS) + 2)
    assert [(c.phrase_drafting, c.lengthening) for c in og[:8:2]] == [
        (True, True), (False, True), (True, False), (False, False)]
    free = og[8::2]
    assert not any(c.free_drafts for c in og[:8]) and all(c.free_drafts for c in free)
    assert [(c.free_threshold, c.phrase_drafting, c.ngram) for c in free] == [
        (t, False, 7) for t in FREE_THRESHOLDS] + [(3, True, 7), (6, True, 7)]
    best = choose("speculative", CPU_T, CPU_D, 0.75)
    assert best.predicted_speedup == pytest.approx(
        predicted_rate("speculative", best.config, CPU_T, CPU_D, 0.75)
        / predicted_rate("speculative", None, CPU_T, CPU_D, 0.75))
    with pytest.raises(ValueError, match="knows lookahead, ouroboros, prompt_lookup, speculative, not 'vanilla'"):
        choose("vanilla", CPU_T, None, None)


def test_speculation_turned_off_where_it_cannot_pay():
    # low agreement: the draft's forwards cost more than the tokens they win
    low = choose("speculative", CPU_T, CPU_D, 0.1)
    assert low.method == "vanilla" and low.config is None and "off" in low.reason
    # a large batch on a CPU: every extra token per row costs as much as a row (compute-bound)
    steep = {n: 1e-3 * n for n in SIZES}
    for m, td in (("speculative", {n: 0.3e-3 * n for n in SIZES}), ("lookahead", None)):
        assert choose(m, steep, td, 0.7).method == "vanilla"


def test_more_agreement_never_lowers_gamma():
    gammas = [choose("speculative", FLAT_T, FLAT_D, a).config.gamma for a in (0.5, 0.7, 0.9)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]


def test_expected_tokens_formula():
    assert cost.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert cost.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # Monte Carlo: tokens of a round = accepted prefix (each token right with a) + 1
    rs = np.random.RandomState(0)
    ok = rs.rand(200000, 4) < 0.7
    acc = np.argmin(np.concatenate([ok, np.zeros((len(ok), 1), bool)], 1), axis=1)
    assert np.mean(acc + 1) == pytest.approx(cost.expected_tokens(0.7, 4), rel=0.01)


def test_lookup_interpolates_and_extrapolates():
    t = {1: 1.0, 4: 2.0, 8: 4.0}
    assert cost.interpolate(t, 1) == 1.0 and cost.interpolate(t, 2) == pytest.approx(4 / 3)
    assert cost.interpolate(t, 16) == pytest.approx(8.0)


@pytest.fixture
def fresh_auto(tmp_path, monkeypatch):
    """An empty auto disk store (its directory returned)."""
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def tuner(fresh_auto):
    """A fresh AutoTuner over the empty store: nothing remembered, as in a fresh process."""
    return AutoTuner()


def _scripted(monkeypatch, answers) -> AutoTuner:
    """A fresh tuner (a new process over the store) whose choice before the sticky rule
    (`Chooser.current`) is the next of `answers`."""
    tuner = AutoTuner()
    monkeypatch.setattr(tuner.chooser, "current", lambda *a, **k: next(answers))
    return tuner


def test_calls_after_the_first_compile_nothing_and_probe_nothing(tiny_pair, random_prompts,
                                                                fresh_auto, monkeypatch):
    """No call measures anything for auto, the first on a fresh store included (priors stand in
    for the device's calibration and the pair's agreement, issue 53); once a change of mind
    the first calls taught has compiled in the background, calls of the same shapes compile
    nothing (jax's compile events counted), in this process and in a new one over the store."""
    target, draft, _ = tiny_pair
    # the methods' own factors at their price: learned from this random pair's sub-ms calls,
    # they move a method against vanilla by the wall clock's noise, and a new process's first
    # call then runs (and compiles) a choice the persistent cache does not hold; the factor's
    # effect on the choice is tested on its own (test_a_methods_timed_rounds_teach_...)
    prompts = random_prompts[:2]
    ref = oj.generate(target, prompts, max_new_tokens=12)
    work = []  # every calibration, anchor timer or agreement measurement
    monkeypatch.setattr(prices, "calibrate", lambda *a, **k: work.append("calibrate"))
    monkeypatch.setattr(prices, "forward_seconds", lambda *a, **k: work.append("anchor"))

    def process():
        """A tuner as a new process over the store has it, its measurements logged."""
        t = AutoTuner()
        monkeypatch.setattr(t.prices, "method_factor", lambda *a: (1.0, TRY_CALLS))
        monkeypatch.setattr(t.agreement, "pair_agreement", lambda *a, **k: work.append(
            "agree"))
        return t

    tuner = process()
    methods = ("speculative", "ouroboros", "lookahead", "prompt_lookup")
    kw = dict(draft=draft, max_new_tokens=12)
    for m in methods:  # first calls: each compiles its loop
        out = oj.generate(target, prompts, method=m, tuner=tuner, **kw)
        assert out.tokens == ref.tokens
        s = out.stats["auto"]
        # (Ouroboros with its own mechanisms off runs as speculative: `choice.as_run`)
        ran = {m, "vanilla"} | ({"speculative"} if m == "ouroboros" else set())
        assert s["asked"] == m and s["method"] in ran and s["reason"]
        assert s["measured_now"] == []
        json.dumps(out.stats)
    for new in range(2):
        if new:
            tuner = process()
        for m in methods:  # what the first calls taught: a change of mind compiles behind
            out = oj.generate(target, prompts, method=m, tuner=tuner, **kw)
            assert out.tokens == ref.tokens
            tuner.switch.wait_for_background()
        for m in methods:
            before = tuner.compiles.programs
            out = oj.generate(target, prompts, method=m, tuner=tuner, **kw)
            assert out.tokens == ref.tokens
            assert tuner.compiles.programs == before, (m, out.stats["auto"])
    assert work == []
    store = json.loads((fresh_auto / "auto.json").read_text())
    assert not {"device", "anchor", "agreement", "latency"} & set(store)
    # the calls that compiled nothing taught auto their loop's prices
    assert sum(v[5] for v in store["timing"].values()) >= 2 * len(methods)


def test_stats_say_what_was_measured_and_what_assumed(tiny_pair, random_prompts, tuner):
    target, draft, _ = tiny_pair
    kw = dict(draft=draft, method="speculative", max_new_tokens=8, tuner=tuner)
    first = oj.generate(target, random_prompts[:1], **kw).stats["auto"]
    assert any("priors" in a for a in first["assumed"])  # the device, never calibrated here
    assert any("agreement 0.5 (a prior" in a for a in first["assumed"])
    assert any("no earlier call" in a for a in first["assumed"])
    assert first["measured_now"] == []
    tuner.measure_prices(target, draft)  # asked for: the device and the anchors, kept
    oj.generate(target, random_prompts[:1], **kw)  # compiled nothing: teaches the prices
    third = oj.generate(target, random_prompts[:1], **kw).stats["auto"]
    assert any("stored" in m for m in third["measured"])
    assert any("timed once on this device" in m for m in third["measured"])
    assert any(m.startswith("loop time of ") and "earlier call" in m for m in third["measured"])
    assert not any("no earlier call" in a for a in third["assumed"])


def test_stats_seconds_include_autos_own_work(tiny_pair, random_prompts, tuner, monkeypatch):
    """stats' seconds are the whole call (auto's work, the host's included), so
    tokens_per_second is what the caller's clock sees; decode_seconds is the loop's part."""
    import time

    target, draft, _ = tiny_pair
    real = tuner.chooser.auto_config
    pause = 0.3

    def slow(*a, **k):
        time.sleep(pause)
        return real(*a, **k)

    monkeypatch.setattr(tuner.chooser, "auto_config", slow)
    kw = dict(draft=draft, method="speculative", max_new_tokens=8, tuner=tuner)
    oj.generate(target, random_prompts[:1], **kw)
    t0 = time.perf_counter()
    out = oj.generate(target, random_prompts[:1], **kw)
    wall = time.perf_counter() - t0
    s = out.stats
    assert s["seconds"] >= s["decode_seconds"] + pause
    assert s["seconds"] <= wall
    assert s["tokens_per_second"] == pytest.approx(s["new_tokens"] / s["seconds"])
    assert 0 <= s["auto"]["seconds"] <= s["seconds"] - s["decode_seconds"]


def test_scales_learned_from_calls_price_their_loops():
    """solve_scales: calls of two configs (different draft shares) recover each model's scale;
    calls of one config cannot tell them apart and split the time evenly, still pricing the
    calls exactly; a target alone gets its own."""
    s_t, s_s = 1.3, 0.7
    calls = [(2.0, 1.0), (2.0, 3.0), (1.0, 0.0)]  # (x_T, x_S) of three calls
    sums = [0.0] * 5 + [0]
    for x_t, x_s in calls:
        y = s_t * x_t + s_s * x_s
        sums = [a + b for a, b in zip(sums, (x_t * x_t, x_t * x_s, x_s * x_s, x_t * y,
                                              x_s * y, 1))]
    a, b, separated = prices.solve_scales(sums)
    assert separated and a == pytest.approx(s_t, rel=1e-3) and b == pytest.approx(s_s, rel=1e-3)
    one = [4.0, 2.0, 1.0, 2.0 * 3.3, 1.0 * 3.3, 1]  # x = (2, 1), y = 3.3
    a, b, separated = prices.solve_scales(one)
    assert not separated and a == pytest.approx(b, rel=1e-2)
    assert 2 * a + 1 * b == pytest.approx(3.3, rel=1e-2)
    assert prices.solve_scales([4.0, 0.0, 0.0, 2.0 * 3.0, 0.0, 1]) == (1.5, 1.5, False)
    assert prices.solve_scales([0.0] * 5 + [0]) == (1.0, 1.0, False)
    # the real pair's sums after 3 calls at γ 4 and 2 at γ 6 (the README bench's store): their
    # draft shares differ by the prompts' prefills alone, and a free fit split them into
    # target x0.16, draft x2.32; one scale prices them instead
    real = [1002.80, 742.85, 557.19, 1881.33, 1409.69, 5]
    a, b, separated = prices.solve_scales(real)
    assert not separated and a == b == pytest.approx(3291.02 / 3045.69, rel=1e-4)
    # a split the data support but far past MAX_SPLIT of the common scale is refused too
    far = [0.0] * 5 + [0]
    for x_t, x_s in calls:
        y = 0.1 * x_t + 3.0 * x_s
        far = [a + b for a, b in zip(far, (x_t * x_t, x_t * x_s, x_s * x_s, x_t * y,
                                            x_s * y, 1))]
    a, b, separated = prices.solve_scales(far)
    assert not separated and a == b


def test_calibration_from_two_matmuls(monkeypatch):
    """calibrate: the bandwidth from the 1-row matmul, the flop rate from the rows past it (a
    CPU); a timing disturbed by load (more rows no dearer) is clamped to the measured range of
    forwards, never a free token."""
    import jax.numpy as jnp

    k, rows = prices.CALIBRATION["cpu"]
    for t1, tr, share in ((1e-3, 2.5e-3, 0.1), (1e-3, 0.9e-3, prices.CPU_TOKEN_SHARE[0])):
        monkeypatch.setattr(prices, "matmul_timer",
                            lambda r, *a, t1=t1, tr=tr: (lambda: t1 if r == 1 else tr))
        rates = prices.calibrate(jnp.float32)
        assert not rates.overlap
        assert rates.bandwidth == pytest.approx(k * k * 4 / t1)
        assert 2 * k * k / rates.flops == pytest.approx(share * t1)
    # a model's t(T) at those rates: its read once, plus its flops per extra token
    shape = cost.ModelShape(weight_bytes=4e8, matmul_params=1e8, layers=10, kv_bytes=0.0)
    rates = cost.DeviceRates(bandwidth=1e10, flops=1e11, per_layer=1e-5, overlap=False)
    t = cost.shape_latency(shape, rates, 1, 0, (1, 5))
    assert t[1] == pytest.approx(1e-4 + 0.04 + 2e8 * 0 / 1e11)
    assert t[5] - t[1] == pytest.approx(4 * 2e8 / 1e11)
    flat = cost.shape_latency(shape, dataclasses.replace(rates, overlap=True), 1, 0, (1, 5))
    assert flat[1] == flat[5] == pytest.approx(1e-4 + 0.04)  # weights-bound: the roofline


def test_wide_forwards_priced_at_their_own_anchors(tiny_pair, tuner, monkeypatch):
    """model_anchor times each model's forwards of 1, 2 and WIDE_ANCHOR tokens: the prices hit
    all three timings exactly, and a size between 2 and WIDE_ANCHOR is priced by the shape at
    a factor halfway (in log T) between the 2-token and the wide one's, not at the 1-token one's
    (on the real 1.5B the shape from t(1) priced t(7) 12% low) nor at the wide one's alone (on
    the demo target the 8-token anchor priced t(2) 15% low). Timed once: a second pricing reads
    the anchors from disk."""
    target, draft, _ = tiny_pair
    w = prices.WIDE_ANCHOR
    assert prices.ANCHOR_SIZES == (1, 2, w) and w == 8  # 4 is halfway from 2 to 8 in log T
    timed = {1: 2e-3, 2: 5e-3, w: 9e-3}  # 2.5x and 4.5x the 1-token forward: not the shapes'
    calls = []

    def timer(model, batch, n, slots, inner=4):
        calls.append(n)
        return lambda: timed[n]

    monkeypatch.setattr(prices, "forward_seconds", timer)
    tt, td, anchors = tuner.prices.base_tables(target, draft, 1, 64, True, probe=True)
    assert sorted(calls) == [1, 1, 2, 2, w, w]
    for table in (tt, td):
        for n in (1, 2, w):
            assert cost.interpolate(table, n) == pytest.approx(timed[n])
    rates, _ = tuner.prices.device_rates(target.params["embed"].dtype)
    shape = tuner.prices.shape_table(target, 1, 64, (1, 2, 4, w), rates)
    a2, aw = timed[2] / shape[2], timed[w] / shape[w]
    assert tt[4] == pytest.approx(shape[4] * (a2 + aw) / 2)
    assert tt[4] != pytest.approx(shape[4] * aw, rel=0.05)
    assert tt[4] != pytest.approx(shape[4] * timed[1] / shape[1], rel=0.05)
    assert tuner.prices.prices_known(target, draft, 1)
    calls.clear()
    assert tuner.prices.base_tables(target, draft, 1, 64, True)[2] == anchors and not calls
    # and without probe, a model never timed is priced at the priors, timing nothing
    tuner.store.update(lambda data: data.pop("anchor"))
    assert tuner.prices.base_tables(target, draft, 1, 64, True)[2] == [prices.PRIOR_ANCHOR] * 2
    assert not calls


def test_choice_is_kept_by_a_second_process_over_the_same_store(tiny_pair, random_prompts,
                                                                fresh_auto, monkeypatch):
    """A process starts from the choice an earlier one stored for the same shapes, and keeps
    it unless another is predicted STICKY_GAIN faster: no flip-flop between processes."""
    import jax.numpy as jnp

    target, draft, _ = tiny_pair
    prompt = jnp.asarray([random_prompts[0][:8]], jnp.int32)
    plens = jnp.asarray([8], jnp.int32)
    seq = iter([Choice("speculative", SpeculativeConfig(gamma=3), 1.5, 0.7, "first",
                       (CPU_T, CPU_D)),
                Choice("speculative", SpeculativeConfig(gamma=4), 1.52, 0.7, "second",
                       (CPU_T, CPU_D))])
    first = _scripted(monkeypatch, seq).auto_config("speculative", target, draft, prompt,
                                                    plens, 64)
    # a second process over the same store
    second = _scripted(monkeypatch, seq).auto_config("speculative", target, draft, prompt,
                                                     plens, 64)
    assert first.config == second.config == SpeculativeConfig(gamma=3)
    assert "kept" in second.reason
    stored = json.loads((fresh_auto / "auto.json").read_text())["choice"]
    assert [v["config"]["gamma"] for v in stored.values()] == [3]


def _abstract(cfg):
    import jax

    from ouroboros_jax.models import init_params

    params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    return oj.Model(cfg, params)


def test_prior_latency_flat_on_accelerators_steep_on_cpu(monkeypatch):
    """Before any probe: a 7B model's forward is weights-bound on an accelerator (t(64) close
    to t(1): the paper's large trees) and grows with every token on a 2-core CPU (small trees);
    a 16x smaller draft costs a fraction of the target."""
    big = _abstract(oj.ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                   num_layers=32, num_heads=32, num_kv_heads=32))
    small = _abstract(oj.ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                     num_layers=8, num_heads=16, num_kv_heads=16))
    sizes = (1, 4, 16, 64, 256)
    for backend, flat in (("gpu", True), ("tpu", True), ("cpu", False)):
        monkeypatch.setattr(prices.jax, "default_backend", lambda b=backend: b)
        tt = prices.prior_latency(big, 1, 1024, sizes)
        td = prices.prior_latency(small, 1, 1024, sizes)
        # never cheaper with more tokens; on an accelerator flat while the weights' read
        # bounds it (the roofline)
        assert all(tt[a] <= tt[b] if flat else tt[a] < tt[b] for a, b in zip(sizes, sizes[1:]))
        assert td[1] < tt[1] / 10
        assert (tt[64] / tt[1] < 1.3) == flat, (backend, tt)
        o = choose("ouroboros", tt, td, 0.9)
        if flat:
            assert o.config.gamma >= 8 and o.config.window >= 8
        else:
            n_t = 1 + o.config.gamma + o.config.suffixes * (o.config.ngram - 1)
            assert o.method == "vanilla" or n_t < 20


def test_agreement_of_a_model_with_itself_is_one(tiny_target, random_prompts):
    import jax.numpy as jnp

    P = 64
    rows = random_prompts[:4]
    prompt = np.zeros((4, P), np.int32)
    for i, r in enumerate(rows):
        prompt[i, :len(r)] = r
    plens = jnp.asarray([len(r) for r in rows], jnp.int32)
    a, n = AutoTuner().agreement.pair_agreement(tiny_target, tiny_target, jnp.asarray(prompt),
                                                plens, use_cache=False)
    assert n == sum(len(r) for r in rows) and a == 1.0


def test_bad_config_string_is_refused(tiny_target):
    with pytest.raises(ValueError, match="config must be"):
        oj.generate(tiny_target, [[3, 4]], method="lookahead", config="fast")


def test_agreement_from_eta_inverts_expected_tokens():
    for a in (0.1, 0.5, 0.7, 0.9):
        for g in (2, 4, 8):
            assert cost.agreement_from_eta(cost.expected_tokens(a, g), g) == pytest.approx(a, abs=1e-6)
    assert cost.agreement_from_eta(1.0, 4) == pytest.approx(0.0, abs=1e-6)


def test_realised_agreement_replaces_the_prompt_estimate(tiny_target, fresh_auto, tuner):
    """Speculative calls record the agreement they realised; after MIN_REALISED_ROUNDS rounds it
    is what auto plans with (the pair is the target with itself: every draft token accepted)."""
    t = tiny_target
    assert tuner.agreement.realised_agreement(t, t) is None
    cfg = SpeculativeConfig(gamma=3)
    out = oj.generate(t, [[5, 6, 7]] * 2, draft=t, method="speculative", config=cfg,
                      max_new_tokens=300, eos_token_id=-1, tuner=tuner)
    assert out.stats["eta"] == pytest.approx(4.0)
    assert out.stats["target_calls"] >= MIN_REALISED_ROUNDS
    assert tuner.agreement.realised_agreement(t, t) > 0.99
    stored = json.loads((fresh_auto / "auto.json").read_text())["realised"]
    # row rounds whose chain was whole: 300 tokens per row are 75 chains of 3 + the target's own
    assert list(stored.values())[0][1] == sum(out.stats["whole_histogram"]) == 2 * 75
    assert out.stats["target_calls"] == 75


def test_choice_is_sticky_unless_clearly_better(tiny_pair, random_prompts, fresh_auto,
                                                monkeypatch):
    """A new config means a new compile: a process keeps its choice for the same shapes unless
    another is predicted STICKY_GAIN faster."""
    import jax.numpy as jnp

    target, draft, _ = tiny_pair
    prompt = jnp.asarray([random_prompts[0][:8]], jnp.int32)
    plens = jnp.asarray([8], jnp.int32)
    seq = iter([Choice("speculative", SpeculativeConfig(gamma=3), 1.5, 0.7, "first",
                       (CPU_T, CPU_D)),
                Choice("speculative", SpeculativeConfig(gamma=4), 1.52, 0.7, "second",
                       (CPU_T, CPU_D)),
                Choice("vanilla", None, 1.0, 0.05, "third", (CPU_T, CPU_D))])
    tuner = _scripted(monkeypatch, seq)
    first = tuner.auto_config("speculative", target, draft, prompt, plens, 64)
    second = tuner.auto_config("speculative", target, draft, prompt, plens, 64)
    assert first.config == second.config == SpeculativeConfig(gamma=3) and "kept" in second.reason
    # the rival named at the prices now: gamma 4's speedup, not its reason's words
    rival = predicted_rate("speculative", SpeculativeConfig(gamma=4), CPU_T, CPU_D, 0.7)
    assert f"kept: {rival / cost.vanilla_rate(CPU_T):.2f}x vanilla for another" in second.reason
    third = tuner.auto_config("speculative", target, draft, prompt, plens, 64)  # a = 0.05: SD loses
    assert third.method == "vanilla"


def test_sharded_call_keys_the_sharded_model(tiny_pair, fresh_auto, tuner):
    """With mesh= and config="auto", auto prices and keeps its choice for the model as the call
    runs it (placed on the mesh), keyed by that placement, not by the unsharded copy."""
    from ouroboros_jax.sharding import make_mesh, shard_model

    target, draft, _ = tiny_pair
    mesh = make_mesh(1, 2)
    oj.generate(target, [[5, 6, 7, 8]], draft=draft, method="speculative", mesh=mesh,
                max_new_tokens=4, tuner=tuner)
    keys = list(json.loads((fresh_auto / "auto.json").read_text())["choice"])
    sharded_sig = tuner.signatures(shard_model(target, mesh))
    assert sharded_sig != tuner.signatures(target)
    assert any(f"|{sharded_sig}|" in k for k in keys), keys
    assert not any(f"|{tuner.signatures(target)}|" in k for k in keys), keys


def test_prompt_lookup_learns_its_copy_hit_rate(tiny_target, fresh_auto, tuner, monkeypatch):
    """Prompt lookup has no draft, so its prices rested on copy priors fitted to copy-heavy
    requests (on SmolLM2's chat prompts auto chose it at 0.81x vanilla). A greedy call now
    records the hit rate its eta implies (`hit_from_eta`, the inverse of `expected_tokens`),
    and auto prices the next choice with it: a workload that never copies turns it off."""
    from ouroboros_jax.decoding import prompt_lookup as pl

    for x, m, hit in ((1, 4, 0.08), (2, 8, 0.3), (3, 2, 0.5)):
        assert pl.hit_from_eta(pl.expected_tokens(x, m, hit), x, m) == pytest.approx(hit)
    assert pl.hit_from_eta(0.5, 1, 4) == 0.0 and pl.hit_from_eta(99.0, 1, 4) == 1.0
    t = tiny_target
    # the choice, on CPU-like prices: with nothing realised the prior pays; 0.02 does not
    _cpu_prices(tuner, monkeypatch)
    prompt, plens = np.array([[5, 6, 7, 0]], np.int32), np.array([3], np.int32)
    margins, choose = [], choice_mod.choose
    monkeypatch.setattr(choice_mod, "choose", lambda *a: margins.append(a[5]) or choose(*a))
    prior = tuner.chooser.current("prompt_lookup", t, None, prompt, plens, 64, True)
    assert prior.method == "prompt_lookup" and "prior" in " ".join(prior.notes["assumed"])
    tuner.agreement.record_realised(t, None, 0.02, 10 * MIN_REALISED_ROUNDS,
                                    method="prompt_lookup")
    # (its rounds timed at their price: the margin is the realised rate's)
    monkeypatch.setattr(tuner.prices, "relative_factor", lambda *a: (1.0, 5, 5))
    learned = tuner.chooser.current("prompt_lookup", t, None, prompt, plens, 64, True)
    assert learned.method == "vanilla"
    assert "realised over" in " ".join(learned.notes["measured"])
    # a rate still to be measured is tried on the smaller margin; a realised one needs the full
    assert margins == [TRY_GAIN, MIN_GAIN]
    gain = choose("prompt_lookup", CPU_T, None, None).predicted_speedup
    assert choose("prompt_lookup", CPU_T, None, None, None, gain - 0.01).method == "prompt_lookup"
    assert choose("prompt_lookup", CPU_T, None, None, None, gain + 0.01).method == "vanilla"
    # a greedy call with an explicit config adds the rate it realised, weighted by its rounds
    realised = lambda: json.loads((fresh_auto / "auto.json").read_text())["realised"]  # noqa
    ((key, (s0, n0)),) = realised().items()
    assert key.endswith("|prompt_lookup")
    cfg = pl.PromptLookupConfig(candidates=1, length=4)
    out = oj.generate(t, [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]], method="prompt_lookup",
                      config=cfg, max_new_tokens=24, eos_token_id=-1, tuner=tuner)
    rounds = out.stats["target_calls"]
    s1, n1 = realised()[key]
    assert n1 == n0 + rounds
    assert s1 - s0 == pytest.approx(pl.hit_from_eta(out.stats["eta"], 1, 4) * rounds)
    oj.generate(t, [[1, 2, 3]], method="prompt_lookup", config=cfg, max_new_tokens=24,
                temperature=1.0, tuner=tuner)  # sampled: teaches nothing
    assert realised() == {key: [s1, n1]}


def test_anchors_take_the_second_fastest_round():
    """`_measure`: the fastest round by default, the (rank+1)-th fastest with rank, and still
    monotone in n. One lucky round (the real 1.5B's 1-token timer read 187 ms once in five
    whose median was 234) must not set an anchor, so `model_anchor` passes rank 1."""
    seq = {1: iter([0.30, 0.187, 0.25, 0.234, 0.24]), 2: iter([0.31, 0.30, 0.32, 0.33, 0.29])}
    timers = {n: (lambda it=it: next(it)) for n, it in seq.items()}
    table = prices.measure(timers, 5, rank=1)
    assert table == {1: 0.234, 2: 0.30}
    seq = {1: iter([0.30, 0.187]), 2: iter([0.10, 0.12])}
    timers = {n: (lambda it=it: next(it)) for n, it in seq.items()}
    assert prices.measure(timers, 2) == {1: 0.187, 2: 0.187}  # monotone: never cheaper wider
    import inspect
    assert "rank=1" in inspect.getsource(prices.Prices.model_anchor)


def test_model_signature_remembered_per_array_and_config(tiny_pair):
    """The remembered signature is the computed one, follows a new dtype (new arrays) and a
    new config on the same arrays, and is forgotten with the arrays."""
    import dataclasses
    import gc

    import jax.numpy as jnp

    target, _, _ = tiny_pair
    sigs = Signatures()
    sig = sigs(target)
    assert sig == signature_of(target) == sigs(target)
    half = dataclasses.replace(target, params={k: (v.astype(jnp.bfloat16) if k == "embed" else v)
                                               for k, v in target.params.items()})
    assert sigs(half) == signature_of(half) != sig
    other = dataclasses.replace(target, config=dataclasses.replace(target.config,
                                                                   rope_theta=1234.0))
    assert sigs(other) == signature_of(other) != sig
    assert len(sigs) == 2  # target's and other's share their arrays; half has its own
    del half
    gc.collect()
    assert len(sigs) == 1


def test_a_quantized_model_has_its_own_signature(tiny_pair):
    """An int8 draft (the CLI's default on an AVX-512 CPU) runs other products than its float
    self: auto's store must not price one with the other's measurements."""
    import dataclasses

    from ouroboros_jax.models.quant import quantize_params

    _, draft, _ = tiny_pair

    def int8():  # quantize_params, not quantize_model: no once-per-process CPU notice spent
        return dataclasses.replace(draft, params=quantize_params(draft.params, draft.config,
                                                                 "int8"))

    assert signature_of(int8()) != signature_of(draft)
    assert signature_of(int8()) == signature_of(int8())


def test_a_quantized_model_is_priced_at_the_bytes_it_holds(tiny_pair):
    """An int8 model's forward reads a byte a weight plus its scales, not the four bytes its
    float embedding's dtype would say: its shape's weight bytes are the codes' and scales'
    (the embedding, only looked up, is outside them for an untied model), its FLOPs its
    float self's."""
    import dataclasses

    from ouroboros_jax.auto.prices import model_shape
    from ouroboros_jax.models.quant import quantize_params

    _, draft, _ = tiny_pair
    q = dataclasses.replace(draft, params=quantize_params(draft.params, draft.config, "int8"))
    f, i = model_shape(draft), model_shape(q)
    assert i.matmul_params == f.matmul_params
    assert f.weight_bytes == 4 * f.matmul_params
    # the linear weights' codes at a byte each, a float32 scale per output channel; norms and
    # the untied embedding's row lookups stay float
    assert f.weight_bytes / 4 < i.weight_bytes < f.weight_bytes / 2


def test_a_methods_timed_rounds_teach_a_factor_of_their_own(tiny_target, tuner):
    """Each method's timed calls teach what its loops measure over their price at the learned
    scales, pooled with one call at its price; relative to vanilla's, it divides every
    predicted speedup of the method."""
    t = tiny_target
    assert tuner.prices.method_factor(t, None, 1, "prompt_lookup") == (1.0, 0)
    base = tuner.prices.timing_key(t, None, 1)
    # the target's scale: 1 (vanilla calls priced 2 s that took 2 s)
    tuner.store.add("timing", base, (4.0, 0.0, 0.0, 4.0, 0.0, 1), (0.0,) * 5 + (0,))
    tuner.store.add("rounds", f"{base}|vanilla", (2.0, 0.0, 2.0, 1), (0.0, 0.0, 0.0, 0))
    # one prompt-lookup call priced 1 s that took 0.8 s: half way to 0.8
    tuner.store.add("rounds", f"{base}|prompt_lookup", (1.0, 0.0, 0.8, 1), (0.0, 0.0, 0.0, 0))
    assert tuner.prices.method_factor(t, None, 1, "prompt_lookup") == (pytest.approx(0.9), 1)
    # two more at 0.8: (2.4 + 1) / (3 + 1)
    tuner.store.add("rounds", f"{base}|prompt_lookup", (2.0, 0.0, 1.6, 2), (0.0, 0.0, 0.0, 0))
    assert tuner.prices.method_factor(t, None, 1, "prompt_lookup") == (pytest.approx(0.85), 3)
    # against vanilla's loops, measured 10% over their price
    tuner.store.add("rounds", f"{base}|vanilla", (0.0, 0.0, 0.4, 0), (0.0, 0.0, 0.0, 0))
    f, n_m, n_v = tuner.prices.relative_factor(t, None, 1, "prompt_lookup")
    assert (n_m, n_v) == (3, 1) and f == pytest.approx(0.85 / ((2.4 + 2) / 4))
    # what auto's choice divides by: a config's predicted speedup rises as 1 / f
    cfg = METHODS["prompt_lookup"].config_type(candidates=1, length=4)
    plain = predicted_speedup("prompt_lookup", cfg, CPU_T, None, 0.1)
    assert predicted_speedup("prompt_lookup", cfg, CPU_T, None, 0.1, f) == pytest.approx(
        plain / f)
    assert predicted_speedup("vanilla", None, CPU_T, None, 0.1, f) == 1.0


def test_record_call_adds_the_methods_own_sums(tiny_target, tuner):
    """A timed call adds its loop's unscaled price and measured seconds under its method, the
    same price the scales' sums pool."""
    t = tiny_target
    stats = {"target_calls": 40, "draft_calls": 0, "new_tokens": 48, "eta": 1.2}
    cfg = METHODS["prompt_lookup"].config_type(candidates=1, length=4)
    tuner.prices.record_call("prompt_lookup", cfg, t, None, stats, 0.5, 1, 8, 64)
    data = tuner.store.read()
    base = tuner.prices.timing_key(t, None, 1)
    x_t, x_s, y, n = data["rounds"][f"{base}|prompt_lookup"]
    sums = data["timing"][base]
    assert n == 1 and y == 0.5 and x_s == 0.0
    assert x_t * x_t == pytest.approx(sums[0]) and x_t * y == pytest.approx(sums[3])
    assert f"{base}|vanilla" not in data["rounds"]


def _cpu_prices(tuner, monkeypatch) -> None:
    """The tuner prices every forward at CPU_T, nothing measured."""
    monkeypatch.setattr(tuner.prices, "latency_tables", lambda *a, **k: (
        CPU_T, None, {"measured": [], "assumed": []}))


def _prompt_lookup_at_1_02x(tuner, t, monkeypatch):
    """(target, prompt, plens) with CPU-like prices and a realised copy hit rate at which
    prompt lookup's best config is predicted 1.02x vanilla: between TRY_GAIN and MIN_GAIN."""
    _cpu_prices(tuner, monkeypatch)
    grid = list(METHODS["prompt_lookup"].auto_grid())
    hit = next(h / 1000 for h in range(1, 400)
               if 1.01 < max(predicted_speedup("prompt_lookup", c, CPU_T, None, h / 1000)
                             for c in grid) < 1.03)
    tuner.agreement.record_realised(t, None, hit, 10 * MIN_REALISED_ROUNDS, method="prompt_lookup")
    return t, np.array([[5, 6, 7, 0]], np.int32), np.array([3], np.int32)


def test_an_untimed_method_is_tried_from_the_smaller_margin(tiny_target, tuner,
                                                            monkeypatch):
    """A method predicted under MIN_GAIN but over TRY_GAIN runs while no call has timed its
    rounds (its calls then teach its factor); timed at its price it needs MIN_GAIN, and timed
    10% under its price it runs again."""
    t, prompt, plens = _prompt_lookup_at_1_02x(tuner, tiny_target, monkeypatch)
    ask = functools.partial(tuner.chooser.current, "prompt_lookup", t, None, prompt, plens, 64,
                            True, timed=True)
    untimed = ask()
    assert untimed.method == "prompt_lookup" and untimed.price_factor == 1.0
    assert "no call of it timed yet" in " ".join(untimed.notes["assumed"])
    for f, method in ((1.0, "vanilla"), (0.9, "prompt_lookup"), (1.1, "vanilla")):
        monkeypatch.setattr(tuner.prices, "relative_factor", lambda *a, f=f: (f, 4, 4))
        c = ask()
        assert c.method == method and c.price_factor == f, (f, c.reason)
        assert f"x{f:.3f} their price" in " ".join(c.notes["measured"])
    # timed by fewer than TRY_CALLS calls: still tried down to UNTIMED_GAIN
    for f, method in ((1.15, "prompt_lookup"), (1.25, "vanilla")):
        monkeypatch.setattr(tuner.prices, "relative_factor", lambda *a, f=f: (f, TRY_CALLS - 1, 4))
        c = ask()
        assert c.method == method, (f, c.reason)
        assert ("trying it" in c.reason) == (method == "prompt_lookup")
    # and where no call will time it (the serving engine), the full margin
    monkeypatch.setattr(tuner.prices, "relative_factor", lambda *a: (1.15, TRY_CALLS - 1, 4))
    assert ask().method == "prompt_lookup"
    served = tuner.chooser.current("prompt_lookup", t, None, prompt, plens, 64, True)
    assert served.method == "vanilla"


def test_a_stalled_call_moves_the_factor_only_to_the_clip(tiny_target, tuner):
    """Once FACTOR_CLIP_CALLS calls back the factor, a call measured far from it is pooled at
    FACTOR_CLIP of what the factor predicts; the first calls are pooled as measured."""
    t = tiny_target
    stats = {"target_calls": 40, "draft_calls": 0, "new_tokens": 48, "eta": 1.2}
    cfg = METHODS["prompt_lookup"].config_type(candidates=1, length=4)
    key = f"{tuner.prices.timing_key(t, None, 1)}|prompt_lookup"
    call = functools.partial(tuner.prices.record_call, "prompt_lookup", cfg, t, None, stats)
    call(0.5, 1, 8, 64)
    x_t = tuner.store.read()["rounds"][key][0]
    call(0.5 * 3, 1, 8, 64)  # the second call: as measured (one call backs nothing yet)
    assert tuner.store.read()["rounds"][key][2] == pytest.approx(2.0)
    f, n = tuner.prices.method_factor(t, None, 1, "prompt_lookup")
    s_t = tuner.prices.learned_scales(t, None, 1)[0]
    call(10.0, 1, 8, 64)  # stalled: pooled at the clip
    assert tuner.store.read()["rounds"][key][2] == pytest.approx(
        2.0 + prices.FACTOR_CLIP * f * s_t * x_t)
    f, n = tuner.prices.method_factor(t, None, 1, "prompt_lookup")
    s_t = tuner.prices.learned_scales(t, None, 1)[0]
    before = tuner.store.read()["rounds"][key][2]
    call(1e-4, 1, 8, 64)  # and from below
    x = tuner.store.read()["rounds"][key]
    assert x[3] == 4 and x[2] == pytest.approx(before + f * s_t * x_t / prices.FACTOR_CLIP)


def test_an_untimed_method_needs_the_full_margin_where_no_call_will_time_it(
        tiny_target, tuner, monkeypatch):
    """The serving engine's choices (`auto_config` without `timed`) teach no factor, so there a
    method no call has timed needs MIN_GAIN, as before; generate's calls try it from TRY_GAIN."""
    t, prompt, plens = _prompt_lookup_at_1_02x(tuner, tiny_target, monkeypatch)
    served = tuner.auto_config("prompt_lookup", t, None, prompt, plens, 64)
    assert served.method == "vanilla"
    assert "tried from" not in " ".join(served.notes["assumed"])
    tuner = AutoTuner()  # a new process over the store: nothing chosen in memory
    _cpu_prices(tuner, monkeypatch)
    asked = tuner.auto_config("prompt_lookup", t, None, prompt, plens, 64, timed=True,
                              switch_gain=1.0)
    assert asked.method == "prompt_lookup", asked.reason


def test_the_engine_sizes_its_load_levels_with_a_tuner_of_its_own(tiny_pair, fresh_auto,
                                                                  monkeypatch):
    """An engine builds and owns its tuner: its load levels are chosen there (and stored),
    never by the default tuner `generate` uses, and two engines keep apart."""
    from ouroboros_jax.auto import default_tuner
    from ouroboros_jax.serving.engine import Engine

    def refuse(*a, **k):
        raise AssertionError("the engine asked the default tuner")

    monkeypatch.setattr(default_tuner().chooser, "auto_config", refuse)
    target, draft, _ = tiny_pair
    kw = dict(method="speculative", slots=2, max_cache_len=64, rounds_per_step=2)
    one, two = Engine(target, draft, **kw), Engine(target, draft, **kw)
    assert isinstance(one.tuner, AutoTuner) and one.tuner is not two.tuner
    assert one.tuner is not default_tuner()
    stored = json.loads((fresh_auto / "auto.json").read_text())["choice"]
    assert {k.split("|B")[1].split("|")[0] for k in stored} == {"1", "2"}  # a level each
