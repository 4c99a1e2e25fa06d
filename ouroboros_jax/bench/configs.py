"""Which method configs a bench run compares: the paper defaults or the --quick small trees,
fields overridden per method, the Table 4 ablation steps, and method names -> `MethodRun`s.

Shared by `suite.py` (the bench) and `sweeps.py` (one knob at a time), so neither imports the
other for it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..decoding import METHODS
from .peers import HF_PEERS
from .runner import MethodRun

AUTO_SUFFIX = "@auto"


def ablation_steps() -> tuple:
    """The paper's Table 4 steps, one mechanism added per step: ((label, {switch: bool}), ...)
    from Ouroboros' knob space."""
    return METHODS["ouroboros"].knobs.ablation_steps()


def config_types() -> dict:
    """{method: its config dataclass} for every registered method that has one."""
    return {name: spec.config_type for name, spec in METHODS.items()
            if dataclasses.is_dataclass(spec.config_type)}


def make_config(method: str, overrides: Optional[dict] = None, quick: bool = False):
    """The method's config: paper defaults (or the --quick small trees), fields overridden."""
    types = config_types()
    if method not in types:
        return None
    quick_cfg = METHODS[method].quick_config if quick else None
    # --quick: the method's own small trees (tiny random models, seconds)
    kw = dataclasses.asdict(quick_cfg()) if quick_cfg is not None else {}
    kw.update(overrides or {})
    fields = {f.name for f in dataclasses.fields(types[method])}
    bad = sorted(set(kw) - fields)
    if bad:
        raise ValueError(f"--config {method}: unknown field(s) {', '.join(bad)}; "
                         f"{types[method].__name__} has {', '.join(sorted(fields))}")
    return types[method](**kw)


def method_runs(names, quick: bool = False, overrides: Optional[dict] = None) -> list[MethodRun]:
    """Names -> MethodRuns. Names: any registered method, "ablation" (the Table 4 steps on the
    ouroboros engine), "peers" (hf-greedy, hf-assisted, hf-pld), one peer name, or
    "METHOD@auto" (that method with generate's default, config="auto", its calls timed with
    whatever auto compiles or probes in them).
    overrides: {method: {field: value}} applied to that method's config."""
    overrides = overrides or {}
    runs: list[MethodRun] = []
    for n in names:
        if n == "peers":
            runs += [MethodRun(p, p, kind="hf") for p in HF_PEERS]
        elif n in HF_PEERS:
            runs.append(MethodRun(n, n, kind="hf"))
        elif n.endswith(AUTO_SUFFIX):
            m = n[:-len(AUTO_SUFFIX)]
            runs.append(MethodRun(n, m, "auto"))
        elif n == "ablation":
            for step, sw in ablation_steps():
                try:
                    cfg = make_config("ouroboros", {**overrides.get("ouroboros", {}), **sw},
                                      quick)
                except ImportError:
                    cfg = None
                runs.append(MethodRun(f"ablation:{step}", "ouroboros", cfg))
        else:
            try:
                cfg = make_config(n, overrides.get(n), quick)
            except ImportError:  # a method module that does not exist yet: runner skips it
                cfg = None
            runs.append(MethodRun(n, n, cfg))
    seen, out = set(), []
    for r in runs:
        if r.label not in seen:
            seen.add(r.label)
            out.append(r)
    return out
