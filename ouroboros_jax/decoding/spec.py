"""`MethodSpec`: how a decoding method describes itself to `generate` and the registry.

Its own module so that method modules and the registry (`decoding/__init__.py`) both import it
without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Attributes:
        run: (target, draft, prompt[B,P], prompt_lengths[B], limits, sampling, config, *,
            greedy, slots, pool) -> (Sequences, stats dict, pool): the whole generation, one
            jitted while_loop.
        needs_draft: whether the method needs a draft model.
        config_type: the method's config dataclass.
        default_config: () -> the paper's recipe (`config=None`).
        margin: config -> cache slots one round may touch past prompt + max_new_tokens.
    """

    run: Callable
    needs_draft: bool
    config_type: Any
    default_config: Callable[[], Any]
    margin: Callable[[Any], int]


class NoConfig:
    """Vanilla decoding has no configuration."""
