"""`AutoTuner`: config="auto" as one object, holding what it measured, learned and chose.

A tuner is its parts, one job each: the disk store it reads and writes (`store.Store`), the
models' signatures it keys by (`keys.Signatures`), the compiles it counts (`compiles`), the
prices (`prices.Prices`), the pairs' agreement (`agreement.Agreement`), the choices
(`choice.Chooser`) and the compiled loops a change of mind switches between
(`switch.Switch`); and the three things a `generate` call asks of them (`call_choice` before
the call's loop, `after_auto` and `learn_*` after it).

`generate` uses the process's default tuner (`default_tuner()`, made on first use) unless a
call passes its own; the serving engine builds and owns one; a test makes a fresh one, which
starts as a new process over the same store does. Two tuners share only the store on disk.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

from ..decoding import METHODS
from ..distributed import is_leader
from ..request import cache_slots
from .agreement import DEFAULT_AGREEMENT, Agreement
from .choice import Choice, Chooser
from .compiles import CompiledLoops, CompileCounter
from .keys import Signatures
from .prices import Prices
from .store import Store
from .switch import Switch


class AutoTuner:
    """config="auto"'s state, one object per owner: what it measured, learned and chose, and
    the loops it compiled.

    Attributes:
        store: the disk store as this tuner read it (`store.Store`).
        signatures: model signatures, remembered per embedding array (`keys.Signatures`).
        compiles: programs compiled while this tuner lives (`compiles.CompileCounter`).
        prices: calibration, anchors, learned scales (`prices.Prices`).
        agreement: the pairs' agreement (`agreement.Agreement`).
        chooser: the choices made and kept (`choice.Chooser`).
        switch: compiled choices and background compiles (`switch.Switch`).
    """

    def __init__(self):
        self.store = Store()
        self.signatures = Signatures()
        self.compiles = CompileCounter()
        self.prices = Prices(self.store, self.signatures)
        self.agreement = Agreement(self.store, self.signatures)
        self.chooser = Chooser(self.store, self.signatures, self.prices, self.agreement)
        self.switch = Switch(self.signatures, self.compiles, CompiledLoops(self.store))

    def auto_config(self, method: str, target, draft, prompt, plens, slots: int,
                    **kw) -> Choice:
        """The config `method` runs for these models, prompts [B,P] (lengths plens[B]) and
        cache slots: `choice.Chooser.auto_config` (its keywords: use_cache, pool_shape,
        explore_depth, switch_gain, timed)."""
        return self.chooser.auto_config(method, target, draft, prompt, plens, slots, **kw)

    # ---------------------------------------------------------------------- a generate call
    def call_choice(self, method: str, target, draft, prompt_j, plens_j, max_new_tokens: int,
                    max_cache_len, pool, greedy: bool) -> tuple[Choice, int]:
        """A `generate` call's choice -> (Choice, the cache slots it sized for), made from what
        the store holds and priors for what it lacks: nothing is measured and nothing compiled
        for it (`Chooser.current`). A pool passed in keeps its shape: auto chooses among the
        configs it can serve. A greedy call teaches auto the pair's agreement, so it may draft
        deeper once (`Chooser.explore`)."""
        shape = (None if pool is None or not hasattr(pool, "phrase_len")
                 else (int(pool.guesses), int(pool.phrase_len)))
        slots = cache_slots(prompt_j.shape[1], max_new_tokens, 0, max_cache_len)
        return self.auto_config(method, target, draft, prompt_j, plens_j, slots,
                                pool_shape=shape, explore_depth=greedy, timed=True), slots

    def measure_prices(self, target, draft=None, batch: int = 1, slots: int = 256) -> list:
        """Calibrates this device and times the models' anchors now, where the store lacks
        them (`Prices.base_tables` with probe): for a process that lives on (a server, a
        notebook, a bench) that wants measured prices before its calls; a `generate` call
        never does this itself. Says so on stderr first, with an estimate of the seconds
        -> [{"what", "seconds"}] of what was measured ([] when the store had it all)."""
        log: list = []
        self.prices.base_tables(target, draft, batch, slots, True, probe=True, log=log)
        return log

    def after_auto(self, choice: Choice, switch, target, draft, stats: dict, seconds: float,
                   B: int, P: int, auto_slots: int, learn: bool, compiled_s: float) -> None:
        """After an auto call: its loop's time against its counted forwards' price kept, what
        the next choice is priced with (learn: not from a call whose loop compiled, whose time
        is the compiler's); the choice recorded as run (`switch`: the call's
        `switch.Switcher`, or None), with the call's loop seconds and the seconds compiled
        since `compiled_s` (`compiles.seconds` before the loop): what a switch of loops would
        cost and save."""
        if learn:
            self.prices.record_call(choice.method, choice.config, target, draft, stats, seconds,
                                    B, P, auto_slots, choice.agreement)
        if switch is not None:  # (a loop read from the persistent cache: not a timed call)
            switch.after(choice, seconds if learn else 0.0, self.compiles.seconds - compiled_s)

    def learn_prices(self, method, cfg, target, draft, stats: dict, seconds: float, B: int,
                     P: int, slots: int) -> None:
        """A call with an explicit config that compiled nothing teaches auto its loop's prices
        as an auto call does (`Prices.record_call`): calls of other configs tell the draft's
        share of a round from the target's, which calls of one config cannot. Only where
        the store's prices, priors where it has none (`Prices.timing_key` keeps the two
        apart): such a call never measures anything."""
        spec = METHODS.get(method) if isinstance(method, str) else None
        if spec is None or spec.round_model is None:  # (vanilla: its auto calls teach it)
            return
        used = draft if spec.needs_draft else None
        a = self.agreement.known_agreement(target, used) if used is not None else None
        a = DEFAULT_AGREEMENT if a is None else a
        self.prices.record_call(method, cfg, target, used, stats, seconds, B, P, slots, a)

    def learn_realised(self, spec, cfg, stats: dict, greedy: bool, target, draft) -> None:
        """The agreement a call realised (a method without a draft: its own rate, e.g. prompt
        lookup's copy hit rate), stored: what the next "auto" plans with (process 0 keeps the
        shared store, so N processes do not count one call N times)."""
        used = draft if spec.needs_draft else None  # (a method that needs one has it)
        learned = spec.learn(cfg, stats, greedy) if spec.learn is not None else None
        if learned is not None and is_leader():
            name = next(m for m, s in METHODS.items() if s is spec)
            self.agreement.record_realised(target, used, *learned, method=name)
        if greedy and used is not None and "free_offered" in stats and is_leader():
            # Ouroboros' free drafts: what its proposals kept, by match (`cost.FreeProfile`)
            self.agreement.record_free(target, used, stats["free_offered"],
                                       stats["free_would_accept"])


class DefaultTuner:
    """The process's default tuner, made on first use (not at import: a tuner's compile
    counter registers jax's listeners); one lock, so concurrent first calls share it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tuner: Optional[AutoTuner] = None

    def get(self) -> AutoTuner:
        with self._lock:
            if self._tuner is None:
                self._tuner = AutoTuner()
            return self._tuner


# The one documented default (a registry of one tuner): what `generate` uses unless a call
# passes its own.
DEFAULT = DefaultTuner()


def default_tuner() -> AutoTuner:
    """The tuner `generate` uses when a call passes none: one per process, made on first use,
    so what one call measured and chose serves the next."""
    return DEFAULT.get()


def wait_for_background(timeout: Optional[float] = None) -> None:
    """Joins the default tuner's background compiles (a benchmark's clean state)."""
    default_tuner().switch.wait_for_background(timeout)


@contextlib.contextmanager
def warming_up():
    """Within: the default tuner's first call of a signature runs auto's own choice of the
    asked method, never a loop another method compiled (`switch.LOOPS_OF`): a bench's or the
    demo's warm-up calls, whose purpose is to compile what their timed calls will run, as a
    process running only that method would."""
    switch = default_tuner().switch
    old, switch.borrows = switch.borrows, False
    try:
        yield
    finally:
        switch.borrows = old
