"""The XLA:CPU flag the library sets before JAX starts its CPU backend, and why.

From jaxlib 0.9 on, XLA:CPU hands dots to YNNPACK (`--xla_cpu_experimental_ynn_fusion_type`).
Its kernel is as fast as XLA's own for one row and much slower for a few: measured here
(jaxlib 0.10.2, 2 AVX-512 cores, fp32 x[T, 8192] @ w[8192, 16384], `python bench/...` in the
note of this change), T = 1/2/4/8/16 took 21/47/57/71/102 ms with YNNPACK and 21/30/37/53/63 ms
without it. Speculative decoding lives on those few rows: a round's verification forward has
T = gamma + 1 tokens (a tree of 5-30), so with YNNPACK a 5-token target forward cost ~2.7x a
1-token one, where llama.cpp's costs ~1.4x on the same CPU, and speculation hardly paid.

`apply()` appends the flag with an empty value (no YNNPACK fusions) to `XLA_FLAGS` when:
- jaxlib is 0.9 or later (older jaxlibs do not know the flag, and XLA aborts on an unknown one);
- the user's `XLA_FLAGS` does not set it already (theirs wins);
- `OUROBOROS_JAX_KEEP_XLA_FLAGS` is not set to a non-empty value (the opt-out).
It must run before JAX creates its CPU client, so the package calls it first thing; a process
that ran JAX computations before importing ouroboros_jax keeps the flags it started with. On
GPU and TPU the flag changes nothing (it only affects the CPU backend).
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Mapping, Optional

FLAG = "--xla_cpu_experimental_ynn_fusion_type"
OPT_OUT = "OUROBOROS_JAX_KEEP_XLA_FLAGS"
FIRST_JAXLIB = (0, 9)  # the first jaxlib whose XLA has the flag (checked in the wheels' binaries)


def _version(text: str) -> tuple[int, ...]:
    """'0.10.2' -> (0, 10, 2); stops at the first part that is not a number ('0.9.0.dev1')."""
    out = []
    for part in text.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def flags_with_ours(xla_flags: str, jaxlib_version: Optional[str],
                    env: Mapping[str, str]) -> str:
    """The XLA_FLAGS value to run under: xla_flags with the flag appended, or unchanged when the
    jaxlib is older (or not installed: None), the user set the flag, or opted out."""
    if env.get(OPT_OUT) or jaxlib_version is None:
        return xla_flags
    if _version(jaxlib_version) < FIRST_JAXLIB or FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {FLAG}=".strip()


def apply() -> None:
    """Sets os.environ["XLA_FLAGS"] as `flags_with_ours` says (before JAX's CPU client exists)."""
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        version = None
    flags = os.environ.get("XLA_FLAGS", "")
    new = flags_with_ours(flags, version, os.environ)
    if new != flags:
        os.environ["XLA_FLAGS"] = new
