"""The engine's programs compiled before the first request (`Engine.warmup`), one at a time,
each reported with what it is and how long it took: a server that prints one line and then
nothing for a minute looks hung.

Programs: the insert of each prompt-width bucket (a prompt of that width into slot 0) and the
device step of every load level in both sampling modes, for each row bucket (`row_buckets`). The dummy rows end before any round
(`stop_rows`), and the dummy prompts' n-grams leave the pool as they came (save/restore).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from ..distributed import fetch
from ..request import RequestParams, ValidRequest, bucket
from .executor import OFF, pack_insert
from .lockstep import Op
from .row_buckets import describe

# progress(name, None) as a program starts compiling, progress(name, seconds) when it is done
Progress = Callable[[str, Optional[float]], None]


def default_widths(limit: int, largest: int = 256) -> tuple:
    """The prompt-width buckets serve compiles at startup: 16 up to `largest` (chat prompts'
    usual sizes), never past the request cap; longer prompts compile on first use."""
    top = min(bucket(largest), bucket(max(1, limit - 1)))
    widths, w = [], bucket(1)
    while w <= top:
        widths.append(w)
        w *= 2
    return tuple(widths)


def level_name(threshold: int, cfg, greedy: bool, rows: str = "") -> str:
    """A step program as progress names it (rows: `row_buckets.describe`'s words)."""
    mode = "greedy" if greedy else "sampling"
    what = "speculation off" if cfg is OFF else ("plain" if cfg is None else type(cfg).__name__)
    return f"step ({threshold}+ busy slots, {what}, {mode}{rows})"


def _timed(progress: Optional[Progress], name: str, run: Callable[[], object]) -> None:
    """run() (waited for), reported to progress before and after."""
    if progress is not None:
        progress(name, None)
    t0 = time.perf_counter()
    fetch(run())
    if progress is not None:
        progress(name, time.perf_counter() - t0)


def compile_programs(lead: Callable[[Op], object], *, slots: int, limit: int, eos: np.ndarray,
                     levels: list, prompt_widths: Sequence[int],
                     progress: Optional[Progress] = None,
                     row_sizes: Optional[Sequence[int]] = None) -> None:
    """Runs once every program the engine's requests will need, so none waits for a compile.
    lead: the engine's device-call dispatch (`Lockstep.lead`); slots, limit (a request's
    prompt + max_tokens cap), eos (default stop ids), levels and row buckets as the engine has
    them."""
    lead(Op("save_pool"))  # the dummy prompts' n-grams (context phrases) must not stay
    stop = np.zeros((slots,), bool)
    for w in sorted({bucket(int(w)) for w in prompt_widths}):
        req = ValidRequest([0] * min(w, limit - 1), RequestParams(max_tokens=1), eos)
        _timed(progress, f"insert (prompt width {w})",
               lambda req=req: lead(Op("insert", packed=pack_insert(0, req))))
        stop[0] = True  # the dummy row ends before any round
    for level, (threshold, cfg) in enumerate(levels):
        # a level runs with at least `threshold` busy slots: no bucket of fewer rows
        sizes = [None] if row_sizes is None else [b for b in row_sizes if b >= threshold] \
            or [max(row_sizes)]
        for b in sizes:
            for greedy in (True, False):
                ends = stop.copy()
                _timed(progress, level_name(threshold, cfg, greedy, describe(row_sizes or (), b)),
                       lambda: lead(Op("step", level=level, greedy=greedy, stop_rows=ends,
                                       rows=b)))
                stop[0] = False
    lead(Op("restore_pool"))
