"""What a bench row ran, in parts the cost model can price: one part for a fixed config, one per
distinct choice for a `METHOD@auto` row.

config="auto" picks per call (ouroboros_jax/auto/) and may run the asked method sized for this
machine, or plain decoding where nothing pays (`stats["auto"]["method"] == "vanilla"`). The
runner keeps each call's choice (`per_call[i]["auto"]`: the method it ran and its evaluable
recipe, `knobs.recipe_of`) with that call's counted forwards, so a row's counts split exactly
into parts of one (method, config) each: `cost_model.cost_rows` prices every part with its own
forward sizes and sums them, for the CPU latency table and for an accelerator projection alike.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any, Optional

from ..decoding import METHODS


@dataclasses.dataclass(frozen=True)
class Part:
    """Calls of one row that ran one (method, config), with their summed counts.

    Attributes:
        method: the method that ran (for an auto row: what auto chose, "vanilla" included).
        config: its config object (None: vanilla, or the method's default).
        recipe: the config as `stats["auto"]` wrote it, None for a fixed row.
        calls: how many measured calls ran it.
        target_calls, draft_forwards: their counted forwards.
        prompt_tokens: each call's prompt length (prefill is priced per call).
    """

    method: str
    config: Any
    recipe: Optional[str]
    calls: int
    target_calls: int
    draft_forwards: int
    prompt_tokens: tuple


def is_auto(row: dict, config: Any = None) -> bool:
    """Whether a bench row was run with config="auto" (a live run's config, or the saved
    row's `{"auto": True}`)."""
    return config == "auto" or row.get("config") == {"auto": True}


def config_from_recipe(method: str, recipe: Optional[str]):
    """The config object a recipe string names ("SpeculativeConfig(gamma=3)" -> that config);
    None for None. Parsed, never evaluated: only the method's own config class and literal
    field values are accepted, else ValueError naming the recipe."""
    if recipe is None:
        return None
    spec = METHODS.get(method)
    if spec is None:
        raise ValueError(f"auto recipe {recipe!r}: method {method!r} is not registered")
    cls = spec.config_type
    try:
        node = ast.parse(recipe, mode="eval").body
        ok = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == cls.__name__ and not node.args)
        kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords} if ok else None
    except (SyntaxError, ValueError):
        kw = None
    if kw is None:
        raise ValueError(f"auto recipe {recipe!r}: expected {cls.__name__}(field=value, ...)")
    return cls(**kw)


def row_parts(row: dict, config: Any = None) -> list[Part]:
    """The row's parts: auto rows grouped by each call's choice (in order of first use), a fixed
    row one part of `config` with the row's totals."""
    if not is_auto(row, config):
        return [Part(row["method"], config, None, len(row["per_call"]), row["target_calls"],
                     row["draft_forwards"], tuple(c["prompt_tokens"] for c in row["per_call"]))]
    groups: dict = {}
    for c in row["per_call"]:
        a = c.get("auto") or {}
        # a call without a choice (a method auto cannot size) ran the method's default config
        key = (a.get("method", row["method"]), a.get("config"))
        groups.setdefault(key, []).append(c)
    parts = []
    for (method, recipe), calls in groups.items():
        cfg = config_from_recipe(method, recipe)
        if cfg is None and METHODS[method].default_config is not None and method != "vanilla":
            cfg = METHODS[method].default_config()
        parts.append(Part(method, cfg, recipe, len(calls),
                          sum(int(c["target_calls"]) for c in calls),
                          sum(int(c["draft_forwards"] or 0) for c in calls),
                          tuple(c["prompt_tokens"] for c in calls)))
    return parts


def ran_label(label: str, parts: list[Part], auto: bool) -> str:
    """The row's name with what it ran: the label alone for a fixed config;
    "speculative@auto (ran SpeculativeConfig(gamma=3))", "... (ran vanilla)", or each choice
    with its calls when auto's choice changed between calls."""
    if not auto:
        return label
    name = lambda p: p.recipe or p.method  # noqa: E731
    if len(parts) == 1:
        return f"{label} (ran {name(parts[0])})"
    return f"{label} (ran " + ", ".join(f"{name(p)} on {p.calls} calls" for p in parts) + ")"
