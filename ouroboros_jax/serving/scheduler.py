"""Which requests run: the waiting queue, the slots, and the load level each step runs at.

Admission is first come, first served: a waiting request takes the lowest free slot at the
start of a step (`admit`); a request cancelled while waiting leaves the queue, one cancelled
while running frees its slot (`reap`). A slot freed by the host (a stop string, a cancel)
before the device has ended its row is flagged in `stop_rows`, which the next step sends, so
the row ends there.

Speculation fitted to the load: `levels` maps busy-slot counts to configs, e.g.
[(1, OuroborosConfig(...)), (4, OFF)]; the level with the largest threshold <= busy slots runs
(`level`). "off" runs the method's plain round. config="auto" asks the engine's
`auto.AutoTuner` once per load level (1, 2, 4, .. slots); levels must share a state layout
(`MethodSpec.family`).

Each step computes only the slots up to the highest busy one, rounded up to a row bucket
(`row_buckets`): with lowest-free-slot admission, one request runs a one-row step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from ..decoding import PLAIN
from ..request import cache_slots, is_int
from .executor import OFF
from .handle import QueueFull
from .row_buckets import rows_for


# ---------------------------------------------------------------------------- load levels
def _one_config(method: str, spec, c):
    if c is None:
        return spec.default_config()
    if not isinstance(c, spec.config_type):
        raise ValueError(f"config for method={method!r} must be a "
                         f"{spec.config_type.__name__}, 'auto', None, or a load-level map, "
                         f"got {c!r}")
    return c


def load_levels(method: str, spec, config, auto_levels) -> list:
    """[(busy slots threshold, config or OFF)], thresholds ascending from 1. A method without
    knobs has one level; config="auto" calls auto_levels()."""
    if spec.knobs is None:
        return [(1, None)]
    if isinstance(config, str) and config == "auto":
        return auto_levels()
    if isinstance(config, dict):
        if not config or not all(is_int(k) and k >= 1 for k in config):
            raise ValueError("config: a load-level map needs integer keys >= 1 (busy slots)"
                             f", got {sorted(config, key=str)}")
        if 1 not in config:
            raise ValueError("config: a load-level map needs a level for 1 busy slot")
        return [(n, OFF if isinstance(config[n], str) and config[n] in (OFF, PLAIN)
                 else _one_config(method, spec, config[n])) for n in sorted(config)]
    return [(1, _one_config(method, spec, config))]


def auto_levels(tuner, method: str, spec, target, draft, slots: int, limit: int) -> list:
    """The tuner's choice (`auto.AutoTuner.auto_config`) per load level: batches of 1, 2, 4,
    .. slots. A level whose choice has another state layout than the first speculative one
    reuses that one."""
    V = target.config.vocab_size
    probe = [(7 * i + 3) % V for i in range(32)]
    out, first, n = [], None, 1
    while True:
        prompt = jnp.asarray([probe] * n, jnp.int32)
        plens = jnp.full((n,), len(probe), jnp.int32)
        ch = tuner.auto_config(method, target, draft, prompt, plens,
                               cache_slots(0, 0, 0, limit), keep_method=True)
        c = OFF if ch.config is None or ch.method != method else ch.config
        if c is not OFF:
            if first is None:
                first = c
            elif spec.family is not None and spec.family(c) != spec.family(first):
                c = first
        out.append((n, c))
        if n >= slots:
            return out
        n = min(2 * n, slots)


def check_family(method: str, spec, cfgs: list) -> None:
    """The load levels' configs must share a state layout (the engine switches between them
    from one step to the next)."""
    if spec.family is not None and len({spec.family(c) for c in cfgs}) > 1:
        raise ValueError(f"config: the load levels' configs must share {method}'s state "
                         f"layout (window, ngram, guesses, ...), got {cfgs}")


# ---------------------------------------------------------------------------- the scheduler
@dataclasses.dataclass
class Plan:
    """One step as the scheduler decided it: the busy slots and their handles, the load level
    (an index into levels), whether every busy slot is greedy, the slots to end, whether a
    busy slot asks for logprobs, and the rows the step computes (slots [0, rows)), whether a
    busy slot has a response_format (the step applies the automata)."""

    busy: list
    handles: list
    level: int
    greedy: bool
    stop_rows: np.ndarray
    logprobs: bool = False
    rows: Optional[int] = None
    constrained: bool = False


class Scheduler:
    """The waiting queue and the slots (the caller holds the engine's lock). row_sizes: the
    row buckets steps compile for (`row_buckets.buckets`; None: every step runs all slots)."""

    def __init__(self, slots: int, max_queue: int, levels: list,
                 row_sizes: Optional[tuple] = None):
        self.slots, self.max_queue, self.levels = slots, max_queue, levels
        self.row_sizes = row_sizes
        self.waiting: collections.deque = collections.deque()
        self.running: list = [None] * slots
        self.stop_rows = np.zeros((slots,), bool)

    def enqueue(self, h) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting "
                            f"(max_queue={self.max_queue})")
        self.waiting.append(h)

    @property
    def idle(self) -> bool:
        return not self.waiting and all(h is None for h in self.running)

    @property
    def busy(self) -> list:
        return [i for i, h in enumerate(self.running) if h is not None]

    def reap(self) -> list:
        """The cancelled requests, out of the queue and their slots: the caller finishes
        them."""
        gone = [h for h in self.waiting if h.cancelled]
        for h in gone:
            self.waiting.remove(h)
        for i, h in enumerate(self.running):
            if h is not None and h.cancelled:
                gone.append(h)
                self.free(i)
        return gone

    def admit(self) -> list:
        """Waiting requests into free slots, first come first served -> [(slot, handle)]."""
        out = []
        for i in range(self.slots):
            if self.running[i] is None and self.waiting:
                self.running[i] = self.waiting.popleft()
                self.stop_rows[i] = False  # the insert restarts the row
                out.append((i, self.running[i]))
        return out

    def free(self, slot: int, device_done: bool = False) -> None:
        """The slot's request has ended; a row the device has not ended ends next step."""
        self.running[slot] = None
        if not device_done:
            self.stop_rows[slot] = True

    def level(self, busy: int) -> int:
        """The load level that runs with `busy` slots busy: an index into levels."""
        return max(i for i, (n, _) in enumerate(self.levels) if n <= busy)

    def plan(self) -> Optional[Plan]:
        """The next step (None: no slot busy); takes the stop flags it sends."""
        busy = self.busy
        if not busy:
            return None
        handles = [self.running[i] for i in busy]
        plan = Plan(busy, handles, self.level(len(busy)),
                    all(h.params.temperature == 0 for h in handles), self.stop_rows.copy(),
                    any(h.params.logprobs is not None for h in handles),
                    None if self.row_sizes is None else rows_for(busy, self.row_sizes),
                    any(h.request.table is not None for h in handles))
        self.stop_rows[:] = False
        return plan
