"""Which processes of a multi-process run are still alive, and what to do when one dies.

`jax.distributed` runs a coordination service in process 0; every process's client sends it
heartbeats. A process silent for the heartbeat timeout is declared dead, and by default the
service then tells every other process, whose runtime aborts it (SIGABRT, exit status 134), at
once or at exit: the survivors get no chance to fail their requests or to say which process
died. `distributed.initialize` (through `initialize_kwargs`) turns on JAX's recoverable mode
instead (`jax_enable_recoverability`): a dead process is then only dropped.

Which process died is read from beats of our own: each process writes a counter to the
service's key-value store every `BEAT_S` seconds (`start_beating`, with its host name and pid
once, by which the others name it). A process whose counter has not moved for
`HEARTBEAT_TIMEOUT_S` seconds, as this process's clock sees it, is dead (`lost`). (JAX's own
`get_live_nodes` would tell as much, but it blocks until every live process asks too.) So:

- a collective whose peer died fails at once on CPU (gloo: "connection closed by peer"); the
  lockstep then waits up to `HEARTBEAT_TIMEOUT_S + MARGIN_S` for `lost` to name the dead
  process (`explain`) and raises `ProcessLost` naming it;
- a death while no collective runs (or a collective that would hang on it) is noticed by the
  `Watchdog` on process 0, which polls `lost` every `POLL_S` seconds.

Detection takes about `HEARTBEAT_TIMEOUT_S` (10 s) after the death, plus a second. Without
`distributed.initialize` (`jax.distributed.initialize` called directly) nothing here is on:
`lost` says nothing and JAX's default behaviour stays.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref
from typing import Callable, Optional

import jax

HEARTBEAT_TIMEOUT_S = 10  # seconds without beats before a process counts as dead
BEAT_S = 1.0  # how often each process beats
MARGIN_S = 5.0  # past the timeout, in `explain`
POLL_S = 1.0  # the watchdog's period
EXIT_WAIT_S = 30.0  # the most one process waits at exit for the others
_WHERE, _BEAT = "ouroboros_jax/process/{}", "ouroboros_jax/beat/{}"
_state = {"beater": None}  # this process's beating thread, once started
_seen: dict[int, tuple[Optional[str], float]] = {}  # process -> (last beat, when it changed)
_seen_lock = threading.Lock()
_watchdogs: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()  # running ones, stopped at exit


class ProcessLost(RuntimeError):
    """Processes of a multi-process run died (or stopped answering): every later device call
    would wait for them, so the engine over them has stopped for good."""

    def __init__(self, processes: list[int], cause: Optional[BaseException] = None):
        self.processes = list(processes)
        names = ", ".join(describe(i) for i in self.processes)
        seen = f" (the failed call: {cause})" if cause is not None else ""
        super().__init__(f"{names} of {jax.process_count()} died or stopped answering: no "
                         f"beat for {HEARTBEAT_TIMEOUT_S} s{seen}")


def initialize_kwargs(heartbeat_timeout: int) -> dict:
    """What `jax.distributed.initialize` needs for the above: recoverable mode on (set before
    the service starts). heartbeat_timeout is ours (`lost`); JAX's own stays its default, as
    nothing here waits for it, and a shorter one makes its client abort sooner on a slow
    network."""
    global HEARTBEAT_TIMEOUT_S
    HEARTBEAT_TIMEOUT_S = int(heartbeat_timeout)
    jax.config.update("jax_enable_recoverability", True)
    return {}


def _client():
    """The coordination service's client of this process (None: no jax.distributed). JAX keeps
    it in a private module; nothing public reads or writes its key-value store."""
    from jax._src import distributed as jd

    return getattr(jd.global_state, "client", None)


def start_beating() -> None:
    """Publishes this process's host name and pid, then beats every BEAT_S seconds on a daemon
    thread, stopped (and joined) at exit before JAX shuts its client down: a thread inside a
    call of the client while the interpreter exits would abort the process."""
    c = _client()
    if c is None or _state["beater"] is not None:
        return
    i = jax.process_index()
    c.key_value_set(_WHERE.format(i), f"host {socket.gethostname()}, pid {os.getpid()}",
                    allow_overwrite=True)
    done = threading.Event()

    def beat():
        n = 0
        while not done.wait(BEAT_S):
            n += 1
            try:
                c.key_value_set(_BEAT.format(i), str(n), allow_overwrite=True)
            except Exception:  # noqa: BLE001  (the service is gone: process 0 died)
                return

    t = threading.Thread(target=beat, name="ouroboros-beat", daemon=True)
    _state["beater"] = (t, done)
    t.start()
    atexit.register(_at_exit)  # after JAX's own atexit: runs before it


def _at_exit() -> None:
    """Every thread here stopped and joined (so none is inside a call of the client); then
    process 0, which holds the service, waits up to EXIT_WAIT_S for the others to have left
    it (in recoverable mode JAX's shutdown does not wait, and a follower whose service has
    gone before its own shutdown is aborted)."""
    for w in list(_watchdogs):
        w.stop(2.0)
    t, done = _state["beater"]
    done.set()
    t.join(5.0)
    if jax.process_index() == 0:
        c, dead = _client(), set(lost())
        live = [i for i in range(jax.process_count()) if i not in dead]
        # returns once every other live process has disconnected (it blocks until each one
        # calls it too, which followers never do); on a thread, to bound the wait
        left = threading.Thread(target=lambda: c.get_live_nodes(live), daemon=True)
        left.start()
        left.join(EXIT_WAIT_S)


def describe(i: int) -> str:
    """'process i (host h, pid n)', or 'process i' when it never announced itself."""
    c = _client()
    try:
        where = c.key_value_try_get(_WHERE.format(i)) if c is not None else None
    except Exception:  # noqa: BLE001  (not set, or the service is gone: the id alone)
        where = None
    return f"process {i} ({where})" if where else f"process {i}"


def lost() -> list[int]:
    """The other processes whose beat has not moved for HEARTBEAT_TIMEOUT_S seconds (since
    this process first looked: call it periodically); [] on one process, or when nothing
    here is on. On a follower, a service that answers no more is process 0 lost."""
    c, n, me = _client(), jax.process_count(), jax.process_index()
    if c is None or n == 1 or _state["beater"] is None:
        return []
    now, dead = time.monotonic(), []
    for i in range(n):
        if i == me:
            continue
        try:
            beat = c.key_value_try_get(_BEAT.format(i))
        except Exception as e:  # noqa: BLE001
            if "NOT_FOUND" not in str(e):  # the service itself is gone
                return [0]
            beat = None  # no beat yet
        with _seen_lock:
            last, since = _seen.get(i, (None, None))
            if since is None or beat != last:
                _seen[i] = (beat, now)
            elif now - since > HEARTBEAT_TIMEOUT_S:
                dead.append(i)
    return dead


def explain(cause: BaseException, timeout: Optional[float] = None) -> BaseException:
    """A failed collective's error -> ProcessLost naming the dead processes, once their beats
    have stopped long enough (waiting up to timeout, default HEARTBEAT_TIMEOUT_S + MARGIN_S),
    else cause itself (the collective failed for another reason)."""
    if isinstance(cause, ProcessLost) or jax.process_count() == 1 or \
            _state["beater"] is None:
        return cause
    deadline = time.monotonic() + (HEARTBEAT_TIMEOUT_S + MARGIN_S if timeout is None
                                   else timeout)
    while True:
        dead = lost()
        if dead:
            err = ProcessLost(dead, cause)
            err.__cause__ = cause
            return err
        if time.monotonic() > deadline:
            return cause
        time.sleep(0.2)


class Watchdog:
    """Polls `lost` every POLL_S seconds on a daemon thread and calls on_lost(ProcessLost)
    once, when a process is missing; `stop` ends it."""

    def __init__(self, on_lost: Callable[[ProcessLost], None], period: float = POLL_S):
        self.on_lost, self.period = on_lost, period
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ouroboros-watchdog",
                                        daemon=True)
        _watchdogs.add(self)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.period):
            dead = lost()
            if dead:
                self._done.set()
                self.on_lost(ProcessLost(dead))

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the thread and waits for it: a thread still inside the client's call when the
        interpreter exits would abort the process."""
        self._done.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
