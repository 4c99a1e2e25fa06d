"""Programs built while a tuner lives, counted from jax's monitoring events.

A call whose loop was built measured the compiler (or jax's persistent compilation cache) as
well as the loop, so it teaches auto nothing; and what one compile cost prices a switch of
loops (`switch`). Each `AutoTuner` has a `CompileCounter`; jax's listeners, which cannot be
scoped, are registered once per process when the first counter starts, and dispatch to every
live counter (`COUNTERS`, a registry of weak references: a dropped tuner stops counting).
Nothing is registered at import.

A compile also outlives its process where jax keeps a persistent compilation cache: the
store's "compiled" section (`CompiledLoops`) says which loops are there, and what their
compile took, so a new process can tell a loop it loads from one it would compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from typing import Optional

import jax

from ..decoding import METHODS
from .keys import device_kind

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


# ------------------------------------------------------------------ loops compiled on disk
# The store's section of compiled loops: per persistent compile-cache directory (with jax's
# version and the device, which key jax's cache too), which loops (a call's signature, its
# method and config) some process compiled there, and the backend seconds that took. A new
# process reads it to tell a loop it can load from one it would compile (`switch`).
SECTION = "compiled"


def cache_dir() -> Optional[str]:
    """The persistent compilation cache directory jax reads and writes now, or None (no
    persistent cache: nothing compiled outlives the process)."""
    d = jax.config.jax_compilation_cache_dir
    return d if d and jax.config.jax_enable_compilation_cache else None


def loop_hash(sig: tuple) -> str:
    """A call signature (`switch.Switch.signature`: plain strings, numbers, None, bools),
    hashed stably across processes."""
    return hashlib.sha256(repr(sig).encode()).hexdigest()[:16]


def _config_fields(config) -> Optional[dict]:
    """A config's int and bool fields (what rebuilds it; `choice.Chooser.store_choice` keeps
    choices the same way), None for vanilla's."""
    if config is None:
        return None
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if isinstance(getattr(config, f.name), (int, bool))}


class CompiledLoops:
    """The store's record of loops compiled into persistent compile-cache directories: what
    `record` wrote there, read back by later processes (`cached`, `price`)."""

    def __init__(self, store):
        self.store = store

    def _prefix(self, sig: tuple) -> Optional[str]:
        d = cache_dir()
        if d is None:
            return None
        return f"{d}|jax {jax.__version__}|{device_kind()}|{loop_hash(sig)}|"

    def record(self, sig: tuple, method: str, config, seconds: float) -> None:
        """The loop of (sig, method, config) is in the persistent cache now; it took `seconds`
        of backend compile (0: it came from the cache, or its compile was not seen: an
        earlier record's seconds are kept)."""
        prefix = self._prefix(sig)
        if prefix is None:
            return
        key = prefix + f"{method}|{config!r}"
        old = self.store.read().get(SECTION, {}).get(key)
        if old is not None and (seconds <= 0 or old["seconds"] >= seconds):
            return
        self.store.put(SECTION, key, {"method": method, "config": _config_fields(config),
                                      "seconds": round(float(seconds), 3)})

    def cached(self, sig: tuple) -> dict:
        """{(method, config repr): (config, compile seconds)} of this signature's loops in the
        persistent cache jax uses now ({} without one): configs rebuilt from the store (one
        that no longer builds, or builds another loop, is left out)."""
        prefix = self._prefix(sig)
        if prefix is None:
            return {}
        out = {}
        for key, hit in self.store.read().get(SECTION, {}).items():
            if not key.startswith(prefix):
                continue
            config = None
            if hit["config"] is not None:
                try:
                    config = METHODS[hit["method"]].config_type(**hit["config"])
                except (KeyError, AttributeError, TypeError, ValueError):
                    continue
            if key == prefix + f"{hit['method']}|{config!r}":
                out[(hit["method"], repr(config))] = (config, hit["seconds"])
        return out

    def price(self, sig: tuple) -> float:
        """What compiling one more loop of this signature is priced at: the longest compile
        recorded for its loops (in this cache directory), 0 where none was timed."""
        return max((s for _, s in self.cached(sig).values()), default=0.0)
