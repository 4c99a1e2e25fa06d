"""When `config="auto"` changes its mind: a choice's loop is compiled before a call runs it, so
no call after the first of its kind waits for a compile.

A call's compiled loop is decided by its signature: the models, batch rows, prompt bucket,
generation length, cache limit, sampling mode and logprobs width (`Switch.signature`), and the
method and config auto chose. Auto's choice moves as calls teach it (the agreement a pair
realises, its loops' measured times), and a choice whose loop has not run in this process
would compile inside the call that makes it: on the real Qwen pair that is 15-25 s charged to
a user's second call (issue 28). So, per signature, a `Switch` keeps the choices whose loops
have run, and:

- the first auto call of a signature runs auto's choice (it compiles, as every first call
  does) and nothing else: it used to ask auto again at its end and compile the new choice's
  loop there and then (`settle`), a second compile that a CLI user, whose process ends with
  the answer, paid for nothing (issue 53: the demo pair's first speculative call cost 7.1x
  vanilla's first call);
- a later call whose choice has no compiled loop yet runs the last choice that has one
  (`runnable`) and compiles the new one on a background thread; the first call after that
  thread is done runs it. Only where the switch pays (`pays_off`): the compile takes the
  cores the user's calls run on (an Ouroboros loop of the demo pair compiled in 7.4 s, while
  its calls take 0.3 s), so the calls made so far, taken as the calls still to come, must
  save more than the compile of this signature's first call cost.

A process's first call of a signature starts where the persistent compile cache stands
(`compiles.CompiledLoops`: which loops some process compiled into the cache directory jax uses
now, and what each compile took). Where auto's choice has no loop there but another choice of
this signature has, the choice is compiled in the call only where this call's own predicted
saving pays its compile (`first_runnable`): a CLI `generate` is a one-call user, and on the
real Qwen pair a second process that switched gamma 4 to 12 compiled 19 s inside the call to
save about 5 s of decoding (issue 53). A later call of a long-lived process switches by the
rule above, the compile priced at what the store recorded.

A loop is compiled by running it on the call's own inputs with every row limited to one new
token (`warm` callables built by `generate`): the same shapes, so the same compiled program,
and about one round of work. Nothing here touches the phrase pool a call passes, so
`generate` uses it only for calls without one (and on one process: over several, auto's
choice is broadcast once and kept).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from typing import Callable, Optional

from ..decoding.cost import vanilla_rate
from .choice import predicted_speedup
from .compiles import CompiledLoops, CompileCounter
from .keys import Signatures


def pays_off(calls: int, call_seconds: float, compile_seconds: float, keep: float,
             rival: float) -> bool:
    """Whether switching loops pays: `calls` calls (as many as were made so far are expected
    to follow) of call_seconds each, faster by the predicted rates rival over keep, save at
    least one compile of compile_seconds."""
    return calls * call_seconds * max(0.0, 1.0 - keep / rival) >= compile_seconds


def call_seconds(choice, speedup: float, tokens: int) -> float:
    """A call's predicted decoding seconds: `tokens` new tokens per row at `speedup` over
    vanilla's predicted rate at the prices `choice` was made with (0 where it carries none)."""
    tt = choice.tables[0]
    if tt is None or speedup <= 0:
        return 0.0
    return tokens / vanilla_rate(tt) / speedup


def _key(choice) -> tuple:
    return choice.method, repr(choice.config)


def _rates(last, choice) -> tuple[float, float]:
    """(kept, rival) predicted speedups over vanilla at the prices `choice` was made with (the
    kept one's from when it ran where `choice` carries no tables)."""
    tt, td = choice.tables
    if tt is None:
        return last.predicted_speedup, choice.predicted_speedup
    return (predicted_speedup(last.method, last.config, tt, td, choice.agreement,
                              choice.price_factor), choice.predicted_speedup)


def _kept(last, choice) -> str:
    """What the kept loop is predicted at now: the kept choice's own reason may be an
    exploring first call's ("exploring: no speculative setting is predicted to beat vanilla
    here ..."), which read as if the call ran vanilla."""
    if last.method == "vanilla" or last.config is None:
        return "vanilla"
    return f"predicted {_rates(last, choice)[0]:.2f}x vanilla"


# the methods whose loops an asked method's auto choices may run, besides its own and vanilla's:
# Ouroboros' SD step runs as speculative decoding's loop (`choice.as_run`), so a process that
# ran speculative's loop has one an Ouroboros call of the same models and sizes can run (issue
# 53: the demo pair's first Ouroboros call after a speculative one compiled free drafts' loop
# for 3 s where speculative's was there)
LOOPS_OF = {"ouroboros": ("speculative",)}


def _loop_signatures(sig: tuple) -> list:
    """The signatures whose compiled loops a call of `sig` may run: its own, then those of the
    same models and sizes asked of the methods in LOOPS_OF."""
    return [sig] + [(m,) + sig[1:] for m in LOOPS_OF.get(sig[0], ())]


def _may_run(asked: str, of: str, method: str) -> bool:
    """Whether a loop of run method `method`, recorded under asked method `of`, may serve a
    call asking for `asked`: any of its own signature's; another's only vanilla's and those
    of its LOOPS_OF methods."""
    return of == asked or method == "vanilla" or method in LOOPS_OF.get(asked, ())


class Switch:
    """The compiled choices of one tuner, per signature, and the background compiles it
    started. Thread-safe: calls and background compiles share it."""

    def __init__(self, signatures: Signatures, compiles: CompileCounter,
                 loops: Optional[CompiledLoops] = None):
        self.sig, self.compiles, self.loops = signatures, compiles, loops
        self.pays_off = pays_off  # (tests replace it on an instance)
        # whether a signature's first call may run another method's loop (LOOPS_OF): off
        # while a bench or the demo warms up (`tuner.warming_up`), whose first calls are
        # there to compile what their timed calls will run
        self.borrows = True
        self._lock = threading.Lock()
        self._ran: dict = {}  # signature -> {(method, config repr): choice} whose loops ran
        self._last: dict = {}  # signature -> the last choice run
        self._warming: dict = {}  # (signature, method, config repr) -> thread compiling it
        # signature -> (calls run, of which compiled nothing, their loop seconds, most seconds
        # one call compiled): what a switch of loops would cost and save
        self._calls: dict = {}

    def signature(self, method: str, target, draft, batch: int, prompt_width: int,
                  max_new_tokens: int, max_cache_len, greedy: bool, logprobs: int) -> tuple:
        """The asked method (each has its own choices) and what, besides the config, decides
        which compiled loop a call runs: the models' shapes, dtypes and placement (their
        signatures: two `Model`s of one config share their loops), and the call's sizes and
        modes."""
        return (method, self.sig(target), None if draft is None else self.sig(draft),
                batch, prompt_width, max_new_tokens, max_cache_len, bool(greedy), logprobs)

    def ran(self) -> list:
        """(method, config repr) of every choice whose loop has run, over all signatures."""
        with self._lock:
            return [k for r in self._ran.values() for k in r]

    def _unpaid(self, sig: tuple, last, choice) -> Optional[str]:
        """Why a switch from `last` to `choice` does not pay yet (`pays_off`), or None where it
        does or nothing is known of this signature's calls. The compile is priced at the most
        seconds one of this signature's calls compiled, or, where none compiled, at what the
        store recorded for this signature's loops (its first call loaded one from the
        persistent cache), else at the longest compile the tuner has counted: 0 where
        everything came from the persistent cache unrecorded, and then a switch starts at
        once."""
        calls, timed, seconds, compile_s = self._calls.get(sig, (0, 0, 0.0, 0.0))
        if compile_s <= 0 and self.loops is not None:  # its loop came from the disk cache
            compile_s = self.loops.price(sig)
        if compile_s <= 0:
            compile_s = self.compiles.longest
        if not timed or compile_s <= 0:
            return None
        keep, rival = _rates(last, choice)
        if rival <= 0 or self.pays_off(calls, seconds / timed, compile_s, keep, rival):
            return None
        saved = seconds / timed * max(0.0, 1.0 - keep / rival)
        needed = f"{math.ceil(compile_s / saved)}" if saved > 0 else "never"
        return (f"kept: {choice.config or choice.method} (predicted {rival:.2f}x vanilla "
                f"against {keep:.2f}x) pays its compile ({compile_s:.1f} s) after {needed} "
                f"calls, {calls} so far")

    def runnable(self, sig: tuple, choice, warm: Callable) -> tuple:
        """(the choice to run now, whether it is auto's own): auto's `choice` when its loop has
        run for this signature, or when nothing has (a first call compiles); else the last
        choice run, with `choice`'s loop compiled on a background thread (`warm(choice)`) that
        a later call switches to once it is done, where the switch pays (`pays_off`)."""
        with self._lock:
            ran = self._ran.get(sig)
            if not ran:
                return self.first_runnable(sig, choice)
            if _key(choice) in ran:
                return choice, True
            last = self._last[sig]
            pending = (sig,) + _key(choice)
            unpaid = None if pending in self._warming else self._unpaid(sig, last, choice)
            if unpaid is not None:
                why = f"{_kept(last, choice)} ({unpaid})"
                return dataclasses.replace(last, reason=why, seconds=choice.seconds), False
            if pending not in self._warming:
                # not a daemon: a script that ends while it compiles waits for it (a daemon
                # thread is stopped inside XLA at exit, and the process aborts)
                thread = threading.Thread(target=self._warm_quietly, args=(sig, choice, warm),
                                          name="ouroboros-auto-warm", daemon=False)
                self._warming[pending] = thread
                thread.start()
        why = (f"{_kept(last, choice)}; kept while {choice.config or choice.method} "
               f"({choice.reason.split(' (')[0]}) compiles in the background")
        return dataclasses.replace(last, reason=why, seconds=choice.seconds), False

    def compiled_for(self, sig: tuple) -> dict:
        """{(method, config repr): (config, compile seconds)} of the loops a call of `sig` may
        run without compiling: its own signature's and those of the methods whose loops its
        choices run as (`LOOPS_OF`), from the persistent compile cache and from this process's
        calls (priced at the most one of their calls compiled, else at what the store or the
        counter knows). Lock held by the caller."""
        out: dict = {}
        for s in _loop_signatures(sig) if self.borrows else [sig]:
            if self.loops is not None:
                out.update({k: v for k, v in self.loops.cached(s).items()
                            if _may_run(sig[0], s[0], k[0])})
            ran = self._ran.get(s, {})
            if ran:
                price = self._calls.get(s, (0, 0, 0.0, 0.0))[3]
                if price <= 0 and self.loops is not None:
                    price = self.loops.price(s)
                price = price if price > 0 else self.compiles.longest
                out.update({k: (c.config, max(price, out.get(k, (None, 0.0))[1]))
                            for k, c in ran.items() if _may_run(sig[0], s[0], k[0])})
        return out

    def first_runnable(self, sig: tuple, choice) -> tuple:
        """A process's first call of `sig`: (auto's `choice`, True) where its loop is compiled
        (`compiled_for`: in the persistent compile cache, or run in this process by a call of
        this signature or of one whose loops this one may run), where no other choice's is, or
        where this call's predicted saving over the best compiled choice pays the compile
        (`pays_off` over one call: the caller may make no other); else (that compiled choice,
        False), said in its reason."""
        cached = self.compiled_for(sig)
        compile_s = max((s for _, s in cached.values()), default=0.0)
        if not cached or _key(choice) in cached or compile_s <= 0 or choice.tables[0] is None:
            return choice, True
        tt, td = choice.tables
        speed = {k: predicted_speedup(k[0], cfg, tt, td, choice.agreement, choice.price_factor)
                 for k, (cfg, _) in cached.items()}
        # (at the same prices: an exploring choice's own speedup is the unexplored config's)
        rival = predicted_speedup(choice.method, choice.config, tt, td, choice.agreement,
                                  choice.price_factor)
        best = max(speed, key=speed.get)
        keep = speed[best]
        seconds = call_seconds(choice, keep, sig[5])
        if rival <= 0 or self.pays_off(1, seconds, compile_s, keep, rival):
            return choice, True
        saved = seconds * max(0.0, 1.0 - keep / rival)
        cfg = cached[best][0]
        why = (f"{'vanilla' if cfg is None else f'predicted {keep:.2f}x vanilla'} (kept: its "
               f"loop is in the compile cache; {choice.config or choice.method}, predicted "
               f"{rival:.2f}x, would save {saved:.1f} s of this call's {seconds:.1f} s, less "
               f"than its compile, {compile_s:.1f} s)")
        kept = dataclasses.replace(choice, method=best[0], config=cfg, predicted_speedup=keep,
                                   reason=why)
        return kept, False

    def _warm_quietly(self, sig: tuple, choice, warm: Callable) -> None:
        """warm(choice) on a background thread; its loop counted as run once it returns. A
        failure leaves the choice uncompiled (calls keep the last choice) and says why once."""
        before = self.compiles.seconds
        try:
            warm(choice)
        except Exception as e:  # noqa: BLE001 (reported, and the running choice stays)
            print(f"ouroboros_jax: compiling {choice.config or choice.method} in the background "
                  f"failed ({type(e).__name__}: {e}); config='auto' keeps its last choice",
                  file=sys.stderr)
            return
        with self._lock:
            self._ran.setdefault(sig, {})[_key(choice)] = choice
        if self.loops is not None:  # (the counter may count a call's compile too: a bound)
            self.loops.record(sig, choice.method, choice.config, self.compiles.seconds - before)

    def record(self, sig: tuple, choice, seconds: float = 0.0, compile_s: float = 0.0) -> bool:
        """After a call ran `choice`'s loop in `seconds`, compile_s of them compiling: kept as
        compiled and as the last choice, the call counted (`pays_off`) -> whether it was the
        first auto call of this signature."""
        with self._lock:
            first = sig not in self._ran
            self._ran.setdefault(sig, {})[_key(choice)] = choice
            self._last[sig] = choice
            calls, timed, total, most = self._calls.get(sig, (0, 0, 0.0, 0.0))
            quiet = compile_s <= 0 and seconds > 0  # (0 s: a call not timed, e.g. a cached loop)
            self._calls[sig] = (calls + 1, timed + quiet, total + (seconds if quiet else 0.0),
                                max(most, compile_s))
        if self.loops is not None:  # what a later process finds in the persistent cache
            self.loops.record(sig, choice.method, choice.config, compile_s)
        return first

    def wait_for_background(self, timeout: Optional[float] = None) -> None:
        """Joins every background compile started so far (tests; a benchmark's clean state)."""
        with self._lock:
            threads = list(self._warming.values())
        for t in threads:
            t.join(timeout)


@dataclasses.dataclass
class Switcher:
    """One generate call's side of a `Switch`: `warm(choice)` compiles a choice's loop for this
    call's signature (one round on the call's inputs)."""

    switch: Switch
    sig: tuple
    warm: Callable

    def runnable(self, choice):
        return self.switch.runnable(self.sig, choice, self.warm)[0]

    def after(self, ran, seconds: float = 0.0, compile_s: float = 0.0) -> None:
        """After the call ran `ran` in `seconds` (compile_s of them compiling): recorded, and
        nothing compiled (a change of mind compiles in the background of a later call)."""
        self.switch.record(self.sig, ran, seconds, compile_s)
