"""Decoding methods. Each registers a `MethodSpec`; `oj.generate` and the serving engine
dispatch on its name.

A method is described by its seam functions over B rows (init, insert, round, finish; see
`decoding/spec.py`). Its `run(target, draft, prompt[B,P], prompt_lengths[B], limits, sampling,
config, *, greedy, slots, pool) -> (Sequences, `common.Stats`, pool)` runs the whole generation
as one jitted `lax.while_loop` over them. `margin(config)` is how many cache slots past prompt +
max_new_tokens one round may touch.
"""

from __future__ import annotations

from .spec import MethodSpec, NoConfig
from .vanilla import (run_vanilla, vanilla_finish, vanilla_init, vanilla_insert,
                      vanilla_step)


PLAIN = "vanilla"  # the method without speculation: what a load level or auto turns it off to
# what a call with a draft runs when it names no method (`request.default_method`, `serve`):
# config="auto" sizes it to the device, down to its speculative step where trees do not pay
DRAFTED = "ouroboros"

METHODS: dict[str, MethodSpec] = {
    "vanilla": MethodSpec(runner=run_vanilla, needs_draft=False, config_type=NoConfig,
                          default_config=lambda: None, margin=lambda cfg: 0,
                          init=vanilla_init, insert=vanilla_insert, round=vanilla_step,
                          finish=vanilla_finish, max_emit=lambda cfg: 1,
                          family=lambda cfg: (), forward_sizes=lambda cfg: (1, 0, 0)),
}


def register(name: str, spec: MethodSpec) -> None:
    METHODS[name] = spec


# Method modules import `.spec` (and auto's rates), never this registry: no import cycle.
from .lookahead import SPEC as _LOOKAHEAD  # noqa: E402
from .ouroboros import SPEC as _OUROBOROS  # noqa: E402
from .prompt_lookup import SPEC as _PROMPT_LOOKUP  # noqa: E402
from .speculative import SPEC as _SPECULATIVE  # noqa: E402

register("speculative", _SPECULATIVE)
register("lookahead", _LOOKAHEAD)
register("ouroboros", _OUROBOROS)
register("prompt_lookup", _PROMPT_LOOKUP)
