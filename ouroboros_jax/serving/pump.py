"""What keeps the server's event loop free: blocking work moved to threads.

`off_loop(fn)` runs a request's CPU-bound preparation (JSON parsing, chat template rendering,
tokenization, validation) on a worker thread, once per request; `Pump` iterates a blocking
`RequestHandle` on a thread of its own and hands its deltas to the loop; `disconnected`
waits, on the loop, for the client to go away.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional


class Pump:
    """Iterates a blocking RequestHandle on its own thread and hands ("delta", d, index),
    ("done", result, index) or ("error", exc, index) to the event loop's queue (index: the
    handle's choice; the pumps of a request's choices share one queue). The server may put
    ("shutdown", None) there itself (its drain time is over)."""

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


def _cancel_orphan(fut: asyncio.Future) -> None:
    """A preparation that finished after its request was abandoned: its submitted request
    (anything with a `cancel`, a `server.Call`) is cancelled, so it frees its slots."""
    if not fut.cancelled() and fut.exception() is None:
        cancel = getattr(fut.result(), "cancel", None)
        if cancel is not None:
            cancel()


async def off_loop(fn, *args):
    """fn(*args) on a worker thread, awaited. When the awaiting task is cancelled first (the
    server's shutdown), what fn returns is cancelled once it is done (`_cancel_orphan`)."""
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_cancel_orphan)
        raise


async def disconnected(request) -> None:
    """Returns when the client has gone (uvicorn's receive() after the body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
