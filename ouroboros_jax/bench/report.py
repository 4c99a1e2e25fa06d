"""Bench output: the markdown table and the PNG plots (matplotlib, Agg backend) of a results dict.

Plots (each written only when its data is present):
  speedup_by_task.png     speedup vs vanilla per task and method (paper Figure 5 style)
  acceptance_hist.png     tokens accepted per target forward, per method
  pool_growth.png         pool occupancy after each call (methods with a pool)
  ablation.png            tokens/s of the Table 4 ablation steps
  sweep_<name>.png        tokens/s and eta against the swept value (K: paper Figure 6)
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def markdown(results: dict) -> str:
    env = results["environment"]
    st = results["settings"]
    lines = []
    tgt, dft = st["target"], st.get("draft")
    lines.append(f"Target {tgt['params'] / 1e6:.1f}M params ({tgt['layers']} layers)"
                 + (f", draft {dft['params'] / 1e6:.1f}M ({dft['layers']} layers)" if dft else "")
                 + f"; {env.get('cpu_model') or env.get('platform')}, {env.get('cpus')} CPUs, "
                 f"jax {env.get('jax')} ({env.get('jax_backend')}), torch {env.get('torch')}, "
                 f"transformers {env.get('transformers')}; greedy, batch 1, "
                 f"{st['repeats']} repeat(s); tasks "
                 + ", ".join(f"{k} ×{v}" for k, v in results["workload"]["tasks"].items()) + ".")
    lines.append("")
    proj = projected_speedups(results)  # {column title: {method: projected speedup}}
    lines.append("| method | tokens/s | speedup | η | c | pool hit | compile s | peak RSS MiB "
                 "| identical to vanilla |" + "".join(f" {t} |" for t in proj))
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(proj))
    for label, s in results["methods"].items():
        lines.append(
            f"| {label} | {_f(s['tokens_per_second'], '{:.1f}')} | "
            f"{_f(s.get('speedup'), '{:.3g}×')} | {_f(s.get('eta'))} | {_f(s.get('c'))} | "
            f"{_f(s.get('pool_hit_rate'), '{:.0%}')} | {_f(s['compile_seconds'], '{:.1f}')} | "
            f"{_f(s['peak_rss_mib'], '{:.0f}')} | "
            f"{'yes' if s['identical'] else 'NO (' + str(len(s['mismatches'])) + ' differ)'} |"
            + "".join(f" {_f(col.get(label), '{:.3g}×')} |" for col in proj.values()))
    if proj:
        lines.append("")
        lines.append("Projected columns: PROJECTIONS, not measurements: the same counted "
                     "forwards priced with flat latencies (a forward costs its model's "
                     "parameters, whatever its size) or with a bf16 roofline of the device "
                     "(bench/accelerator.py); see the cost model section below.")
    tasks = list(results["workload"]["tasks"])
    if len(tasks) > 1:
        lines.append("")
        lines.append("Speedup vs vanilla per task:")
        lines.append("")
        lines.append("| method | " + " | ".join(tasks) + " |")
        lines.append("|---|" + "---:|" * len(tasks))
        for label, s in results["methods"].items():
            cells = [_f(s["per_task"].get(t, {}).get("speedup"), "{:.2f}×") for t in tasks]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cm = results.get("cost_model")
    if cm and cm.get("rows"):
        lines.append("")
        lines.append(f"Cost model (latency table: {cm['latency'].get('note', '')}, after "
                     f"{cm['latency'].get('context')} cached tokens; forwards and prefill only, "
                     "per-round work outside the forwards left out):")
        lat = cm["latency"]
        fmt = lambda d: ", ".join(f"{k}: {float(v) * 1e3:.2f}" for k, v in  # noqa: E731
                                  sorted(d.items(), key=lambda kv: int(kv[0])))
        lines.append("")
        lines.append(f"ms per forward by input tokens — target {fmt(lat['target'])}"
                     + (f"; draft {fmt(lat['draft'])}" if lat.get("draft") else "") + ".")
        if lat.get("target_prefill"):
            lines.append(f"ms per prefill by prompt bucket — target "
                         f"{fmt(lat['target_prefill'])}"
                         + (f"; draft {fmt(lat['draft_prefill'])}"
                            if lat.get("draft_prefill") else "") + ".")
        lines.append("")
        wb = {r["method"]: r["predicted_speedup"]
              for r in (cm.get("weights_bound") or {}).get("rows", [])}
        lines.append("| method | n_T | n_S | target calls | draft forwards | predicted s | "
                     "measured s | measured / predicted | predicted speedup | measured speedup "
                     "| weights-bound prediction |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in cm["rows"]:
            ratio = (r["measured_seconds"] / r["predicted_seconds"]
                     if r.get("measured_seconds") and r.get("predicted_seconds") else None)
            lines.append(f"| {r.get('ran', r['method'])} | {r['n_target']} | {r['n_draft']} | "
                         f"{r['target_calls']} | {r['draft_forwards']} | "
                         f"{_f(r.get('predicted_seconds'), '{:.3f}')} | "
                         f"{_f(r.get('measured_seconds'), '{:.3f}')} | {_f(ratio, '{:.3f}')} | "
                         f"{_f(r['predicted_speedup'], '{:.3g}×')} | "
                         f"{_f(r['measured_speedup'], '{:.3g}×')} | "
                         f"{_f(wb.get(r['method']), '{:.3g}×')} |")
        if wb:
            lines.append("")
            lines.append("Weights-bound prediction: the same counted forwards priced as on an "
                         "accelerator at batch 1, where a forward costs its model's parameter "
                         "bytes whatever its input size (draft/target = "
                         f"{cm['weights_bound']['latency']['draft'].get('1', 0):.3f}); "
                         "prefill and per-round work left out. A prediction, not a measurement.")
        if cm.get("validation"):
            lines += ["", cm["validation"]["summary"] + "."]
        for name, pj in (cm.get("projections") or {}).items():
            lines += projection_lines(name, pj, cm.get("validation"), fmt)
    for name, sw in (results.get("sweeps") or {}).items():
        lines.append("")
        lines.append(f"Sweep `{name}`:")
        lines.append("")
        lines.append(f"| {sw['param']} | tokens/s | speedup | η | identical |")
        lines.append("|---|---:|---:|---:|---|")
        for p in sw["points"]:
            lines.append(f"| {p['value']} | {_f(p['tokens_per_second'], '{:.1f}')} | "
                         f"{_f(p.get('speedup'), '{:.3g}×')} | {_f(p.get('eta'))} | "
                         f"{'yes' if p.get('identical') else 'NO'} |")
    if results.get("skipped"):
        lines.append("")
        for k, v in results["skipped"].items():
            lines.append(f"- skipped {k}: {v}")
    lines.append("")
    lines.append("tokens/s exclude compilation (reported separately); speedup is tokens/s "
                 "over this project's vanilla on the same prompts in the same run; η = tokens "
                 "per target forward; c = draft tokens per draft forward.")
    return "\n".join(lines) + "\n"


def projection_lines(name: str, pj: dict, validation: Optional[dict], fmt) -> list[str]:
    """The projection onto one device, every row beside its CPU validation: the config it ran
    (METHOD@auto: what auto chose), its counts, its measured CPU time against the CPU cost
    model's price of the same counts and the relative error, the measured CPU speedup and the
    projected one; then how many rows the CPU model predicts within the tolerance."""
    lat = pj["latency"]
    up = name.upper()
    lines = ["", f"Projection onto {up} ({lat['note']}; figures: {pj['source']}). ms per bf16 "
             f"forward by input tokens — target {fmt(lat['target'])}"
             + (f"; draft {fmt(lat['draft'])}" if lat.get("draft") else "") + ".", "",
             "| method (config it ran) | target calls | draft forwards | measured CPU s | "
             "CPU model s | CPU model error | measured CPU speedup | "
             f"projected {up} speedup |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in pj["rows"]:
        lines.append(f"| {r.get('ran', r['method'])} | {r['target_calls']} | "
                     f"{r['draft_forwards']} | {_f(r.get('cpu_measured_seconds'), '{:.3f}')} | "
                     f"{_f(r.get('cpu_predicted_seconds'), '{:.3f}')} | "
                     f"{_f(r.get('cpu_error'), '{:+.1%}')} | "
                     f"{_f(r.get('measured_speedup'), '{:.3g}×')} | "
                     f"{_f(r['predicted_speedup'], '{:.3g}×')} (projection) |")
    lines.append("")
    lines.append(f"{up} column: a PROJECTION of the counted forwards, not a measurement. CPU "
                 "model s: the same counts priced with this CPU's timed forwards "
                 "(bench/cost_model.py); CPU model error: measured / predicted - 1, the "
                 "projection's validation where it can be checked. METHOD@auto rows are "
                 "priced by the configs auto ran, and their measured time includes what auto "
                 "compiled or probed during the calls.")
    if validation:
        lines.append(validation["summary"] + ".")
    return lines


def projected_speedups(results: dict) -> dict:
    """{column title: {method label: projected speedup}} of a results dict's cost model:
    flat latencies (`weights_bound`) and each `--project` device; empty without a cost model."""
    cm = results.get("cost_model") or {}
    cols = {}
    wb = (cm.get("weights_bound") or {}).get("rows")
    if wb:
        cols["flat-latency projection"] = {r["method"]: r["predicted_speedup"] for r in wb}
    for name, pj in (cm.get("projections") or {}).items():
        cols[f"{name.upper()} projection"] = {r["method"]: r["predicted_speedup"]
                                              for r in pj["rows"]}
    return cols


def plots(results: dict, out_dir: str) -> list[str]:
    """Writes the PNGs into out_dir; returns their paths ([] when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    methods = results["methods"]
    tasks = list(results["workload"]["tasks"])
    labels = [m for m in methods if m != "vanilla"]
    if labels:
        width = min(14, max(6, 0.35 * len(tasks) * (len(labels) + 1)))
        fig, ax = plt.subplots(figsize=(width, 4.5))
        w = 0.8 / len(labels)
        for i, m in enumerate(labels):
            ys = [methods[m]["per_task"].get(t, {}).get("speedup") or 0 for t in tasks]
            ax.bar([j + i * w for j in range(len(tasks))], ys, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks)
        ax.set_ylabel("speedup vs vanilla")
        ax.legend(fontsize=7)
        ax.set_title("Speedup per task")
        save(fig, "speedup_by_task.png")
    hists = {m: s["acceptance_histogram"] for m, s in methods.items()
             if s.get("acceptance_histogram") and m != "vanilla"}
    if hists:
        fig, ax = plt.subplots(figsize=(7, 4))
        for m, h in hists.items():
            tot = max(sum(h), 1)
            ax.plot(range(len(h)), [x / tot for x in h], marker="o", label=m)
        ax.set_xlabel("tokens accepted per target forward")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize=7)
        save(fig, "acceptance_hist.png")
    growth = {m: s["pool_growth"] for m, s in methods.items() if s.get("pool_growth")}
    if growth:
        fig, ax = plt.subplots(figsize=(7, 4))
        for m, g in growth.items():
            ax.plot(range(1, len(g) + 1), g, label=m)
        ax.set_xlabel("call (prompt/turn, in order)")
        ax.set_ylabel("pool phrases held")
        ax.legend(fontsize=7)
        save(fig, "pool_growth.png")
    abl = [m for m in methods if m.startswith("ablation:")]
    if abl:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(range(len(abl)), [methods[m]["tokens_per_second"] or 0 for m in abl])
        ax.set_xticks(range(len(abl)), [m.split(":", 1)[1] for m in abl], rotation=20,
                      fontsize=8)
        van = methods.get("vanilla", {}).get("tokens_per_second")
        if van:
            ax.axhline(van, color="k", lw=0.8, ls="--", label="vanilla")
            ax.legend(fontsize=7)
        ax.set_ylabel("tokens/s")
        ax.set_title("Ablation (paper Table 4)")
        save(fig, "ablation.png")
    for name, sw in (results.get("sweeps") or {}).items():
        pts = sw["points"]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [str(p["value"]) for p in pts]
        ax.plot(xs, [p["tokens_per_second"] or 0 for p in pts], marker="o", label="tokens/s")
        ax.set_xlabel(sw["param"])
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [p.get("eta") or 0 for p in pts], marker="s", color="C1", label="η")
        ax2.set_ylabel("η")
        ax.set_title(f"sweep: {name}")
        save(fig, f"sweep_{name}.png")
    return written


def bench_command() -> Optional[str]:
    """The `ouroboros-jax bench ...` command line this process runs (None: run otherwise)."""
    return "ouroboros-jax bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None


def write_json(path: str, obj) -> None:
    """obj as indented JSON at path."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_markdown(path: str, md: str) -> None:
    """Writes the table to `path` and prints it."""
    with open(path, "w") as f:
        f.write(md + "\n")
    print(md)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 120) -> str:
    """Lays `fig` out, writes it to `path` and closes it -> path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def write_all(results: dict, out_dir: str, make_plots: bool = True) -> dict:
    """results.json, results.md and the plots into out_dir -> {kind: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"),
             "markdown": os.path.join(out_dir, "results.md")}
    md = markdown(results)
    with open(paths["markdown"], "w") as f:
        f.write(md)
    if make_plots:
        paths["plots"] = plots(results, out_dir)
        results["plots"] = [os.path.basename(p) for p in paths["plots"]]
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    return paths


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
