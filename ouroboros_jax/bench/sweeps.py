"""Sweeps of one Ouroboros knob at a time on a prompt sample, each against vanilla on the same
sample in the same run (every point compiles once; compile time is excluded as in the bench).

  k        suffixes X per round (paper Figure 6)
  gamma    base draft length
  pool     pool capacity (pool_rows: keys held; shapes the starting pool, no recompile)
  history  pool reuse across prompts on/off, prompts in file order and reversed (Table 17)
  length   generation length (Table 15)
  confidence  adaptive drafting threshold (0 = fixed chains of gamma)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .configs import make_config
from .runner import MethodRun, run_bench
from .workloads import Prompt, with_length

SWEEPS = ("k", "gamma", "pool", "history", "length", "confidence")
VALUES = {"k": [1, 2, 3, 4, 5], "gamma": [2, 4, 8, 12], "pool": [16, 256, 4096, None],
          "length": [64, 128, 256, 512], "confidence": [0.0, 0.2, 0.4, 0.6]}
QUICK_VALUES = {"k": [1, 2], "gamma": [2, 4], "pool": [4, None], "length": [8, 16],
                "confidence": [0.0, 0.5]}
# sweeps over one OuroborosConfig field: sweep name -> field
FIELDS = {"k": "suffixes", "gamma": "gamma", "pool": "pool_rows", "confidence": "confidence"}


def _point(value, s: dict, van_tps: Optional[float]) -> dict:
    return {"value": "default" if value is None else value,
            "tokens_per_second": s["tokens_per_second"],
            "speedup": (s["tokens_per_second"] / van_tps) if van_tps and s["tokens_per_second"]
            else None,
            "eta": s.get("eta"), "c": s.get("c"), "pool_hit_rate": s.get("pool_hit_rate"),
            "identical": s["identical"], "compile_seconds": s["compile_seconds"],
            "new_tokens": s["new_tokens"], "seconds": s["seconds"]}


def sweep(name: str, target, draft, prompts: list[Prompt], *, quick: bool = False,
          overrides: Optional[dict] = None, values=None, ignore_eos: bool = False,
          log=None) -> dict:
    """One sweep -> {"param", "points": [...], "vanilla_tokens_per_second"}."""
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; choose from {', '.join(SWEEPS)}")
    base = make_config("ouroboros", (overrides or {}).get("ouroboros"), quick)
    values = list(values or (QUICK_VALUES if quick else VALUES).get(name, []))
    kw = dict(ignore_eos=ignore_eos, progress=False, log=log)
    points = []
    if name in FIELDS:
        field = FIELDS[name]
        runs = []
        for v in values:
            extra = {field: v}
            if name == "k" and v > base.guesses:
                extra["guesses"] = v
            runs.append(MethodRun(f"{name}={v}", "ouroboros", dataclasses.replace(base, **extra)))
        res = run_bench(target, draft, prompts, runs, **kw)
        van = res["methods"]["vanilla"]["tokens_per_second"]
        points = [_point(v, res["methods"][r.label], van) for v, r in zip(values, runs)]
        return {"param": field, "points": points, "vanilla_tokens_per_second": van}
    if name == "history":
        for order in ("file order", "reversed"):
            ps = prompts if order == "file order" else list(reversed(prompts))
            runs = [MethodRun(f"history={h}", "ouroboros", dataclasses.replace(base, history=h))
                    for h in (True, False)]
            res = run_bench(target, draft, ps, runs, **kw)
            van = res["methods"]["vanilla"]["tokens_per_second"]
            for h, r in zip((True, False), runs):
                points.append(_point(f"{'on' if h else 'off'}, {order}", res["methods"][r.label],
                                     van))
        return {"param": "history, order", "points": points}
    for n in values:  # length
        res = run_bench(target, draft, with_length(prompts, n),
                        [MethodRun("ouroboros", "ouroboros", base)], **kw)
        points.append(_point(n, res["methods"]["ouroboros"],
                             res["methods"]["vanilla"]["tokens_per_second"]))
    return {"param": "max_new_tokens", "points": points}


def run_sweeps(target, draft, prompts, names, *, quick=False, overrides=None, ignore_eos=False,
               log=None) -> dict:
    """{sweep name: `sweep`'s result} for each of `names`, in order."""
    out = {}
    for n in names:
        if log:
            log(f"[bench] sweep {n} ...")
        out[n] = sweep(n, target, draft, prompts, quick=quick, overrides=overrides,
                       ignore_eos=ignore_eos, log=log)
    return out
