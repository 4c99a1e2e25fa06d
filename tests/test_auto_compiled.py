"""Compiles priced across processes (ouroboros_jax/auto/compiles.py `CompiledLoops`, switch.py
`Switch.first_runnable`): the store records, per persistent compile-cache directory, which
loops were compiled there and what each compile took; a new process (a fresh tuner over the
same store and cache directory) runs auto's choice where its loop is cached, and otherwise
compiles it only where the call's own predicted saving pays that compile (issue 53: the real
pair's second CLI process compiled gamma 12 for 19 s to save about 5 s). Every output equals
vanilla's."""

import dataclasses
import json

import jax
import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner, default_tuner, warming_up
from ouroboros_jax.auto.compiles import SECTION, cache_dir
from ouroboros_jax.decoding.knobs import recipe_of
from ouroboros_jax.request import pad_prompts

PROMPT = [[5, 6, 7, 8, 9, 10]]
N = 12
WIDTH = pad_prompts(PROMPT)[0].shape[1]  # the prompt bucket the call's signature holds


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A fresh auto store (the suite's compile cache directory stays: conftest's)."""
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path / "store"))
    return tmp_path / "store" / "auto.json"


def scripted(tuner, target, draft, gamma, monkeypatch):
    """The tuner's choice replaced by speculative gamma `gamma`, priced at the tables (priors:
    nothing measured) and agreement its own call_choice gives."""
    real = tuner.call_choice

    def fake(*a, **k):
        c, slots = real(*a, **k)
        cfg = oj.SpeculativeConfig(gamma=gamma)
        return dataclasses.replace(c, method="speculative", config=cfg,
                                   reason=f"scripted gamma {gamma}"), slots

    monkeypatch.setattr(tuner, "call_choice", fake)
    return tuner


def gen(target, draft, tuner):
    return oj.generate(target, PROMPT, draft=draft, method="speculative", max_new_tokens=N,
                       eos_token_id=-1, tuner=tuner)


def test_the_store_records_each_loop_compiled_per_cache_dir(tiny_pair, store, monkeypatch):
    target, draft, _ = tiny_pair
    assert cache_dir() == jax.config.jax_compilation_cache_dir  # (conftest's)
    tuner = scripted(AutoTuner(), target, draft, 2, monkeypatch)
    gen(target, draft, tuner)
    sig = tuner.switch.signature("speculative", target, draft, 1, WIDTH, N, None, True, -1)
    cached = tuner.switch.loops.cached(sig)
    assert list(cached) == [("speculative", repr(oj.SpeculativeConfig(gamma=2)))]
    # under this cache directory, jax's version and the device: another directory holds none
    (key,) = [k for k in tuner.store.read()[SECTION]]
    assert key.startswith(f"{cache_dir()}|jax {jax.__version__}|cpu:")
    old = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(store.parent / "elsewhere"))
        assert AutoTuner().switch.loops.cached(sig) == {}
    finally:
        jax.config.update("jax_compilation_cache_dir", old)


def test_a_new_process_compiles_another_loop_only_where_the_call_pays_it(tiny_pair, store,
                                                                        monkeypatch):
    """Process 1 ran gamma 2 (its loop now in the compile cache). Process 2's auto prefers
    gamma 1 (at the tiny pair's priors, gamma 1 is predicted fastest, 2 next): where the store
    says a compile costs more than the call's predicted saving, it runs gamma 2 and compiles
    nothing; priced cheaper than that saving, it runs gamma 1."""
    target, draft, _ = tiny_pair
    ref = oj.generate(target, PROMPT, max_new_tokens=N, eos_token_id=-1).tokens
    first = gen(target, draft, scripted(AutoTuner(), target, draft, 2, monkeypatch))
    assert first.stats["auto"]["config"] == "SpeculativeConfig(gamma=2)" and first.tokens == ref

    def recorded(seconds):
        data = json.loads(store.read_text())
        for v in data[SECTION].values():
            v["seconds"] = seconds
        store.write_text(json.dumps(data))

    # the compile (recorded as 1000 s) cannot pay: gamma 2, from the cache, nothing compiled
    recorded(1000.0)
    tuner = scripted(AutoTuner(), target, draft, 1, monkeypatch)
    second = gen(target, draft, tuner)
    auto = second.stats["auto"]
    assert auto["config"] == "SpeculativeConfig(gamma=2)", auto["reason"]
    assert "its loop is in the compile cache" in auto["reason"]
    assert "less than its compile, 1000.0 s" in auto["reason"]
    assert auto["compiled"]["programs"] == 0 and second.tokens == ref

    # priced at a microsecond, the compile pays within the call: gamma 1 runs (and compiles)
    recorded(1e-6)
    tuner = scripted(AutoTuner(), target, draft, 1, monkeypatch)
    third = gen(target, draft, tuner)
    assert third.stats["auto"]["config"] == "SpeculativeConfig(gamma=1)"
    assert third.tokens == ref
    # and it is recorded: a later process finds both loops in the cache
    sig = tuner.switch.signature("speculative", target, draft, 1, WIDTH, N, None, True, -1)
    assert {k[1] for k in AutoTuner().switch.loops.cached(sig)} == {
        repr(oj.SpeculativeConfig(gamma=2)), repr(oj.SpeculativeConfig(gamma=1))}


def test_without_a_persistent_cache_nothing_is_recorded_or_kept(tiny_pair, store,
                                                                monkeypatch):
    target, draft, _ = tiny_pair
    old = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert cache_dir() is None
        tuner = scripted(AutoTuner(), target, draft, 2, monkeypatch)
        gen(target, draft, tuner)
        assert SECTION not in tuner.store.read()
    finally:
        jax.config.update("jax_compilation_cache_dir", old)


def scripted_ouroboros(tuner, monkeypatch):
    """The tuner's Ouroboros choice replaced by free drafts at gamma 2 (a loop of its own)."""
    real = tuner.call_choice
    cfg = oj.OuroborosConfig(gamma=2, phrase_drafting=False, lengthening=False,
                             recycling=False, context_phrases=False, free_drafts=True)

    def fake(method, *a, **k):
        c, slots = real(method, *a, **k)
        if method != "ouroboros":
            return c, slots
        return dataclasses.replace(c, method="ouroboros", config=cfg,
                                   reason="scripted free drafts"), slots

    monkeypatch.setattr(tuner, "call_choice", fake)
    return cfg


@pytest.mark.parametrize("pays,borrows", [(False, True), (True, True), (False, False)])
def test_an_ouroboros_first_call_runs_the_speculative_loop_this_process_compiled(
        tiny_pair, store, monkeypatch, pays, borrows):
    """One process: a speculative call compiled gamma 2; the first Ouroboros call of the same
    models and sizes whose auto prefers free drafts (a loop of its own) runs speculative's
    gamma 2 loop, Ouroboros' SD step, compiling nothing, where its predicted saving does not
    pay the compile; where it does, it compiles and runs its own choice, and so it does while
    a bench warms up (`borrows` off: `auto.warming_up`). Without a persistent cache too: the
    process's own calls are what it knows."""
    target, draft, _ = tiny_pair
    ref = oj.generate(target, PROMPT, max_new_tokens=N, eos_token_id=-1).tokens
    old = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.clear_caches()  # (so the speculative call compiles, and its compile is priced)
        tuner = scripted(AutoTuner(), target, draft, 2, monkeypatch)
        free = scripted_ouroboros(tuner, monkeypatch)
        tuner.switch.pays_off = lambda *a: pays
        assert gen(target, draft, tuner).tokens == ref
        tuner.switch.borrows = borrows
        out = oj.generate(target, PROMPT, draft=draft, method="ouroboros", max_new_tokens=N,
                          eos_token_id=-1, tuner=tuner)
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
    auto = out.stats["auto"]
    assert out.tokens == ref
    if pays or not borrows:
        assert auto["config"] == recipe_of(free), auto["reason"]
    else:
        assert auto["method"] == "speculative", (auto["reason"], auto["predicted_speedup"])
        assert auto["config"] == "SpeculativeConfig(gamma=2)", auto["reason"]
        assert "kept" in auto["reason"] and auto["compiled"]["programs"] == 0


def test_a_speculative_first_call_never_runs_an_ouroboros_loop(tiny_pair, store, monkeypatch):
    """The other way round: Ouroboros' free-drafts loop is no loop a speculative call may
    run, so speculative's first call compiles its own choice even where nothing would pay."""
    target, draft, _ = tiny_pair
    tuner = scripted(AutoTuner(), target, draft, 2, monkeypatch)
    free = scripted_ouroboros(tuner, monkeypatch)
    tuner.switch.pays_off = lambda *a: False
    first = oj.generate(target, PROMPT, draft=draft, method="ouroboros", max_new_tokens=N,
                        eos_token_id=-1, tuner=tuner)
    assert first.stats["auto"]["config"] == recipe_of(free)
    out = gen(target, draft, tuner)
    assert out.stats["auto"]["config"] == "SpeculativeConfig(gamma=2)"
    assert out.tokens == first.tokens


def test_warming_up_keeps_the_default_tuners_first_calls_to_their_own_choices():
    switch = default_tuner().switch
    assert switch.borrows
    with warming_up():
        assert not switch.borrows
    assert switch.borrows
