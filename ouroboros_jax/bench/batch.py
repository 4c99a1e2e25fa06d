"""Throughput by batch size: every method at batch 1, 2, 4, ... on the same prompts.

    ouroboros-jax bench --batch-sizes 1,2,4,8,16 --demo-prompts --max-new-tokens 128

Speculation trades idle compute for fewer sequential target forwards. At batch 1 on an
accelerator that compute is free; at large batch, or on a CPU, it is not, and `config="auto"`
shrinks the trees or turns speculation off (the chosen config is reported per batch size).
A row of the table is one `generate` call of B prompts (the workload's prompts cycled), timed
after a warm-up call of the same shape; tokens are checked against vanilla's at the same batch.
"""

from __future__ import annotations

import time
from typing import Optional

from ..decoding import METHODS
from ..generate import generate
from .report import pyplot, save_figure
from .runner import encode
from .workloads import Prompt


def parse_batch_sizes(spec: str) -> list[int]:
    try:
        sizes = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be a comma-separated list of integers, got {spec!r}") from None
    if not sizes or any(b <= 0 for b in sizes):
        raise ValueError(f"--batch-sizes must be positive integers, got {spec!r}")
    return sorted(set(sizes))


def batch_throughput(target, draft, prompts: list[Prompt], methods: list[str], batch_sizes: list[int],
                     max_new_tokens: Optional[int] = None, config="auto", eos: Optional[int] = None,
                     log=None, repeats: int = 2) -> list[dict]:
    """[{method, batch, tokens_per_second, speedup, identical, auto}] for every method x batch.

    `config`: "auto" (default) or {method: config}. Vanilla runs first at each batch size; a
    method's speedup is its tokens/s over vanilla's at the same batch. Times are wall time of
    the whole call (auto's choice included), best of `repeats` after a warm-up call."""
    log = log or (lambda m: None)
    ids = [encode(target, p.turns[0]) for p in prompts]
    n_new = max_new_tokens or max(p.max_new_tokens for p in prompts)
    rows = []
    for B in batch_sizes:
        batch = [ids[i % len(ids)] for i in range(B)]
        for m in ["vanilla"] + [x for x in methods if x != "vanilla"]:
            spec = METHODS[m]
            if spec.needs_draft and draft is None:
                continue
            kw = {} if m == "vanilla" else {
                "config": config if isinstance(config, str) else config.get(m, "auto")}
            if spec.needs_draft:
                kw["draft"] = draft
            generate(target, batch, method=m, max_new_tokens=n_new, eos_token_id=eos, **kw)  # compile
            secs = float("inf")
            for _ in range(repeats):  # best of `repeats`: the least disturbed by other load
                t0 = time.perf_counter()
                out = generate(target, batch, method=m, max_new_tokens=n_new, eos_token_id=eos, **kw)
                secs = min(secs, time.perf_counter() - t0)
            tps = out.stats["new_tokens"] / secs
            if m == "vanilla":
                ref, van_tps = out, tps
            row = {"method": m, "batch": B, "tokens_per_second": tps, "speedup": tps / van_tps,
                   "identical": out.tokens == ref.tokens, "eta": out.stats["eta"],
                   "auto": out.stats.get("auto")}
            rows.append(row)
            chosen = (row["auto"] or {}).get("config") or (row["auto"] or {}).get("method") or ""
            log(f"[bench] batch {B:>3} {m:<12} {tps:8.1f} tok/s  {row['speedup']:.2f}x  {chosen}")
    return rows


def batch_markdown(rows: list[dict]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    sizes = sorted({r["batch"] for r in rows})
    by = {(r["method"], r["batch"]): r for r in rows}
    out = ["| method | " + " | ".join(f"batch {b}" for b in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for m in methods:
        cells = []
        for b in sizes:
            r = by.get((m, b))
            if r is None:
                cells.append("–")
                continue
            a = r.get("auto") or {}
            note = " (vanilla)" if a.get("method") == "vanilla" else ""
            same = "" if r["identical"] else " **differs**"
            cells.append(f"{r['tokens_per_second']:.0f} tok/s, {r['speedup']:.2f}×{note}{same}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_batch(rows: list[dict], path: str) -> str:
    """Throughput (tokens/s, all rows together) by batch size, one line per method."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["tokens_per_second"] for r in rs], marker="o", label=m)
        for r in rs:
            if (r.get("auto") or {}).get("method") == "vanilla":
                ax.annotate("off", (r["batch"], r["tokens_per_second"]), fontsize=7,
                            textcoords="offset points", xytext=(3, -9))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows per call)")
    ax.set_ylabel("tokens/s (all rows)")
    ax.set_title("Throughput by batch size (config=auto; 'off' = auto ran vanilla)")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
