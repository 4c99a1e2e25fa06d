"""`ouroboros-jax tune`: the paper's heuristic search (Algorithm 1, Appendix B).

One knob at a time, each chosen by measured wall time on a prompt sample (greedy output is the
same for every setting, so least time = most tokens/s), the others held at the values chosen so
far (or at middle values before they are chosen): first gamma, then W (with G = W), then N
(phrase length beta = N - 1), then K. Compilation is excluded (each candidate gets a warm-up
call). Prints a recipe usable as `OuroborosConfig(...)`; `--method` tunes the baselines the
same way (bench/README.md, "Tuner").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..decoding import METHODS
from ..decoding.knobs import recipe_of
from .pair import load_models
from .runner import MethodRun, run_method
from .suite import add_pair_and_prompt_args, workload_of_args
from .workloads import Prompt, load_workload


def tunable() -> dict:
    """{method: its config's knob space} for every registered method with knobs to search."""
    return {m: spec.knobs for m, spec in METHODS.items()
            if spec.knobs is not None and spec.knobs.searched}


def _grid(method: str, quick: bool = False) -> dict:
    """{knob: values} tune tries for the method (its knobs' `tune` or `quick` values)."""
    return tunable()[method].values("quick" if quick else "tune")


def _cfg(cur: dict, method: str = "ouroboros"):
    """The method's config at a point of the search (tie rules applied by the knob space)."""
    return tunable()[method].make(METHODS[method].config_type, cur)


def tune(target, draft, prompts: list[Prompt], grid=None, start=None, repeats: int = 1,
         eos: int = -1, log=None, method: str = "ouroboros") -> dict:
    """Algorithm 1 -> {"config": the method's config, "recipe": str, "trials": [...]}."""
    spaces = tunable()
    if method not in spaces:
        raise ValueError(f"method: tune knows {', '.join(sorted(spaces))}, not {method!r}")
    grid = {**_grid(method), **(grid or {})}
    cur = {**spaces[method].starts(), **(start or {})}
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    trials = []
    cache: dict = {}
    for knob in (k.field for k in spaces[method].searched):
        best = None
        for v in grid[knob]:
            cand = {**cur, knob: v}
            cfg = _cfg(cand, method)
            key = dataclasses.astuple(cfg)
            if key not in cache:
                s, _ = run_method(MethodRun("tune", method, cfg), target, draft, prompts,
                                  repeats=repeats, eos=eos)
                cache[key] = s
                trials.append({"knob": knob, **{k.field: getattr(cfg, k.field)
                                                for k in spaces[method].knobs},
                               "seconds": s["seconds"], "tokens_per_second":
                                   s["tokens_per_second"], "eta": s["eta"]})
                log(f"[tune] {method} {knob}={v}: {s['tokens_per_second']:.1f} tokens/s, "
                    f"eta {s['eta']:.2f} ({recipe_of(cfg)})")
            s = cache[key]
            if best is None or s["seconds"] < best[1]:
                best = (v, s["seconds"])
        cur[knob] = best[0]
    cfg = _cfg(cur, method)
    return {"config": cfg, "recipe": recipe_of(cfg), "trials": trials}


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny random pair, tiny grid")
    p.add_argument("--method", default="ouroboros", choices=sorted(tunable()),
                   help="which method's knobs to tune (default ouroboros)")
    add_pair_and_prompt_args(p)
    p.add_argument("--prompts-per-task", type=int, default=None,
                   help="sample size per task (default 4, --quick 2)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--length", action="append", metavar="TASK=N")
    p.add_argument("--grid", help='JSON, e.g. {"gamma": [4, 8], "suffixes": [1, 3]}')
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", help="write the trials and recipe here")
    p.add_argument("--quick-dir", help=argparse.SUPPRESS)


def tune_main(a) -> dict:
    """The CLI layer of `ouroboros-jax tune`: flags -> plain arguments of `tune`."""
    quick = a.quick
    per_task = a.prompts_per_task if a.prompts_per_task is not None else (2 if quick else 4)
    workload = workload_of_args(a, per_task)  # flag errors before any model loads
    target, draft, source = load_models(a.target, a.draft, dtype=a.dtype, quick=quick,
                                        quick_dir=a.quick_dir)
    if draft is None and METHODS[a.method].needs_draft:
        raise ValueError(f"--draft is required: {a.method} needs a draft model")
    prompts = load_workload(workload, quick)
    space = tunable()[a.method]
    grid = dict(_grid(a.method, quick))
    if a.grid:
        grid.update(json.loads(a.grid))
    start = space.starts(quick)
    for k, vs in grid.items():
        if start.get(k) not in vs:
            start[k] = vs[len(vs) // 2]
    print(f"[tune] models: {source}; {len(prompts)} prompts; grid {grid}", file=sys.stderr)
    res = tune(target, draft, prompts, grid=grid, start=start, repeats=a.repeats,
               method=a.method)
    print(res["recipe"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"method": a.method, "recipe": res["recipe"], "trials": res["trials"],
                       "config": dataclasses.asdict(res["config"])}, f, indent=1)
    return res
