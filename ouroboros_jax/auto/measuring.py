"""What auto says and logs when a caller asks it to measure (`Prices` with probe: a tuner's
`measure_prices`, `probe_latency`, a call without the store): one line on stderr first, with an
estimate of the seconds, and each measurement's seconds in the call's log
(`stats["auto"]["measured_now"]`). A `generate` call never measures (issue 53)."""

from __future__ import annotations

import sys
import time
from typing import Optional

# What a measurement spends besides its timed runs, for the estimate `announce` gives: one
# compile of a small program (a matmul loop, a forward timer), seconds, on this project's CPU
# (the demo target's timers: 1-2 s each; the real 1.5B's: 3-6 s).
COMPILE_GUESS = 3.0


def announce(what: str, seconds: float, compiles: int) -> None:
    """One line on stderr before a measurement the caller waits for: what, and about how
    long (a caller is never charged seconds it was not told of)."""
    about = seconds + compiles * COMPILE_GUESS
    print(f"ouroboros-jax: config='auto' measures {what} now (about {about:.0f} s: {compiles} "
          f"compile{'s' if compiles != 1 else ''}); once per device and model, kept on disk",
          file=sys.stderr)


def spent(log: Optional[list], what: str, t0: float) -> None:
    """Appends (what, seconds since t0) to a call's log of measurements (None: not kept)."""
    if log is not None:
        log.append({"what": what, "seconds": round(time.perf_counter() - t0, 3)})
