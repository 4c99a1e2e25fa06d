"""A call with an empty auto store pays no tuning tax (issue 53): it decodes with a config
chosen from what is already known (priors from the models' shapes and bytes where the store has
no calibration), measures nothing, compiles only its own loop, and the store fills from its own
rounds, so a new tuner over the store (a second process) reads what the first call learned.

Compiles are counted from jax's monitoring events (the tuner's `compiles`); the measurements
auto could make (the device's calibration, the models' anchor timers, the prompts' agreement
forwards) are each replaced by a spy that fails the test if called."""

import json

import jax
import jax.numpy as jnp
import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner, prices
from ouroboros_jax.auto.agreement import DEFAULT_AGREEMENT
from ouroboros_jax.auto.choice import EXPLORE_DEPTH
from ouroboros_jax.decoding.knobs import recipe_of


@pytest.fixture
def empty_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def no_probes(monkeypatch):
    """Every measurement auto can make, failing the test when made."""
    def fail(what):
        return lambda *a, **k: pytest.fail(f"a generate call measured {what}")

    monkeypatch.setattr(prices, "calibrate", fail("the device (calibrate)"))
    monkeypatch.setattr(prices, "forward_seconds", fail("a model's forwards (anchors)"))
    monkeypatch.setattr(prices, "measure", fail("timers (measure)"))
    monkeypatch.setattr(AutoTuner, "measure_prices", fail("prices (measure_prices)"))
    import ouroboros_jax.auto.agreement as agreement
    monkeypatch.setattr(agreement, "agreement_counts", fail("the prompts' agreement"))


def test_a_first_call_measures_nothing_and_compiles_only_its_loop(tiny_pair, empty_store,
                                                                   no_probes):
    _first_call_builds_only_its_loop(tiny_pair, "speculative")


def test_a_first_ouroboros_call_measures_nothing_and_compiles_only_its_loop(
        tiny_pair, empty_store, no_probes):
    _first_call_builds_only_its_loop(tiny_pair, "ouroboros")


def _first_call_builds_only_its_loop(tiny_pair, method):
    """Auto's choice on an empty store is made without running anything; a call with that
    config passed explicitly builds the call's programs; the auto call after it then builds
    none: no timer, no agreement forward, no second loop (the old end-of-call `settle`), and
    nothing is left compiling behind it."""
    target, draft, _ = tiny_pair
    jax.clear_caches()  # as a fresh process (Ouroboros' choice may run speculative's loop)
    prompts = [[5, 6, 7, 8, 9, 10]]  # 6 new tokens: fewer rounds than teach a depth
    kw = dict(draft=draft, method=method, max_new_tokens=6, eos_token_id=-1)
    ref = oj.generate(target, prompts, max_new_tokens=6, eos_token_id=-1).tokens
    tuner = AutoTuner()
    prompt_j, plens_j = jnp.asarray(prompts, jnp.int32), jnp.asarray([6], jnp.int32)
    before = tuner.compiles.programs
    choice, _ = AutoTuner().call_choice(method, target, draft, prompt_j, plens_j, 6, None,
                                        None, True)
    assert tuner.compiles.programs == before  # chosen from the store and priors alone
    cfg = choice.config
    explicit = oj.generate(target, prompts, **dict(kw, method=choice.method, config=cfg))
    built = tuner.compiles.programs - before
    assert built > 0 and explicit.tokens == ref
    out = oj.generate(target, prompts, tuner=tuner, **kw)
    assert out.tokens == ref
    a = out.stats["auto"]
    assert (a["method"], a["config"]) == (choice.method, None if cfg is None else recipe_of(cfg))
    assert tuner.compiles.programs - before == built  # nothing beyond its own loop
    assert a["compiled"] == {"programs": 0, "seconds": 0.0}
    assert a["measured_now"] == []  # nothing measured for auto, and said so
    assert any("priors" in x for x in a["assumed"])
    assert any(f"agreement {DEFAULT_AGREEMENT}" in x for x in a["assumed"])
    assert not [t for t in tuner.switch._warming.values() if t.is_alive()]  # noqa: SLF001


def test_a_first_call_says_what_it_compiled(tiny_pair, empty_store, no_probes):
    """stats["auto"]["compiled"]: the programs a first call's loop built and their seconds,
    the seconds the caller paid (never hidden)."""
    target, draft, _ = tiny_pair
    jax.clear_caches()  # as a fresh process: no program in memory
    out = oj.generate(target, [[5, 6, 7, 8, 9, 10, 11]], draft=draft, method="speculative",
                      max_new_tokens=9, eos_token_id=-1, tuner=AutoTuner())
    c = out.stats["auto"]["compiled"]
    assert c["programs"] > 0 and 0 < c["seconds"] <= out.stats["decode_seconds"]


def test_the_store_fills_from_the_first_calls_own_rounds(tiny_target, empty_store, no_probes):
    """The first greedy call's rounds teach the pair's agreement by depth (no prompt forwards);
    a new tuner over the store (a second process) prices its choice with it, still measuring
    nothing; the calls after the first, which compile nothing, teach the loop's prices."""
    t = tiny_target  # its own draft: every token agrees, so the agreement learned is 1
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    # whole rounds of the explored chain, 8 a row: the depths pass MIN_DEPTH_ROUNDS
    kw = dict(draft=t, method="speculative", max_new_tokens=8 * (EXPLORE_DEPTH + 1),
              eos_token_id=-1)
    first = oj.generate(t, prompts, tuner=AutoTuner(), **kw)
    store = json.loads((empty_store / "auto.json").read_text())
    assert "device" not in store and "anchor" not in store and "agreement" not in store
    depth = list(store["depth"].values())[0]
    assert depth[0][0] == sum(first.stats["acceptance_histogram"]) > 0
    assert depth[0][1] == depth[0][0]  # every first token accepted (rows cut by the limit
    # can leave a deeper drafted token unused)
    second_process = AutoTuner()
    second = oj.generate(t, prompts, tuner=second_process, **kw).stats["auto"]
    assert second["agreement_by_depth"][0] == 1.0
    assert any("realised over" in m for m in second["measured"])
    assert second["measured_now"] == []
    # a call that compiled nothing teaches the prices (against the priors: their own key)
    oj.generate(t, prompts, tuner=second_process, **kw)
    timing = json.loads((empty_store / "auto.json").read_text())["timing"]
    assert timing and all(k.endswith("|prior") for k in timing)
    third = oj.generate(t, prompts, tuner=second_process, **kw).stats["auto"]
    assert any(m.startswith("loop time of ") for m in third["measured"])


def test_measuring_is_asked_for_said_and_logged(tiny_pair, empty_store, capsys, monkeypatch):
    """A tuner measures only when asked (`measure_prices`: a server or notebook that lives on):
    it says so on stderr first, with an estimate of the seconds, and logs what it measured;
    asked again it measures nothing; calls then price with what was measured, and their
    scales are pooled apart from those learned against priors. (The timers are stand-ins: what
    is tested is who runs them and what is said.)"""
    target, draft, _ = tiny_pair
    monkeypatch.setattr(prices, "matmul_timer", lambda rows, *a: lambda: 1e-3 * (1 + rows / 16))
    monkeypatch.setattr(prices, "forward_seconds", lambda m, b, n, *a, **k: lambda: 1e-3 * n)
    tuner = AutoTuner()
    assert not tuner.prices.prices_known(target, draft, 1)
    prior_key = tuner.prices.timing_key(target, draft, 1)
    log = tuner.measure_prices(target, draft)
    err = capsys.readouterr().err
    assert "config='auto' measures the device's rates" in err and " s: 2 compiles" in err
    assert err.count("measures a model's forwards") == 2
    assert [x["what"].split(" (")[0] for x in log] == [
        "device calibration", "anchors of a 2-layer model", "anchors of a 1-layer model"]
    assert all(x["seconds"] >= 0 for x in log)
    assert tuner.prices.prices_known(target, draft, 1)
    assert tuner.prices.timing_key(target, draft, 1) == prior_key[:-len("|prior")]
    assert tuner.measure_prices(target, draft) == [] and capsys.readouterr().err == ""
    a = oj.generate(target, [[5, 6, 7]], draft=draft, method="speculative", max_new_tokens=4,
                    tuner=tuner).stats["auto"]
    assert any("stored" in m for m in a["measured"]) and a["measured_now"] == []
