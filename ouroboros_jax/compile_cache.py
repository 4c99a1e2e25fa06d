"""The CLI's persistent compilation cache: `serve` and `generate` keep XLA's compiled programs
on disk, so a second start of the same model and flags reads them back instead of compiling.

Why: `serve` compiles every program its requests can need before it listens (an insert per
prompt-width bucket, a step per load level, sampling mode and row bucket): on SmolLM2-135M
on this project's 2-core CPU, about 45 s, every start.

Where: `--compile-cache DIR`, else $OUROBOROS_JAX_COMPILE_CACHE, else
$XDG_CACHE_HOME/ouroboros-jax/xla (~/.cache/ouroboros-jax/xla); "off" keeps nothing. A cache
directory already configured in JAX (`jax_compilation_cache_dir`, or JAX_COMPILATION_CACHE_DIR)
wins. The library itself writes nothing to disk: only the CLI turns this on.
"""

from __future__ import annotations

import os
from typing import Optional

from .cache_home import cache_home

ENV = "OUROBOROS_JAX_COMPILE_CACHE"
OFF = "off"


def default_dir() -> str:
    """Where the CLI keeps compiled programs unless told otherwise."""
    return cache_home("xla")


def resolve(flag: Optional[str]) -> Optional[str]:
    """The directory to use (None: no cache) from the flag, the environment and the default."""
    choice = flag if flag is not None else os.environ.get(ENV) or default_dir()
    return None if choice.strip().lower() == OFF else os.path.expanduser(choice)


def enable(flag: Optional[str]) -> Optional[str]:
    """Turns JAX's persistent compilation cache on at the resolved directory, unless JAX has
    one configured already (that one is kept) -> the directory in use, or None."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = resolve(flag)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache: cannot create {path!r} ({e.strerror}); pass "
                         f"another directory or --compile-cache off") from None
    jax.config.update("jax_compilation_cache_dir", path)
    # every program, however quick its compile (the threshold was 0.5 s): the demo pair's
    # call compiles 12 small programs beside its loop, 0.33 s of backend compile in a second
    # process at 0.5 s, 0.17 s read back (`python -m experiments.loop_load`); little, but free
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
