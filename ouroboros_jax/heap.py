"""The Python heap frozen after warm-up, so the cyclic garbage collector's full passes stop
walking it.

A process that has imported JAX, Flax and transformers and loaded a model holds about 420,000
objects the cyclic collector tracks; a full collection walks every one of them (0.28 s with
the demo pair loaded, 2-core CPU) and Python starts one whenever enough new objects have
survived since the last. On the demo pair a `generate` call takes about 0.3 s, so a full pass
that falls inside one doubles it: with the collector on, auto_check saw 15 calls over 1.4x
their row's median, against 3 with it off. `gc.freeze()` moves every object alive now into a
permanent generation that collections skip, leaving them only the objects made since.

Frozen objects are never freed as cycles, so this is for what lives as long as the process
(modules, models, compiled programs). The project's own programs do it: the server after its
warm-up, the demo and the benches after their first calls. `generate` never does it for its
caller; a script that calls it in a loop on a small model can call `freeze_heap()` itself.

What `generate` and the loaders do instead is `gc_paused()`: no collection starts inside them.
A first call traces, lowers and compiles its loop, which leaves many new objects alive (jax's
caches of jaxprs and lowerings), enough to set off a full pass: the demo pair's first
speculative call spent 0.24 s of its 3.6 s in one (`gc.callbacks`), its first vanilla call,
which makes fewer, none. Paused, the objects are counted as usual and the collector runs at
its next chance after the pause, on the young generations its counts ask for.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_PAUSES = {"count": 0}  # pauses open now (loads on threads, a generate call inside a load)
_LOCK = threading.Lock()


def freeze_heap() -> int:
    """Collects what is garbage now, then freezes every object still alive; returns how many
    objects are frozen in all (`gc.get_freeze_count()`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off while the block runs, on again when the last of the
    blocks open at once (loads on several threads) ends; a caller who had it off keeps it
    off. For work that makes many objects and whose collections would walk the whole heap:
    a GGUF load (4% of the real 1.5B target's, perf), a call's trace and compile."""
    with _LOCK:
        _PAUSES["count"] += 1
        if _PAUSES["count"] == 1:
            _PAUSES["was_on"] = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _LOCK:
            _PAUSES["count"] -= 1
            if _PAUSES["count"] == 0 and _PAUSES.pop("was_on", False):
                gc.enable()
