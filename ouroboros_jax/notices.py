"""What the library tells its user outside the results: one-time facts on stderr, and the
silencing of one advisory of a dependency that does not apply here.

transformers prints "PyTorch was not found. Models won't be available ..." when it is imported
without torch. ouroboros-jax uses transformers only for tokenizers and configs (the models are
JAX), so on the quick-start install (no torch) that banner says nothing true about this library;
`silence_torch_advisory` drops exactly that record and nothing else transformers logs.
"""

from __future__ import annotations

import logging
import sys

TORCH_ADVISORY = "PyTorch was not found"

_said: set = set()


class _DropTorchAdvisory(logging.Filter):
    """Drops transformers' "PyTorch was not found" advisory; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCH_ADVISORY)


def silence_torch_advisory() -> None:
    """Installs the filter on transformers' root logger (which logs the advisory itself, on
    import). Cheap and idempotent; imports nothing."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropTorchAdvisory) for f in logger.filters):
        logger.addFilter(_DropTorchAdvisory())


def say_once(key: str, message: str) -> None:
    """Prints `ouroboros-jax: message` on stderr the first time `key` is said in this process
    (a choice made for the user, such as the dtype of dtype="auto"); later calls are silent."""
    if key in _said:
        return
    _said.add(key)
    print(f"ouroboros-jax: {message}", file=sys.stderr, flush=True)
