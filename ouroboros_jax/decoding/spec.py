"""`MethodSpec`: how a decoding method describes itself to `generate` and the registry.

Its own module so that method modules and the registry (`decoding/__init__.py`) both import it
without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from . import cost


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
        round_model: (config, agreement or None) -> `cost.RoundModel` (expected tokens,
            draft forwards and overhead per round): with `forward_sizes`, what the cost model
            (decoding/cost.py) prices. None: the method has no `config="auto"`.

    The knobs `config="auto"` searches, and everything else that enumerates configs, come from
    the config class's `KNOBS` (decoding/knobs.py).
    """

    run: Callable
    needs_draft: bool
    config_type: Any
    default_config: Callable[[], Any]
    margin: Callable[[Any], int]
    forward_sizes: Optional[Callable[[Any], tuple]] = None
    quick_config: Optional[Callable[[], Any]] = None
    round_model: Optional[Callable[..., Any]] = None

    @property
    def knobs(self):
        """The config class's `knobs.KnobSpace`, or None (vanilla has no knobs)."""
        return getattr(self.config_type, "KNOBS", None)

    def auto_grid(self, values: Optional[dict] = None) -> list:
        """The configs `config="auto"` chooses among: the knob space's grid over `values`
        ({knob: values}, default each knob's auto values)."""
        return self.knobs.grid(self.config_type, values)

    def rate(self, cfg, agreement, tt: dict, td: Optional[dict]) -> float:
        """Predicted tokens/s of one config from latency tables (decoding/cost.py)."""
        return cost.rate(self.forward_sizes(cfg), self.round_model(cfg, agreement), tt, td)


class NoConfig:
    """Vanilla decoding has no configuration."""
