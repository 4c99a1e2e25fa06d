"""Does `config="auto"` pay its way against a grid of explicit configs? Result:
docs/bench/auto_check.md (raw: docs/bench/auto_check_*.json).

Auto's choice against a stated grid of explicit configs, from the second call on, with the
wall clock as the judge.

    python -m experiments.auto_check --workload demo --calls 2 --max-new-tokens 64
    python -m experiments.auto_check --workload smollm2 --calls 2
    python -m experiments.auto_check --workload real --calls 2 --prompts 1

Workloads: `demo` (the shipped demo pair: every method), `smollm2` (SmolLM2-135M GGUF, no draft:
lookahead and prompt lookup), `real` (Qwen2.5-Coder 1.5B / 0.5B GGUFs: speculative and
Ouroboros). The GGUFs are read from --gguf-dir (default ~/.cache/ouroboros-real, see
docs for the fetch script); nothing is downloaded.

One process, two fresh auto stores (temp dirs as $OUROBOROS_JAX_CACHE): one for auto's calls,
as a user of the defaults has, one for the grid's explicit calls (which teach prices and the
pair's agreement too). Every config of the
grid and auto make their first (compiling) calls first, one per prompt bucket; then `--calls`
passes over the prompts, each pass running vanilla, every grid config and auto in turn on the
same prompt (interleaved, so load from other processes falls on all alike), timed by the wall
clock around `generate`.
Reported per method: each config's tokens/s, its ratio to vanilla and the one the cost model
predicts (`pred x`, at auto's final tables and agreement: its ranking of the grid), auto's
chosen config and its ratio to the grid's best (the gate is 0.95), with the run's noise beside
it (`noise`), and per config the cost model's price of its calls
(auto's learned tables: `auto.latency_tables`, `auto.call_parts`) against their measured loop
time (the gate is within 10%), and auto's stats' tokens/s against the wall clock's (within 5%).
Every output is checked against vanilla's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# The grids auto is judged against, per method: explicit configs (field dicts).
GRIDS = {
    "speculative": [{"gamma": g} for g in (1, 2, 3, 4, 6)],
    "ouroboros": [dict(gamma=g, window=2, ngram=3, guesses=2, suffixes=1, phrase_drafting=False,
                       lengthening=False, recycling=False) for g in (2, 4)]
                 + [dict(gamma=4, window=4, ngram=3, guesses=4, suffixes=2)],
    "lookahead": [dict(window=w, ngram=n, guesses=w) for w, n in ((2, 3), (4, 3), (4, 5))],
    "prompt_lookup": [dict(candidates=c, length=n) for c, n in ((1, 4), (2, 4), (1, 8))],
}
# The real pair's forwards take 0.1-0.3 s on a 2-core CPU: a smaller grid, around what tune finds.
REAL_GRIDS = {"speculative": [{"gamma": g} for g in (2, 4, 6)],
              "ouroboros": [GRIDS["ouroboros"][1], GRIDS["ouroboros"][2]]}
WORKLOADS = {"demo": ("speculative", "ouroboros", "lookahead", "prompt_lookup"),
             "smollm2": ("lookahead", "prompt_lookup"),
             "real": ("speculative", "ouroboros")}
GGUFS = {"real": ("qwen2.5-coder-1.5b-instruct-q4_k.gguf", "qwen2.5-coder-0.5b-instruct-q4.gguf"),
         "smollm2": ("smollm2-135m-instruct-q4_1.gguf", None)}
CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n    \"\"\"Check whether n is a prime number.\"\"\"\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
]


def load(workload: str, gguf_dir: str):
    """(target, draft or None, prompt texts) of a workload."""
    import ouroboros_jax as oj

    if workload == "demo":
        t, d = oj.demo_pair("float32")
        return t, d, [p["text"] for p in oj.demo_prompts()]
    tname, dname = GGUFS[workload]
    t = oj.load_model(os.path.join(gguf_dir, tname), dtype="float32")
    d = oj.load_model(os.path.join(gguf_dir, dname), dtype="float32") if dname else None
    return t, d, CODE_PROMPTS


def auto_view(target, draft, method, slots) -> tuple:
    """(target table, draft table or None, agreement or None): what auto prices `method` with
    now, its learned scales included; without a draft, the rate the method's calls realised
    (prompt lookup's copy hit rate), else None (its prior)."""
    from ouroboros_jax.auto import default_tuner
    from ouroboros_jax.decoding import METHODS

    auto = default_tuner()
    used_draft = method != "vanilla" and METHODS[method].needs_draft
    tt, td, _ = auto.prices.latency_tables(target, draft if used_draft else None, 1, slots)
    if used_draft:
        return tt, td, auto.agreement.known_agreement(target, draft)
    learns = method != "vanilla" and METHODS[method].learn is not None
    return tt, td, auto.agreement.realised_agreement(target, None, method) if learns else None


def price(target, draft, method, cfg, stats, prompt_width, slots) -> float:
    """The cost model's seconds for a finished call's counted forwards, at auto's tables now,
    times the factor auto's own calls of the method taught (`auto.method_factor`)."""
    from ouroboros_jax.auto import default_tuner
    from ouroboros_jax.auto.prices import call_parts
    from ouroboros_jax.decoding import METHODS

    auto = default_tuner()
    x_t, x_s = call_parts(method, cfg, stats, prompt_width,
                               *auto_view(target, draft, method, slots))
    used = draft if method != "vanilla" and METHODS[method].needs_draft else None
    return (x_t + x_s) * auto.prices.method_factor(target, used, 1, method)[0]


def predicted(target, draft, method, cfg, slots) -> float:
    """The cost model's speedup over vanilla for one config at auto's tables, agreement and
    method factor now (what auto weighs when it chooses: its ranking of the grid)."""
    from ouroboros_jax.auto import default_tuner
    from ouroboros_jax.auto.choice import predicted_speedup

    auto = default_tuner()
    tt, td, a = auto_view(target, draft, method, slots)
    f = 1.0 if method == "vanilla" else auto.prices.relative_factor(target, draft, 1, method)[0]
    return predicted_speedup(method, cfg, tt, td, a, f)


def run(workload: str, calls: int, prompts_n: int, max_new_tokens: int, gguf_dir: str) -> dict:
    import ouroboros_jax as oj
    from ouroboros_jax.auto import default_tuner, wait_for_background
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.heap import freeze_heap
    from ouroboros_jax.request import cache_slots, pad_prompts, prompt_bucket

    # auto learns in a store of its own, as a user who runs the defaults does: the grid's
    # explicit calls teach their prices and the pair's agreement by depth too, and in one
    # shared store auto's first call found the pair already measured by the grid's calls (no
    # exploring) and its prices learned from configs it never ran
    stores = {"grid": tempfile.mkdtemp(prefix="oj_auto_check_grid_"),
              "auto": tempfile.mkdtemp(prefix="oj_auto_check_auto_")}
    os.environ["OUROBOROS_JAX_CACHE"] = stores["auto"]
    t0 = time.perf_counter()
    target, draft, texts = load(workload, gguf_dir)
    load_s = time.perf_counter() - t0
    texts = texts[:prompts_n]
    ids = [list(target.tokenizer(t)["input_ids"]) for t in texts]
    width = pad_prompts(ids)[0].shape[1]
    slots = cache_slots(width, max_new_tokens, 0)
    runs = {("vanilla", "vanilla"): dict(method="vanilla", config=None, cfg=None)}
    for m in WORKLOADS[workload]:
        spec = METHODS[m]
        for fields in (REAL_GRIDS if workload == "real" else GRIDS)[m]:
            cfg = spec.config_type(**fields)
            runs[(m, repr(cfg))] = dict(method=m, config=cfg, cfg=cfg)
        runs[(m, "auto")] = dict(method=m, config="auto", cfg=None)
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=-1)

    def call(r, i):
        d = draft if r["method"] != "vanilla" and METHODS[r["method"]].needs_draft else None
        os.environ["OUROBOROS_JAX_CACHE"] = stores["auto" if r["config"] == "auto" else "grid"]
        c0, w0 = default_tuner().compiles.programs, time.perf_counter()
        out = oj.generate(target, [ids[i]], draft=d, method=r["method"],
                          config=r["config"] if r["method"] != "vanilla" else None, **kw)
        if r["config"] == "auto":
            # a loop auto compiles in the background is waited out here and charged whole to
            # the auto call that started it: interleaved, it would otherwise slow the next
            # rows' timed calls (on the demo pair, lookahead's and prompt lookup's vanilla rows
            # lost 9% to Ouroboros auto's compile)
            wait_for_background()
        # compiles in the call's thread or in the background
        return out, time.perf_counter() - w0, default_tuner().compiles.programs - c0

    from tqdm import tqdm

    # first calls, one per prompt bucket (each compiles its loop at that prompt shape; auto's
    # first also calibrates and measures the pair): a config's first call on a new bucket in
    # a timed pass would charge it a compile that a config compiled before it at that shape
    # (auto choosing a grid config) does not pay
    shapes = sorted({prompt_bucket(len(x)): i for i, x in reversed(list(enumerate(ids)))}.values())
    bar = tqdm(total=len(runs) * (len(shapes) + calls * len(ids)), unit="call",
               file=sys.stderr, desc=f"auto_check {workload}: first calls", dynamic_ncols=True)
    first = {}
    for key, r in runs.items():
        for i in shapes:
            out, wall, _ = call(r, i)
            first.setdefault(key, wall)
            bar.update(1)
    bar.set_description(f"auto_check {workload}: timed passes")
    # a full GC pass walks the 420k objects of the imports and models (0.28 s on 0.3 s demo
    # calls): frozen after warm-up, as the server's heap is (heap.py)
    freeze_heap()
    rec = {key: [] for key in runs}
    compiled = {key: [] for key in runs}
    for _ in range(calls):
        for i in range(len(ids)):
            for key, r in runs.items():
                out, wall, n = call(r, i)
                rec[key].append((i, out, wall))
                compiled[key].append(n)
                bar.update(1)
    bar.close()
    os.environ["OUROBOROS_JAX_CACHE"] = stores["auto"]  # the prices below are auto's
    ref = {i: o.tokens for i, o, _ in rec[("vanilla", "vanilla")]}
    rows = []
    for key, r in runs.items():
        new = sum(o.stats["new_tokens"] for _, o, _ in rec[key])
        wall = sum(w for _, _, w in rec[key])
        stats_s = sum(o.stats["seconds"] for _, o, _ in rec[key])
        ran = [(o.stats.get("auto") or {}) for _, o, _ in rec[key]]
        m, cfg = r["method"], r["cfg"]
        if r["config"] == "auto":
            a = ran[-1]
            m = a["method"]
            ct = METHODS[r["method"]].config_type
            cfg = None if a["config"] is None else eval(a["config"], {ct.__name__: ct})
        priced = sum(price(target, draft, m, cfg, o.stats, width, slots) for _, o, _ in rec[key])
        loop = sum(o.stats["decode_seconds"] for _, o, _ in rec[key])
        rows.append({"method": r["method"], "config": key[1] if r["config"] != "auto" else
                     f"auto -> {ran[-1]['config'] or 'vanilla'}",
                     "auto_configs": sorted({a.get("config") or "vanilla" for a in ran})
                     if r["config"] == "auto" else None,
                     "auto_reasons": [a.get("reason") for a in ran] if r["config"] == "auto"
                     else None,
                     "tokens_per_second": new / wall, "stats_tokens_per_second": new / stats_s,
                     "first_call_s": first[key], "priced_over_measured": priced / loop,
                     "predicted_x_vanilla": predicted(target, draft, m, cfg, slots),
                     # auto's own host time per call (its choice, store reads and writes)
                     "auto_ms_per_call": 1e3 * sum(a.get("seconds", 0.0) for a in ran)
                     / len(ran),
                     "identical": all(o.tokens == ref[i] for i, o, _ in rec[key]),
                     "eta": new / max(sum(o.stats["target_calls"] for _, o, _ in rec[key]), 1)})
    for x, key in zip(rows, runs):
        x["pass_tokens_per_second"] = per_pass(rec[key], len(ids))
        x["median_call_tokens_per_second"] = median_calls(rec[key])
        # each timed call: [prompt, wall seconds, compiles during it (any thread)]
        x["calls"] = [[i, round(w, 3), n] for (i, _, w), n in zip(rec[key], compiled[key])]
    van = next(x for x in rows if x["method"] == "vanilla")["tokens_per_second"]
    for x in rows:
        x["x_vanilla"] = x["tokens_per_second"] / van
    for m in WORKLOADS[workload]:
        mine = [x for x in rows if x["method"] == m]
        grid = [x for x in mine if not x["config"].startswith("auto")]
        top = max(grid, key=lambda x: x["tokens_per_second"])
        best = top["tokens_per_second"]
        best_median = max(x["median_call_tokens_per_second"] for x in grid)
        for x in mine:
            if x["config"].startswith("auto"):
                x["auto_over_best"] = x["tokens_per_second"] / best
                x["auto_over_best_median_calls"] = x["median_call_tokens_per_second"] / best_median
                x.update(noise(x, top, grid))
                # auto ran vanilla: judged against vanilla too
                if x["config"].endswith("vanilla"):
                    x["auto_over_vanilla"] = x["x_vanilla"]
    return {"workload": workload, "calls": calls, "prompts": len(ids),
            "max_new_tokens": max_new_tokens, "load_seconds": load_s, "rows": rows}


def per_pass(calls: list, prompts: int) -> list:
    """Tokens/s of each pass over the prompts (calls in order, `prompts` per pass)."""
    out = []
    for p in range(0, len(calls), prompts):
        chunk = calls[p:p + prompts]
        out.append(sum(o.stats["new_tokens"] for _, o, _ in chunk) / sum(w for _, _, w in chunk))
    return out


def median_calls(calls: list) -> float:
    """Tokens/s with each prompt's call at its median wall time over the passes: a call the
    machine stalled (2.2x its row's median, in every row alike, late in a run) moves it no
    more than any other; what every call of a row pays (auto's own work) stays in it."""
    import statistics

    by = {}
    for i, o, w in calls:
        by.setdefault(i, []).append((w, o.stats["new_tokens"]))
    return (sum(statistics.median(n for _, n in v) for v in by.values())
            / sum(statistics.median(w for w, _ in v) for v in by.values()))


def noise(auto_row: dict, top: dict, grid: list) -> dict:
    """How far the run's noise reaches, beside auto/best: auto over the best row pass by pass
    (median, lowest, highest: the passes interleave every row, so each pass is a paired
    comparison), and auto over the grid row of the config it ran, where the grid has it (the
    same compiled loop timed as two rows: what two measurements of one thing differ by)."""
    pairs = sorted(a / b for a, b in zip(auto_row["pass_tokens_per_second"],
                                         top["pass_tokens_per_second"]))
    mid = len(pairs) // 2
    median = pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2
    ran = auto_row["config"].split("auto -> ", 1)[1]
    same = [x for x in grid if x["config"].split("(")[0] == ran.split("(")[0]
            and _fields(x["config"]) >= _fields(ran)]
    return {"auto_over_best_by_pass": {"median": median, "low": pairs[0], "high": pairs[-1]},
            "auto_over_same_config": (auto_row["tokens_per_second"] / same[0]["tokens_per_second"]
                                      if same else None)}


def _fields(text: str) -> set:
    """The field=value pairs of a config's repr (auto's repr names only the knobs it sets)."""
    inner = text.split("(", 1)[1].rstrip(")") if "(" in text else ""
    return {f.strip() for f in inner.split(",") if "=" in f}


def table(res: dict) -> str:
    out = [f"workload {res['workload']}: {res['prompts']} prompts x {res['calls']} passes, "
           f"{res['max_new_tokens']} new tokens, B=1, greedy; tokens/s by the wall clock",
           f"{'method':<14}{'config':<62}{'tok/s':>7}{'x van':>7}{'eta':>6}{'price/meas':>11}"
           f"{'pred x':>7}{'stats/wall':>11}{'auto/best':>10}  same"]
    for x in res["rows"]:
        ob = x.get("auto_over_best")
        out.append(f"{x['method']:<14}{x['config'][:61]:<62}{x['tokens_per_second']:>7.2f}"
                   f"{x['x_vanilla']:>7.2f}{x['eta']:>6.2f}{x['priced_over_measured']:>11.2f}"
                   f"{x.get('predicted_x_vanilla', float('nan')):>7.2f}"
                   f"{x['stats_tokens_per_second'] / x['tokens_per_second']:>11.3f}"
                   f"{'' if ob is None else f'{ob:.2f}':>10}  {x['identical']}")
    for x in res["rows"]:
        if "auto_over_best_by_pass" in x:
            bp, same = x["auto_over_best_by_pass"], x["auto_over_same_config"]
            out.append(f"{x['method']}: auto/best {x['auto_over_best']:.2f} (each row's calls at "
                       f"their median: {x['auto_over_best_median_calls']:.2f}); pass by pass median "
                       f"{bp['median']:.2f} ({bp['low']:.2f}-{bp['high']:.2f}); auto over the "
                       "grid row of its own config "
                       + ("(not in the grid)" if same is None else f"{same:.2f}"))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="demo")
    ap.add_argument("--calls", type=int, default=2, help="timed passes after the first calls")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gguf-dir", default=os.path.expanduser("~/.cache/ouroboros-real"))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    for name in ("calls", "prompts", "max_new_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    res = run(a.workload, a.calls, a.prompts, a.max_new_tokens, a.gguf_dir)
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
