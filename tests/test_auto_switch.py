"""When config="auto" changes its mind (ouroboros_jax/auto/switch.py): no call after a
signature's first compiles its loop, and a first call compiles its own loop only (issue 53: it
used to compile auto's new choice at its end, a second compile a one-call user paid for
nothing); a later change runs the last compiled choice while the new loop compiles on a
background thread.
Auto's choices are scripted here (the tuner's `call_choice` replaced), so each step is known;
compiles are counted from jax's monitoring events (the tuner's `compiles`), and every output
equals vanilla's."""

import dataclasses

import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner
from ouroboros_jax.auto.choice import Choice


def choice(gamma):
    return Choice(method="speculative", config=oj.SpeculativeConfig(gamma=gamma),
                  predicted_speedup=1.5, agreement=0.5, reason=f"scripted gamma {gamma}")


@pytest.fixture
def scripted(monkeypatch):
    """Auto's answers, in order (the last repeats); the log of the choices asked for; the
    fresh tuner that answers them."""
    answers, asked = [], []

    def fake(method, target, draft, prompt_j, plens_j, max_new_tokens, max_cache_len, pool,
             greedy):
        asked.append(answers[0] if len(answers) == 1 else answers.pop(0))
        return asked[-1], 64

    tuner = AutoTuner()
    monkeypatch.setattr(tuner, "call_choice", fake)
    yield answers, asked, tuner
    tuner.switch.wait_for_background()


def test_a_changed_mind_never_compiles_inside_a_later_call(tiny_pair, scripted):
    target, draft, _ = tiny_pair
    answers, asked, tuner = scripted
    # every switch pays at once here (when one pays: the test after this one)
    tuner.switch.pays_off = lambda *a: True
    prompt = [[5, 6, 7, 8, 9, 10]]
    kw = dict(draft=draft, method="speculative", max_new_tokens=12, eos_token_id=-1,
              tuner=tuner)
    ref = oj.generate(target, prompt, max_new_tokens=12, eos_token_id=-1).tokens

    # call 1 runs gamma 2 and builds its own loop only: auto is asked once, not again at its
    # end, and nothing compiles behind it
    answers[:] = [choice(2)]
    before = tuner.compiles.programs
    first = oj.generate(target, prompt, **kw)
    assert first.stats["auto"]["config"] == "SpeculativeConfig(gamma=2)"
    assert [c.config.gamma for c in asked] == [2] and first.tokens == ref
    assert first.stats["auto"]["compiled"]["programs"] == tuner.compiles.programs - before
    assert len(tuner.switch.ran()) == 1  # one loop compiled: gamma 2's

    # what call 1 taught makes auto prefer gamma 3: call 2 runs gamma 2 without compiling
    # while gamma 3 compiles in the background; call 3 runs gamma 3, compiling nothing
    answers[:] = [choice(3)]
    before = tuner.compiles.programs
    second = oj.generate(target, prompt, **kw)
    assert second.stats["auto"]["config"] == "SpeculativeConfig(gamma=2)"
    assert "compiles in the background" in second.stats["auto"]["reason"]
    assert second.stats["auto"]["compiled"]["programs"] == 0 and second.tokens == ref
    tuner.switch.wait_for_background()
    before = tuner.compiles.programs
    third = oj.generate(target, prompt, **kw)
    assert tuner.compiles.programs == before
    assert third.stats["auto"]["config"] == "SpeculativeConfig(gamma=3)"
    assert third.tokens == ref

    # auto now prefers gamma 5, never compiled: call 4 runs gamma 3 while gamma 5 compiles in
    # the background, and says so
    answers[:] = [choice(5)]
    fourth = oj.generate(target, prompt, **kw)
    assert fourth.stats["auto"]["config"] == "SpeculativeConfig(gamma=3)"
    assert "compiles in the background" in fourth.stats["auto"]["reason"]
    assert fourth.tokens == ref
    tuner.switch.wait_for_background()

    # the background compile done, call 5 runs gamma 5 without compiling
    before = tuner.compiles.programs
    fifth = oj.generate(target, prompt, **kw)
    assert tuner.compiles.programs == before
    assert fifth.stats["auto"]["config"] == "SpeculativeConfig(gamma=5)"
    assert fifth.tokens == ref


def test_a_switch_waits_until_the_calls_so_far_would_pay_its_compile(monkeypatch, tmp_path):
    """A later call's switch compiles only once the calls made so far (taken as the calls to
    come) would save the compile's seconds: here a first call that compiled for 2 s, later
    calls of 0.3 s, and a rival predicted 1.40x vanilla against 1.30x, which saves
    0.3 * (1 - 1.30 / 1.40) = 0.0214 s a call: 93 calls do not pay, 94 do."""
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path / "store"))
    switch = AutoTuner().switch
    sig = ("p",)
    last, rival = choice(1), choice(4)
    last.predicted_speedup, rival.predicted_speedup = 1.30, 1.40
    warmed = []
    switch.record(sig, last, 3.0, 2.0)  # the signature's first call: it compiled 2 s
    for _ in range(92):
        switch.record(sig, last, 0.3, 0.0)
    ran, own = switch.runnable(sig, rival, warmed.append)
    assert not own and ran.config.gamma == 1 and "pays its compile (2.0 s) after 94 calls, 93 so far" in ran.reason
    # said as what the kept loop is predicted at now, not as the kept choice's own reason (an
    # exploring first call's read "exploring: no speculative setting is predicted to beat
    # vanilla here" on calls that ran gamma 10)
    assert ran.reason.startswith("predicted 1.30x vanilla (kept: ") and "scripted" not in ran.reason
    switch.wait_for_background()
    assert not warmed  # nothing compiles
    switch.record(sig, last, 0.3, 0.0)  # call 94
    ran, own = switch.runnable(sig, rival, warmed.append)
    assert not own and ran.config.gamma == 1 and "compiles in the background" in ran.reason
    switch.wait_for_background()
    assert warmed == [rival]
    ran, own = switch.runnable(sig, rival, warmed.append)
    assert own and ran.config.gamma == 4
    # a signature whose first call compiled nothing (its loop built by another's call) prices
    # a switch at the longest compile the tuner counted
    switch = AutoTuner().switch
    switch.compiles.seconds, switch.compiles.longest = 9.0, 2.0
    switch.record(sig, last, 0.3, 0.0)
    ran, own = switch.runnable(sig, rival, warmed.append)
    assert "pays its compile (2.0 s) after 94 calls, 1 so far" in ran.reason
    # one that compiled nothing in this process (all from the persistent cache) prices it at
    # the compile the store recorded for the signature's loops (the first tuner's 2 s)
    switch.compiles.seconds = switch.compiles.longest = 0.0
    ran, own = switch.runnable(sig, rival, warmed.append)
    assert "pays its compile (2.0 s) after 94 calls, 1 so far" in ran.reason
    # and where the store recorded nothing either, a switch starts at once
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path / "other"))
    switch = AutoTuner().switch
    switch.record(sig, last, 0.3, 0.0)
    ran, own = switch.runnable(sig, rival, warmed.append)
    assert "compiles in the background" in ran.reason
    switch.wait_for_background()


def test_the_signature_follows_what_decides_the_loop(tiny_pair):
    target, draft, _ = tiny_pair
    switch = AutoTuner().switch
    sig = switch.signature("speculative", target, draft, 1, 16, 32, None, True, -1)
    # another Model object of the same shapes shares the compiled loops
    assert switch.signature("speculative", dataclasses.replace(target), draft, 1, 16, 32,
                            None, True, -1) == sig
    # each asked method keeps its own choices
    assert switch.signature("ouroboros", target, draft, 1, 16, 32, None, True, -1) != sig
    for changed in [(2, 16, 32, None, True, -1), (1, 32, 32, None, True, -1),
                    (1, 16, 64, None, True, -1), (1, 16, 32, 256, True, -1),
                    (1, 16, 32, None, False, -1), (1, 16, 32, None, True, 5)]:
        assert switch.signature("speculative", target, draft, *changed) != sig


def test_a_failed_background_compile_keeps_the_last_choice(capsys):
    switch = AutoTuner().switch
    switch.pays_off = lambda *a: True
    sig = ("s",)
    switch.record(sig, choice(2))

    def broken(c):
        raise RuntimeError("no memory")

    ran, own = switch.runnable(sig, choice(4), broken)
    assert not own and ran.config.gamma == 2
    switch.wait_for_background()
    assert "compiling SpeculativeConfig(gamma=4" in capsys.readouterr().err
    ran, own = switch.runnable(sig, choice(4), broken)
    assert ran.config.gamma == 2  # still not compiled: still the last choice


EXIT_SCRIPT = """
import atexit
import sys
import ouroboros_jax as oj
from ouroboros_jax.auto import Choice, default_tuner
from ouroboros_jax.decoding.speculative import SpeculativeConfig

target, draft = oj.load_model(sys.argv[1]), oj.load_model(sys.argv[2])
answers = [2, 5]
tuner = default_tuner()  # what generate uses without a tuner of its own
tuner.call_choice = lambda *a, **k: (Choice("speculative", SpeculativeConfig(
    gamma=answers.pop(0)), 1.5, 0.7, "scripted"), 64)
tuner.switch.pays_off = lambda *a: True  # the switch pays at once (when one does: tested apart)
kw = dict(draft=draft, method="speculative", max_new_tokens=12, eos_token_id=-1)
oj.generate(target, [[5, 6, 7, 8]], **kw)  # gamma 2
out = oj.generate(target, [[5, 6, 7, 8]], **kw)  # gamma 5 starts compiling in the background
print(out.stats["auto"]["reason"])


def done():  # atexit runs after the interpreter has joined its non-daemon threads
    ran = tuner.switch.ran()
    print("gamma 5 compiled at exit:", ("speculative", "SpeculativeConfig(gamma=5, confidence=0.0)") in ran)


atexit.register(done)
"""


def test_a_script_that_ends_while_a_compile_runs_exits_cleanly(tiny_pair, tmp_path):
    """The process ends right after a call that started a background compile: it waits for
    the compile and exits 0 (a daemon thread stopped inside XLA aborts the process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    target, draft, _ = tiny_pair
    script = tmp_path / "ends.py"
    script.write_text(EXIT_SCRIPT)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    r = subprocess.run([sys.executable, str(script), target.path, draft.path],
                       capture_output=True, text=True, timeout=600, env=env)
    assert "compiles in the background" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gamma 5 compiled at exit: True" in r.stdout, r.stdout
    assert "terminate called" not in r.stderr
