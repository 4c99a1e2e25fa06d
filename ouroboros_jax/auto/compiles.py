"""Programs built while a tuner lives, counted from jax's monitoring events.

A call whose loop was built measured the compiler (or jax's persistent compilation cache) as
well as the loop, so it teaches auto nothing; and what one compile cost prices a switch of
loops (`switch`). Each `AutoTuner` has a `CompileCounter`; jax's listeners, which cannot be
scoped, are registered once per process when the first counter starts, and dispatch to every
live counter (`COUNTERS`, a registry of weak references: a dropped tuner stops counting).
Nothing is registered at import.
"""

from __future__ import annotations

import threading
import weakref

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Programs compiled by the backend or read back from the persistent compilation cache
    since this counter started (any thread), and the backend's compile seconds: in all, and
    the longest one."""

    def __init__(self):
        self.programs = 0
        self.seconds = 0.0
        self.longest = 0.0
        COUNTERS.add(self)

    def on_duration(self, name: str, secs: float) -> None:
        if name == COMPILE_EVENT:
            self.programs += 1
            self.seconds += secs
            self.longest = max(self.longest, secs)

    def on_event(self, name: str) -> None:
        if name == CACHE_HIT_EVENT:
            self.programs += 1


class CounterRegistry:
    """The live counters jax's two listeners dispatch to; the listeners are registered with
    jax when the first counter is added (once per process: jax keeps them for good)."""

    def __init__(self):
        self._lock = threading.Lock()  # events arrive from background compiles' threads too
        self._live = weakref.WeakSet()
        self._listening = False

    def add(self, counter: CompileCounter) -> None:
        with self._lock:
            if not self._listening:
                jax.monitoring.register_event_duration_secs_listener(self._on_duration)
                jax.monitoring.register_event_listener(self._on_event)
                self._listening = True
            self._live.add(counter)

    def _counters(self) -> list:
        with self._lock:
            return list(self._live)

    def _on_duration(self, name: str, secs: float, **kw) -> None:
        for c in self._counters():
            c.on_duration(name, secs)

    def _on_event(self, name: str, **kw) -> None:
        for c in self._counters():
            c.on_event(name)


# The process's one registry (a registry, not state of its own: it holds weak references to
# the tuners' counters, and whether jax's listeners are registered yet).
COUNTERS = CounterRegistry()
