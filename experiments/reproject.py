"""What would a saved bench run's counted forwards cost on other model shapes and devices?
Result: docs/accelerators.md (the "H100, Qwen 1.5B/0.5B shapes" column).

Re-projected with the roofline of ouroboros_jax/bench/accelerator.py, printed as a markdown
table.

    python -m experiments.reproject runs/bench/results.json \\
        --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --project h100

METHOD@auto rows are priced by the configs auto ran in that run's calls (their
`per_call` choices), named after them; the run's own CPU validation error is printed
beside each row. The counts (target forwards, draft forwards, their sizes, the prompts)
are the saved run's; the shapes are the presets' (`models/presets.py`): what the same counts
would cost on that pair, a projection twice over (the counts belong to the pair that ran).
"""

from __future__ import annotations

import argparse
import json

from ouroboros_jax.bench.accelerator import accelerator, projection_rows, with_cpu_validation
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.models.presets import PRESETS


def configs_of(results: dict) -> dict:
    """{method label: its config object} of a saved bench results dict (as run); "auto" for a
    METHOD@auto row (priced by what auto chose per call, bench/auto_rows.py)."""
    out = {}
    for label, r in results["methods"].items():
        spec = METHODS.get(r.get("method"))
        if r.get("kind") != "oj" or spec is None:
            continue
        cfg = r.get("config")
        if cfg == {"auto": True}:
            out[label] = "auto"
            continue
        out[label] = (spec.config_type(**cfg) if isinstance(cfg, dict) and "repr" not in cfg
                      else None)
    return out


def main(argv=None) -> list:
    """The re-projected rows, one per device and method, also printed as a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a bench results.json")
    ap.add_argument("--target", required=True, choices=sorted(PRESETS))
    ap.add_argument("--draft", choices=sorted(PRESETS))
    ap.add_argument("--project", action="append", default=[], metavar="DEVICE")
    ap.add_argument("--context", type=int, default=None,
                    help="cached tokens the forwards see (default: the saved cost model's)")
    a = ap.parse_args(argv)
    try:
        devices = [accelerator(n) for n in (a.project or ["h100"])]
    except ValueError as e:
        ap.error(str(e))
    with open(a.results) as f:
        results = json.load(f)
    context = a.context if a.context is not None else int(
        (results.get("cost_model") or {}).get("latency", {}).get("context", 512))
    configs = configs_of(results)
    configs["vanilla"] = None
    # the saved run's own CPU validation (its latency table's price vs its measured time)
    cpu = (results.get("cost_model") or {}).get("rows") or []
    rows = []
    for acc in devices:
        _, prows = projection_rows(results, configs, acc, PRESETS[a.target],
                                   PRESETS[a.draft] if a.draft else None, context)
        for r in with_cpu_validation(prows, cpu):
            rows.append({"device": acc.name, "method": r["method"], "ran": r["ran"],
                         "ran_parts": r["ran_parts"], "target_calls": r["target_calls"],
                         "draft_forwards": r["draft_forwards"], "n_target": r["n_target"],
                         "n_draft": r["n_draft"], "measured_speedup": r["measured_speedup"],
                         "projected_speedup": r["predicted_speedup"],
                         "cpu_error": r["cpu_error"]})
    print(f"PROJECTION (not a measurement): counts of {a.results}, shapes {a.target}"
          + (f" / {a.draft}" if a.draft else "") + f", {context} cached tokens")
    print("| device | method (config it ran) | target calls | draft forwards | n_T | n_S | "
          "measured speedup (the run's own) | the run's CPU model error | projected speedup |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ms, err = r["measured_speedup"], r["cpu_error"]
        ms = "–" if ms is None else f"{ms:.3g}×"
        err = "–" if err is None else f"{err:+.1%}"
        print(f"| {r['device']} | {r['ran']} | {r['target_calls']} | {r['draft_forwards']} "
              f"| {r['n_target']} | {r['n_draft']} | {ms} | {err} "
              f"| {r['projected_speedup']:.3g}× |")
    return rows


if __name__ == "__main__":
    main()
