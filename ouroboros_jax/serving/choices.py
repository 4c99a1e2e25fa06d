"""A request's choices (`n`): the `Call` holding their handles, the seed each one samples
from, the pumps that carry their deltas to the event loop through one queue, and the error
a finished choice answers with.

Each choice is an engine request of its own (a slot each; their prompts are prefilled
separately). A Pump (`pump.py`) iterates one blocking `RequestHandle` on a thread and puts
(kind, item, choice index) entries on the queue the server reads (`entry`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from typing import Any, Optional

from .openai_api import APIError
from .pump import Pump


@dataclasses.dataclass
class Call:
    """One accepted request: its handles (one per choice; `handle` the first) and how to
    answer it."""

    handle: Any
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    handles: Optional[list] = None

    def __post_init__(self):
        self.handles = self.handles or [self.handle]

    def cancel(self) -> None:
        """Cancels every choice (a finished one ignores it)."""
        for h in self.handles:
            h.cancel()

    @property
    def meta(self) -> dict:
        """The fields every chunk and response of this request carries."""
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.handle.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}


def shut_down() -> APIError:
    """What a request the server's shutdown cancelled answers with."""
    return APIError(503, "the request was cancelled: the server is shutting down",
                    type_="server_error", code="cancelled")


def failure(handle, r) -> Optional[APIError]:
    """The error a finished request answers with, or None: the engine failed it (500), or
    the server's shutdown cancelled it (503)."""
    if handle.error is not None:
        return APIError(500, f"generation failed: {handle.error!r}", type_="server_error")
    return shut_down() if r.finish_reason == "cancelled" else None


def choice_seed(seed: int, i: int) -> int:
    """Choice i's seed among a request's n: the request's own for choice 0, else one derived
    from (seed, i) by a hash (reproducible, and unlike seed + i not another request's seed)."""
    if i == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:4], "little")


def pumps(call, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
    """One queue fed by a Pump per choice of call (`server.Call`: its `handles`)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, h in enumerate(call.handles):
        Pump(h, loop, i, queue)
    return queue


def entry(e: tuple) -> tuple:
    """A queue entry -> (kind, item, choice index): a Pump's, or (kind, item) of choice 0."""
    return e if len(e) == 3 else (e[0], e[1], 0)
