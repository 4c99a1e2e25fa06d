"""Decoding methods. Each registers a `MethodSpec`; `oj.generate` dispatches on its name.

A method's `run(target, draft, prompt[B,P], prompt_lengths[B], limits, sampling, config, *,
greedy, slots, pool) -> (Sequences, stats dict, pool)` runs the whole generation as one jitted
`lax.while_loop`. `margin(config)` is how many cache slots past prompt + max_new_tokens one
round may touch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .vanilla import run_vanilla


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    run: Callable
    needs_draft: bool
    config_type: Any
    default_config: Callable[[], Any]
    margin: Callable[[Any], int]


class NoConfig:
    """Vanilla decoding has no configuration."""


def _run_vanilla(target, draft, prompt, plens, limits, sp, cfg, *, greedy, slots, pool):
    seq, stats = run_vanilla(target.params, target.config, prompt, plens, limits, sp,
                             slots=slots, greedy=greedy)
    return seq, stats, pool


METHODS: dict[str, MethodSpec] = {
    "vanilla": MethodSpec(run=_run_vanilla, needs_draft=False, config_type=NoConfig,
                          default_config=lambda: None, margin=lambda cfg: 0),
}


def register(name: str, spec: MethodSpec) -> None:
    METHODS[name] = spec


from .speculative import SPEC as _spec; register("speculative", _spec)  # noqa: E402,E702

from .lookahead import SPEC as _lookahead_spec  # noqa: E402

register("lookahead", _lookahead_spec)

from .ouroboros import SPEC as _ouroboros_spec  # noqa: E402

register("ouroboros", _ouroboros_spec)
