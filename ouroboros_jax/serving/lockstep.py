"""The multi-process protocol: every device call runs on every process, in the same order.

Several processes (one model over hosts, `jax.distributed`) run the same program (SPMD).
Process 0 leads: it holds the queue and the scheduler, and before each device call (a prompt
into a slot, a step, a pool read, the end) it broadcasts the host decision as an `Op` record
(`distributed.broadcast`); the other processes follow (`Lockstep.follow`): receive a record,
run the same call, repeat until the "stop" record. An idle leader sends an "idle" record every
`IDLE_HEARTBEAT_S`, so no follower waits in a collective for long. On one process nothing is
broadcast: `lead` runs the call.

A failed collective leaves the processes out of step: no further call is safe, so the
protocol is then broken for good (`broken`) and every later call raises. When a process died,
`broken` is a `liveness.ProcessLost` naming it: the failed collective waits for its beats to
have stopped (about `liveness.HEARTBEAT_TIMEOUT_S`), and on process 0 a
`liveness.Watchdog` notices a death even while no collective runs (or one hangs), marks the
protocol broken and calls `on_lost` (the engine fails its requests).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ..distributed import broadcast, is_leader
from ..liveness import ProcessLost, Watchdog, explain

# seconds an idle multi-process leader lets pass between records: a follower waits for the
# next one inside a collective, and a bounded wait stays clear of whatever timeout a backend's
# collectives have (gloo on CPU waited 200 s here without one)
IDLE_HEARTBEAT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Op:
    """One device call as the leader decided it (plain numbers and a numpy array, so it
    pickles small).

    kind: "insert" (a prompt into a slot: `packed`, `executor.pack_insert`'s array), "step"
    (k rounds on every slot: `level`, an index into the load levels; `greedy`, every busy slot
    greedy; `stop_rows` bool[B], slots freed since the last step; `logprobs`, a busy slot asks
    for logprobs; `rows`, the slots [0, rows) it computes, None: all; `constrained`, a busy
    slot has a response_format), "constraint" (a request's automaton table into its slot's
    region: `packed`, `executor.pack_constraint`'s array), "pool" (gather the phrase
    pool), "save_pool" / "restore_pool" (warmup keeps the pool as it was), "idle" (no device
    call: keeps a follower's wait short) or "stop" (the followers return).
    """

    kind: str
    packed: Optional[np.ndarray] = None
    level: int = 0
    greedy: bool = True
    stop_rows: Optional[np.ndarray] = None
    logprobs: bool = False
    rows: Optional[int] = None
    constrained: bool = False


class Lockstep:
    """Runs device calls (`apply(op)`) on every process in one order; `lock` serializes them
    (each donates the device state)."""

    def __init__(self, apply: Callable[[Op], Any], multi: bool,
                 on_lost: Optional[Callable[[ProcessLost], None]] = None):
        self.apply = apply
        self.multi = multi
        self.lock = threading.Lock()
        self.closed = False  # the followers were sent "stop"
        self.broken: Optional[BaseException] = None  # a device call failed midway
        self.last = time.monotonic()
        self.on_lost = on_lost
        self._watchdog = Watchdog(self._lost) if multi and is_leader() else None

    def _lost(self, err: ProcessLost) -> None:
        """The watchdog's news: a process died. Nothing may wait on it any more."""
        if self.broken is None:
            self.broken = err
        if self.on_lost is not None:
            self.on_lost(self.broken)

    @property
    def running(self) -> bool:
        """False once no more device calls can run (stopped, or a call failed)."""
        return not self.closed and self.broken is None

    def lead(self, op: Op):
        """Runs op's call here; on several processes op is first broadcast, so every follower
        runs the same call."""
        if not self.multi:
            with self.lock:
                return self.apply(op)
        self._check()  # before the lock too: a call stuck in a dead collective may hold it
        with self.lock:
            self._check()
            try:
                broadcast(op)
                self.last = time.monotonic()
                if op.kind == "stop":
                    self.closed = True
                    return None
                return self.apply(op)
            except Exception as e:  # a collective failed midway: no further call is safe
                if self.broken is None:
                    self.broken = explain(e)  # a dead process named, once it is known
                if self.broken is e:
                    raise
                raise self.broken from e

    def _check(self) -> None:
        if self.closed:
            raise RuntimeError("the engine has stopped: its followers have returned")
        if self.broken is not None:
            raise RuntimeError(f"the engine's processes may be out of step after an "
                               f"error: {self.broken}") from self.broken

    def follow(self) -> int:
        """On every process but 0: runs the calls process 0 broadcasts, in its order, until
        its "stop"; returns how many ran. A leader (or another follower) that dies ends the
        wait with `ProcessLost` naming it (once the coordination service has noticed)."""
        n = 0
        while True:
            try:
                op = broadcast(None)
                if op.kind == "stop":
                    self.closed = True
                    return n
                with self.lock:
                    self.apply(op)
            except Exception as e:
                self.broken = explain(e)
                if self.broken is e:
                    raise
                raise self.broken from e
            n += op.kind != "idle"

    def heartbeat(self) -> None:
        """An idle leader's "idle" record, every IDLE_HEARTBEAT_S."""
        if self.multi and self.running and time.monotonic() - self.last > IDLE_HEARTBEAT_S:
            self.lead(Op("idle"))

    def release(self) -> None:
        """The "stop" record, once; not after an error (the followers have failed with it,
        and a collective now might never return)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.multi and self.running:
            self.lead(Op("stop"))
