"""A request's choices (`n`): the seed each one samples from, and the pumps that carry their
handles' deltas to the event loop through one queue.

Each choice is an engine request of its own (a slot each; their prompts are prefilled
separately). A Pump iterates one blocking `RequestHandle` on a thread and puts (kind, item,
choice index) entries on the queue the server reads (`entry`).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Optional


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed among a request's n: the request's own for choice 0, else one derived
    from (seed, i) by a hash (reproducible, and unlike seed + i not another request's seed)."""
    if i == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:4], "little")


class Pump:
    """Iterates a blocking RequestHandle on its own thread and hands ("delta", d, index),
    ("done", result, index) or ("error", exc, index) to the event loop's queue (index: the
    handle's choice; several pumps may share one queue)."""

    def __init__(self, handle, loop: asyncio.AbstractEventLoop, index: int = 0,
                 queue: Optional[asyncio.Queue] = None):
        self.handle, self.loop, self.index = handle, loop, index
        self.queue: asyncio.Queue = asyncio.Queue() if queue is None else queue
        threading.Thread(target=self._run, daemon=True, name=f"pump-{handle.id}").start()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item + (self.index,))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.handle.cancel()

    def _run(self) -> None:
        try:
            for d in self.handle:
                self._put(("delta", d))
            self._put(("done", self.handle.result()))
        except Exception as e:  # noqa: BLE001  (reported to the client, never lost)
            self._put(("error", e))


def pumps(call, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
    """One queue fed by a Pump per choice of call (`server.Call`: its `handles`)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, h in enumerate(call.handles):
        Pump(h, loop, i, queue)
    return queue


def entry(e: tuple) -> tuple:
    """A queue entry -> (kind, item, choice index): a Pump's, or (kind, item) of choice 0."""
    return e if len(e) == 3 else (e[0], e[1], 0)
