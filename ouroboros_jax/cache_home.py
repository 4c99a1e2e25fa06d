"""Where ouroboros-jax keeps what it builds on a machine: one XDG base for every cache (the
CLI's compiled programs, dequantized weights, built CPU kernels)."""

from __future__ import annotations

import os


def cache_home(*parts: str) -> str:
    """$XDG_CACHE_HOME (or ~/.cache)/ouroboros-jax/<parts...>."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ouroboros-jax", *parts)
