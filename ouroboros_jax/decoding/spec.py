"""`MethodSpec`: how a decoding method describes itself to `generate` and the registry.

Its own module so that method modules and the registry (`decoding/__init__.py`) both import it
without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Attributes:
        run: (target, draft, prompt[B,P], prompt_lengths[B], limits, sampling, config, *,
            greedy, slots, pool) -> (Sequences, `common.Stats`, pool): the whole generation, one
            jitted while_loop.
        needs_draft: whether the method needs a draft model.
        config_type: the method's config dataclass.
        default_config: () -> the paper's recipe (`config=None`).
        margin: config -> cache slots one round may touch past prompt + max_new_tokens.
        forward_sizes: config -> (tokens per target forward, per draft forward, per first
            draft forward of a round), fixed shapes as compiled (masked slots cost as much
            as real ones); what the cost model prices. None: unknown.
        quick_config: () -> a small config for tiny models (`bench --quick`, tests).
        auto_grid: knob grid {"gamma": (...), "window": ..., "ngram": ..., "suffixes": ...}
            -> the configs `config="auto"` chooses among (decoding/auto.py). None: no auto.
        auto_rate: (config, agreement or None, target latencies {n: s}, draft latencies or
            None) -> predicted tokens/s of one config (auto's cost model).
    """

    run: Callable
    needs_draft: bool
    config_type: Any
    default_config: Callable[[], Any]
    margin: Callable[[Any], int]
    forward_sizes: Optional[Callable[[Any], tuple]] = None
    quick_config: Optional[Callable[[], Any]] = None
    auto_grid: Optional[Callable[[dict], list]] = None
    auto_rate: Optional[Callable[..., float]] = None


class NoConfig:
    """Vanilla decoding has no configuration."""


def recipe_of(cfg) -> str:
    """`Config(field=value, ...)` over a method's tree knobs, evaluable back into cfg (what
    `tune` prints and `stats["auto"]` reports)."""
    fields = [f for f in ("gamma", "window", "ngram", "guesses", "suffixes")
              if hasattr(cfg, f)]
    return f"{type(cfg).__name__}(" + ", ".join(f"{f}={getattr(cfg, f)}" for f in fields) + ")"
