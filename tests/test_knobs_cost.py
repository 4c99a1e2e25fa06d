"""One knob description per method config (decoding/knobs.py) and the pure cost model
(decoding/cost.py): auto's grid, tune's search, recipes and the ablation steps all come from
the same description; rates are the forward sizes priced by hand-checkable arithmetic."""

import itertools

import pytest

from ouroboros_jax.bench import configs, tune
from ouroboros_jax.decoding import METHODS, cost
from ouroboros_jax.decoding.knobs import recipe_of
from ouroboros_jax.decoding.lookahead import LookaheadConfig
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig


def test_auto_grid_applies_the_tie_rules():
    values = {"gamma": (2, 3), "window": (2, 4), "ngram": (3,), "suffixes": (1, 3)}
    grid = METHODS["ouroboros"].auto_grid(values)
    want = [(g, w, 3, w, x) for g, w, x in itertools.product((2, 3), (2, 4), (1, 3)) if x <= w]
    assert [(c.gamma, c.window, c.ngram, c.guesses, c.suffixes) for c in grid[:len(want)]] == want
    # then the switch variants, their idle knobs pinned (G = W still holds)
    assert all(c.phrase_drafting and c.lengthening for c in grid[:len(want)])
    assert all(c.guesses == c.window and c.suffixes <= c.window for c in grid)
    sd = [c for c in grid if not (c.phrase_drafting or c.lengthening or c.free_drafts)]
    assert [(c.gamma, c.window, c.suffixes) for c in sd] == [(2, 2, 1), (3, 2, 1)]
    # free drafts over the SD step, at every threshold, matches of up to 6 tokens (ngram 7)
    free = [c for c in grid if c.free_drafts and not c.phrase_drafting]
    assert {(c.gamma, c.ngram, c.free_threshold) for c in free} == {
        (g, 7, t) for g in (2, 3) for t in (2, 3, 4, 6)}
    la = METHODS["lookahead"].auto_grid({"window": (2, 8), "ngram": (3, 5)})
    assert [(c.window, c.ngram, c.guesses) for c in la] == [(2, 3, 2), (2, 5, 2), (8, 3, 8),
                                                             (8, 5, 8)]


def test_tune_make_clamps_what_the_grid_drops():
    space = OuroborosConfig.KNOBS
    cfg = space.make(OuroborosConfig, {"gamma": 4, "window": 2, "ngram": 5, "suffixes": 3})
    assert (cfg.guesses, cfg.suffixes) == (2, 2)  # G = W, X clamped to W
    assert tune._cfg({"gamma": 4, "window": 2, "ngram": 5, "suffixes": 3}) == cfg


def test_auto_and_tune_search_the_same_knobs():
    for m, space in tune.tunable().items():
        auto_fields = set(METHODS[m].knobs.values("auto"))
        assert auto_fields == set(space.values("tune")) == set(tune._grid(m))
    assert sorted(tune.tunable()) == ["lookahead", "ouroboros", "prompt_lookup", "speculative"]
    assert [k.field for k in tune.tunable()["lookahead"].searched] == ["window", "ngram"]


@pytest.mark.parametrize("cfg", [SpeculativeConfig(gamma=7), LookaheadConfig(window=3, ngram=4,
                                                                              guesses=3),
                                 OuroborosConfig(gamma=5, window=6, ngram=4, guesses=6,
                                                 suffixes=2),
                                 OuroborosConfig(gamma=2, window=2, ngram=3, guesses=2,
                                                 suffixes=1, phrase_drafting=False,
                                                 lengthening=False, recycling=False)])
def test_recipe_evaluates_back_into_the_config(cfg):
    r = recipe_of(cfg)
    assert r.startswith(type(cfg).__name__ + "(")
    assert eval(r, {type(cfg).__name__: type(cfg)}) == cfg


def test_ablation_steps_add_one_mechanism_each():
    steps = configs.ablation_steps()
    assert [s for s, _ in steps] == ["SD", "+phrase drafting", "+lengthening", "+recycling",
                                     "+history", "+context phrases"]
    on = [sum(sw.values()) for _, sw in steps]
    assert on == [0, 1, 2, 3, 4, 5]
    runs = configs.method_runs(["ablation"])
    assert runs[0].config.phrase_drafting is False and runs[-1].config.history is True
    # the paper's four mechanisms first, this code's extension last
    assert runs[-2].config.context_phrases is False and runs[-1].config.context_phrases is True
    la = LookaheadConfig.KNOBS.ablation_steps()
    assert la == (("lookahead", {"context_phrases": False}),
                  ("+context phrases", {"context_phrases": True}))


def test_interpolate_by_hand():
    t = {"1": 1.0, "4": 2.0, "8": 4.0}  # string keys, as JSON gives them
    assert cost.interpolate(t, 1) == 1.0 and cost.interpolate(t, 0) == 1.0
    assert cost.interpolate(t, 2) == pytest.approx(1 + 1 / 3)
    assert cost.interpolate(t, 6) == pytest.approx(3.0)
    assert cost.interpolate(t, 16) == pytest.approx(8.0)  # slope 0.5 past the last size
    with pytest.raises(ValueError, match="empty"):
        cost.interpolate({}, 1)


def test_rates_priced_from_forward_sizes_by_hand():
    tt = {1: 1.0, 5: 2.0}
    td = {1: 0.1}
    a, g = 0.5, 4
    # speculative: 4 one-token draft forwards + a 5-token target forward + overhead
    want = cost.expected_tokens(a, g) / (4 * 0.1 + 2.0 + cost.ROUND_OVERHEAD * 1.0)
    assert METHODS["speculative"].rate(SpeculativeConfig(gamma=g), a, tt, td) == pytest.approx(want)
    assert cost.expected_tokens(a, g) == pytest.approx(1 + .5 + .25 + .125 + .0625)
    # lookahead W 1 N 3 G 1: a (1+1)*2 = 4-token forward, no overhead
    la = LookaheadConfig(window=1, ngram=3, guesses=1)
    assert METHODS["lookahead"].forward_sizes(la)[0] == 4
    assert METHODS["lookahead"].rate(la, None, tt, None) == pytest.approx(
        (1 + cost.phrase_gain(1, 3)) / 1.75)
    assert cost.phrase_gain(1, 3) == pytest.approx(0.1 * (1 + 0.8))
    assert cost.vanilla_rate(tt) == pytest.approx(1 / (1 + cost.VANILLA_STEP_SECONDS))
    # vanilla's fixed work per step weighs on small forwards, up to a cap
    small = {1: 5e-3, 4: 9e-3}
    assert cost.vanilla_rate(small) == pytest.approx(1 / (5e-3 + cost.VANILLA_STEP_SECONDS))
    tiny = {1: 1e-4, 4: 2e-4}
    assert cost.vanilla_rate(tiny) == pytest.approx(1 / (1e-4 * (1 + cost.VANILLA_OVERHEAD_CAP)))


def test_round_cost_prices_a_round_by_hand():
    """experiments.round_cost: a round's price is its target forward, its draft forwards per round
    and the first draft forward's extra (timed after the target), each at its own size."""
    from experiments import round_cost

    cfg = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
    sh = round_cost.forward_shapes(cfg)
    assert sh == {"t": (11,), "s": (24, 17), "s1": (28, 17)}
    sd = round_cost.row_config("SD", 4, 4, 4, 4, 2)
    assert round_cost.forward_shapes(sd) == round_cost.forward_shapes(SpeculativeConfig(gamma=4))
    lat = {("t", 11): 0.25, ("s", 24, 17): 0.125, ("ts1", 11, 28, 17): 0.25 + 0.14}
    # 30 rounds, 75 draft forwards: 0.25 + 2.5 * 0.125 + (0.14 - 0.125)
    assert round_cost.round_price(sh, 30, 75, lat) == pytest.approx(0.25 + 0.3125 + 0.015)
    with pytest.raises(ValueError, match="--target-ms"):
        round_cost.parse_ms("1=122", "--target-ms")
    with pytest.raises(ValueError, match="--rows"):
        round_cost.row_config("nope", 4, 4, 4, 4, 2)


def test_round_cost_fit_prices_sd_as_speculative():
    """The SD variant's best rate equals speculative's best (the same forwards, the same round
    model), here and on flat latencies; every variant is priced on both tables."""
    from experiments import round_cost

    rows = round_cost.fit({1: 0.122, 4: 0.182, 16: 0.279}, {1: 0.057, 16: 0.104}, 0.9, 0.32)
    assert [r[0] for r in rows][:2] == ["speculative", "Ouroboros, every mechanism"]
    sd = [r for r in rows if r[0].startswith("Ouroboros SD")]
    assert len(sd) == 1 and sd[0][2] == pytest.approx(1.0) and sd[0][3] == pytest.approx(1.0)
    assert all(r[2] > 0 and r[3] > 0 for r in rows)
    # flat latencies, a free draft: speculative's best gamma multiplies vanilla's rate by its
    # tokens per round; a draft dearer than the target cannot pay
    assert round_cost.speculative_vs_vanilla({1: 1.0}, {1: 1e-9}, 0.9) > 3
    assert round_cost.speculative_vs_vanilla({1: 1.0}, {1: 2.0}, 0.9) < 1


@pytest.mark.parametrize("method", ["speculative", "ouroboros", "lookahead", "prompt_lookup"])
def test_dense_tables_price_every_config_as_the_measured_tables_do(method):
    # measured at a few sizes only (string keys, as the store's JSON gives them): every config
    # of the grid must be priced the same from auto's dense tables, whose sizes are exact hits
    from ouroboros_jax.auto import choice

    tt = {"1": 0.004, "2": 0.0047, "5": 0.0051, "9": 0.007, "17": 0.0091}
    td = {"1": 0.0011, "4": 0.0013, "16": 0.0024}
    spec = METHODS[method]
    grid = list(spec.auto_grid())
    dt, dd = choice.dense_tables({spec.forward_sizes(c) for c in grid}, tt, td)
    assert all(isinstance(n, int) for n in dt)  # exact hits, not a copy of the string keys
    for a in (0.5, 0.9):
        for c in grid:
            assert spec.rate(c, a, dt, dd) == pytest.approx(spec.rate(c, a, tt, td), rel=1e-12)
    best = choice.choose(method, tt, td, 0.9, min_gain=0.0)  # never vanilla
    assert best.config in grid and best.predicted_speedup == pytest.approx(
        max(spec.rate(c, 0.9, tt, td) for c in grid) / cost.vanilla_rate(tt))


def test_interpolate_returns_a_held_size_as_is_and_interpolates_the_rest():
    t = {1: 1.0, 3: 3.0, 8: 5.0}
    assert cost.interpolate(t, 3) == 3.0 and cost.interpolate(t, 2) == 2.0
    assert cost.interpolate(t, 10) == pytest.approx(5.8)
