"""The multi-process protocol: every device call runs on every process, in the same order.

Several processes (one model over hosts, `jax.distributed`) run the same program (SPMD).
Process 0 leads: it holds the queue and the scheduler, and before each device call (a prompt
into a slot, a step, a pool read, the end) it broadcasts the host decision as an `Op` record
(`distributed.broadcast`); the other processes follow (`Lockstep.follow`): receive a record,
run the same call, repeat until the "stop" record. An idle leader sends an "idle" record every
`IDLE_HEARTBEAT_S`, so no follower waits in a collective for long. On one process nothing is
broadcast: `lead` runs the call.

A failed collective leaves the processes out of step: no further call is safe, so the
protocol is then broken for good (`broken`) and every later call raises.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from ..distributed import broadcast

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
    for logprobs), "pool" (gather the phrase
    pool), "save_pool" / "restore_pool" (warmup keeps the pool as it was), "idle" (no device
    call: keeps a follower's wait short) or "stop" (the followers return).
    """

    kind: str
    packed: Optional[np.ndarray] = None
    level: int = 0
    greedy: bool = True
    stop_rows: Optional[np.ndarray] = None
    logprobs: bool = False


class Lockstep:
    """Runs device calls (`apply(op)`) on every process in one order; `lock` serializes them
    (each donates the device state)."""

    def __init__(self, apply: Callable[[Op], Any], multi: bool):
        self.apply = apply
        self.multi = multi
        self.lock = threading.Lock()
        self.closed = False  # the followers were sent "stop"
        self.broken: Optional[BaseException] = None  # a device call failed midway
        self.last = time.monotonic()

    @property
    def running(self) -> bool:
        """False once no more device calls can run (stopped, or a call failed)."""
        return not self.closed and self.broken is None

    def lead(self, op: Op):
        """Runs op's call here; on several processes op is first broadcast, so every follower
        runs the same call."""
        with self.lock:
            if not self.multi:
                return self.apply(op)
            if self.closed:
                raise RuntimeError("the engine has stopped: its followers have returned")
            if self.broken is not None:
                raise RuntimeError(f"the engine's processes may be out of step after an "
                                   f"error: {self.broken!r}") from self.broken
            try:
                broadcast(op)
                self.last = time.monotonic()
                if op.kind == "stop":
                    self.closed = True
                    return None
                return self.apply(op)
            except Exception as e:  # a collective failed midway: no further call is safe
                self.broken = e
                raise

    def follow(self) -> int:
        """On every process but 0: runs the calls process 0 broadcasts, in its order, until
        its "stop"; returns how many ran. A leader that dies ends the wait with an error
        (jax.distributed notices the lost peer)."""
        n = 0
        while True:
            op = broadcast(None)
            if op.kind == "stop":
                self.closed = True
                return n
            with self.lock:
                self.apply(op)
            n += op.kind != "idle"

    def heartbeat(self) -> None:
        """An idle leader's "idle" record, every IDLE_HEARTBEAT_S."""
        if self.multi and self.running and time.monotonic() - self.last > IDLE_HEARTBEAT_S:
            self.lead(Op("idle"))

    def release(self) -> None:
        """The "stop" record, once; not after an error (the followers have failed with it,
        and a collective now might never return)."""
        if self.multi and self.running:
            self.lead(Op("stop"))
