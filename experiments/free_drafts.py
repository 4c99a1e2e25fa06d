"""Do Ouroboros' free drafts (issue 52) pay, and what is a free proposal worth by its match?
Result: docs/real-pair.md ("Free drafts").

One process, interleaved prompt by prompt (load from other processes falls on every config
alike), first call of each config outside the timings, then --reps passes; each config's
tokens/s over the passes after the first (calls 2 onward), its ratio to vanilla's in the same
run, eta, draft forwards per token, the free rounds' share, accepted tokens by source and,
for every free-drafts config, the free proposals' worth by match length r (free_offered,
free_would_accept: rounds and the tokens the proposal kept, free or drafted alike).

    python -m experiments.free_drafts --workload demo --prompts 6 --reps 2
    python -m experiments.free_drafts --workload real --prompts 2 --reps 2 --max-new-tokens 96

Workloads: `demo` (the shipped pair; prompts: its held-out code prompts, "code", and
copy-style prompts, "edit": a held-out snippet, a comment asking for it again with a change,
and its first line, which a base model continues by copying), `real` (the Qwen2.5-Coder
1.5B/0.5B GGUFs from --gguf-dir; "code": code-continuation prompts, "edit": the shipped code
rewrites in the chat template). Every output is checked against vanilla's. Each row also
carries its H200 projection (its counted forwards priced on the Qwen shapes' measured H200
latencies, `H200_QWEN_MS`: meaningful for the real pair), and

    python -m experiments.free_drafts --table RUN.json

prints a saved run as docs/real-pair.md's tables (rows, tokens by source and the forwards
they cost, free proposals by match length). Point OUROBOROS_JAX_CACHE at a fresh directory:
auto's rows learn in that store as a new user's calls would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REAL = ("qwen2.5-coder-1.5b-instruct-q4_k.gguf", "qwen2.5-coder-0.5b-instruct-q4.gguf")


def sd_step(gamma: int, ngram: int = 5, **kw):
    """Ouroboros' SD step (what auto ran on these pairs: phrase drafting, lengthening,
    recycling and context phrases off)."""
    from ouroboros_jax.decoding.ouroboros import OuroborosConfig

    return OuroborosConfig(gamma=gamma, window=2, ngram=ngram, guesses=2, suffixes=1,
                           phrase_drafting=False, lengthening=False, recycling=False,
                           context_phrases=False, **kw)


def configs(gamma: int, thresholds=(2, 3, 4)) -> dict:
    """{label: generate kwargs} of the run."""
    import dataclasses

    from ouroboros_jax.decoding.ouroboros import OuroborosConfig

    out = {"vanilla": {}, "speculative@auto": {"method": "speculative", "config": "auto"},
           "prompt_lookup@auto": {"method": "prompt_lookup", "config": "auto"},
           "ouroboros@auto": {"method": "ouroboros", "config": "auto"},
           f"ouro SD g{gamma}": {"method": "ouroboros", "config": sd_step(gamma)}}
    for thr in thresholds:
        out[f"ouro SD g{gamma} +free{thr}"] = {
            "method": "ouroboros", "config": sd_step(gamma, free_drafts=True, free_threshold=thr)}
    tree = OuroborosConfig(gamma=gamma, window=4, ngram=5, guesses=4, suffixes=2)
    out[f"ouro tree g{gamma}"] = {"method": "ouroboros", "config": tree}
    out[f"ouro tree g{gamma} +free3"] = {
        "method": "ouroboros", "config": dataclasses.replace(tree, free_drafts=True,
                                                             free_threshold=3)}
    return out


def demo_prompts(target, n: int) -> list[tuple[str, list[int]]]:
    from ouroboros_jax.demo_assets import demo_prompts as held_out

    tok = target.tokenizer
    texts = [p["text"] for p in held_out()]
    out = [("code", tok(t)["input_ids"]) for t in texts[:n]]
    for t in texts[-n:]:
        first = t.strip().splitlines()[0]
        edit = f"{t}\n    pass\n\n\n# The same code again, with clearer names:\n{first}\n"
        out.append(("edit", tok(edit)["input_ids"]))
    return out


def real_prompts(target, n: int) -> list[tuple[str, list[int]]]:
    from experiments.auto_check import CODE_PROMPTS
    from experiments.copy_heavy import chat_ids
    from ouroboros_jax.bench.workloads import code_rewrite_prompts

    tok = target.tokenizer
    out = [("code", list(tok(t)["input_ids"])) for t in CODE_PROMPTS[:n]]
    out += [("edit", chat_ids(target, p.turns[0])) for p in code_rewrite_prompts()[:n]]
    return out


# The Qwen2.5-Coder 1.5B / 0.5B shapes' forwards on one H200, ms by tokens per forward
# (docs/bench/device-h200.md, sections 1 and 4: bf16, batch 1, 512 cached tokens)
H200_QWEN_MS = {
    "target": {1: 7.21, 2: 10.17, 4: 8.52, 8: 8.95, 12: 9.66, 16: 9.03, 24: 8.07, 32: 9.1,
               48: 8.67, 64: 9.55, 96: 10.06, 128: 9.23, 192: 9.64, 256: 10.48},
    "draft": {1: 4.70, 2: 7.03, 4: 7.27, 8: 6.32, 12: 7.98, 16: 6.22, 24: 6.35, 32: 7.52,
              48: 7.71, 64: 6.44, 96: 8.34, 128: 6.8, 192: 7.42, 256: 7.9}}


def ran_config(label: str, kw: dict, st: dict):
    """(method, the config object a call ran): the asked one, or for a METHOD@auto row the
    one auto chose (its `stats["auto"]` recipe, evaluated back)."""
    from ouroboros_jax.decoding import METHODS

    method = kw.get("method", "vanilla")
    auto = st.get("auto")
    if kw.get("config") != "auto":
        return method, kw.get("config")
    if not auto or auto.get("config") is None:
        return auto.get("method", "vanilla") if auto else "vanilla", None
    m = auto["method"]
    t = METHODS[m].config_type
    return m, eval(auto["config"], {t.__name__: t})  # noqa: S307 (our own recipe string)


def projected_seconds(label: str, kw: dict, stats: list[dict], table: dict) -> float:
    """The counted forwards of a row's calls priced on a device's latency table (ms by
    tokens, `cost.interpolate`): each call's target forwards at its config's tree size, its
    draft forwards at the draft step's size and its catch-up forwards at their chunk (a
    projection: counts from this CPU, latencies from the device)."""
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.cost import interpolate

    total = 0.0
    for st in stats:
        method, cfg = ran_config(label, kw, st)
        if cfg is None:
            total += st["target_calls"] * interpolate(table["target"], 1)
            continue
        sizes = METHODS[method].forward_sizes(cfg)
        total += st["target_calls"] * interpolate(table["target"], sizes[0])
        catch = st.get("catch_up_forwards", 0)
        # (speculative counts its batch draft forwards as draft_calls)
        drafts = st.get("draft_forwards", st.get("draft_calls", 0) if METHODS[method].needs_draft
                        else 0)
        total += (drafts - catch) * interpolate(table["draft"], sizes[1])
        if catch:
            chunk = 1 + cfg.gamma + (cfg.ngram - 1 if cfg.lengthening else 0)
            total += catch * interpolate(table["draft"], chunk)
    return total / 1000.0


def worth_by_run(stats: list[dict]) -> list[list]:
    """[[r, rounds, tokens per round]] of the free proposals by match length, summed over calls."""
    top = max(len(s["free_offered"]) for s in stats)  # (calls of different ngram: padded)
    pad = lambda x: list(x) + [0] * (top - len(x))  # noqa: E731
    off = np.sum([pad(s["free_offered"]) for s in stats], axis=0)
    acc = np.sum([pad(s["free_would_accept"]) for s in stats], axis=0)
    return [[r, int(o), round(float(a) / max(o, 1), 3)] for r, (o, a) in enumerate(zip(off, acc))]


def tables(res: dict) -> str:
    """A saved run's rows and per-source counts as markdown (docs/real-pair.md's tables)."""
    import re

    n = res["max_new_tokens"]
    per_task = int((re.search(r"--prompts (\d+)", res["command"]) or [0, 6])[1])
    out = []
    for task, rows in res["tasks"].items():
        out += [f"**{task}** ({n} tokens a prompt)", "",
                "| row | x vanilla (passes) | eta | draft forwards / token | free rounds / rounds "
                "| H200 projection x vanilla | identical | auto ran |",
                "|---|---|---:|---:|---:|---:|---|---|"]
        for m, r in rows.items():
            free = (f"{r['free_rounds']} / {r['free_rounds'] + r['draft_rounds']}"
                    if "free_rounds" in r else "-")
            x = " / ".join(f"{v:.2f}" for v in r["x_vanilla"])
            out.append(f"| {m} | {x} | {r['eta']:.2f} | {r.get('draft_forwards_per_token', '-')} "
                       f"| {free} | {r['h200_x_vanilla']:.2f} | {r['identical']} "
                       f"| {r['auto'] or '-'} |")
        out.append("")
        src = [(m, r) for m, r in rows.items() if "accepted_from_draft_chain" in r]
        if src:
            out += ["| row | tokens | from the draft chain | from the pool | from the context "
                    "| the target's own | target forwards: drafted / free rounds "
                    "| draft forwards: drafting / catch-up |", "|---|---:|---:|---:|---:|---:|---|---|"]
            for m, r in src:
                # (runs saved before tokens and forwards were: every call ran n tokens)
                tok = r.get("tokens", n * per_task)
                rounds = r.get("target_calls", round(tok / r["eta"]))
                fr, dr = r.get("free_rounds", 0), r.get("draft_rounds")
                dfw = r.get("draft_forwards", round(r.get("draft_forwards_per_token", 0) * tok)
                            if "draft_forwards_per_token" in r else None)
                cu = r.get("catch_up_forwards", 0)
                out.append(
                    f"| {m} | {tok} | {r['accepted_from_draft_chain']} "
                    f"| {r.get('accepted_from_pool_phrases', 0)} "
                    f"| {r.get('accepted_from_prompt_lookup', 0)} | {rounds} "
                    f"| {dr if dr is not None else rounds} / {fr} "
                    f"| {dfw - cu if dfw is not None else '-'} / {cu} |")
            out.append("")
        for m, r in rows.items():
            if sum(o for _, o, _ in r.get("worth_by_run", [])):
                out += [f"{m}: free proposals by match length r", "",
                        "| r | rounds | share | tokens kept per round |", "|---:|---:|---:|---:|"]
                tot = sum(o for _, o, _ in r["worth_by_run"]) or 1
                out += [f"| {k} | {o} | {o / tot:.0%} | {w:.2f} |" for k, o, w in r["worth_by_run"]]
                out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.free_drafts",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("demo", "real"), default="demo")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per task")
    ap.add_argument("--reps", type=int, default=2, help="passes after the first call")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--thresholds", default="2,3,4",
                    help="free_threshold values of the SD step's free variants")
    ap.add_argument("--only", help="comma-separated labels to run (vanilla always)")
    ap.add_argument("--gguf-dir", default=os.path.expanduser("~/.cache/ouroboros-real"))
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--table", help="print a saved run's JSON as markdown tables, and stop")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(tables(json.load(f)))
        return 0

    from ouroboros_jax.generate import generate
    from ouroboros_jax.auto import wait_for_background, warming_up
    from ouroboros_jax.heap import freeze_heap
    from ouroboros_jax.request import bucket

    if args.workload == "demo":
        from ouroboros_jax.demo_assets import demo_pair

        target, draft = demo_pair()
        prompts = demo_prompts(target, args.prompts)
    else:
        from ouroboros_jax import load_model

        target, draft = (load_model(os.path.join(args.gguf_dir, f), dtype="float32")
                         for f in REAL)
        prompts = real_prompts(target, args.prompts)
    runs = configs(args.gamma, [int(t) for t in args.thresholds.split(",")])
    if args.only:
        keep = {"vanilla", *args.only.split(",")}
        runs = {k: v for k, v in runs.items() if k in keep}
    n = args.max_new_tokens
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    # first calls, one per prompt bucket (each compiles its loop at that shape), outside the
    # timings; auto's background compiles are waited out after each auto call
    firsts = sorted({bucket(len(p)): i for i, (_, p) in reversed(list(enumerate(prompts)))
                     }.values())
    for label, kw in runs.items():
        t = time.perf_counter()
        for i in firsts:
            with warming_up():
                generate(target, [prompts[i][1]], max_new_tokens=n, eos_token_id=-1,
                         **({"draft": draft} if kw else {}), **kw)
            wait_for_background()
        log(f"[free_drafts] {label}: first calls {time.perf_counter() - t:.1f} s")
    freeze_heap()
    P = len(prompts)
    secs = {m: np.zeros((args.reps, P)) for m in runs}
    outs = {m: [None] * P for m in runs}
    stats = {m: [None] * P for m in runs}
    for r in range(args.reps):
        for i, (_, p) in enumerate(prompts):
            for m, kw in runs.items():
                o = generate(target, [p], max_new_tokens=n, eos_token_id=-1,
                             **({"draft": draft} if kw else {}), **kw)
                wait_for_background()
                secs[m][r, i] = o.stats["seconds"]
                outs[m][i], stats[m][i] = o.tokens[0], o.stats
            log(f"[free_drafts] pass {r + 1}/{args.reps} prompt {i + 1}/{P}")
    res = {"command": "python -m experiments.free_drafts " + " ".join(argv or sys.argv[1:]),
           "workload": args.workload, "max_new_tokens": n, "reps": args.reps, "tasks": {}}
    for task in dict.fromkeys(t for t, _ in prompts):
        idx = [i for i, (t, _) in enumerate(prompts) if t == task]
        van = secs["vanilla"][:, idx].sum(axis=1)
        rows = {}
        for m in runs:
            st = [stats[m][i] for i in idx]
            tokens = sum(s["new_tokens"] for s in st)
            rounds = sum(s["target_calls"] for s in st)
            row = {"tok_s": round(tokens / float(np.median(secs[m][:, idx].sum(axis=1))), 2),
                   "x_vanilla": [round(float(x), 3) for x in van / secs[m][:, idx].sum(axis=1)],
                   "eta": round(tokens / max(rounds, 1), 3),
                   "identical": [outs[m][i] for i in idx] == [outs["vanilla"][i] for i in idx],
                   "auto": (st[-1].get("auto") or {}).get("config"),
                   "auto_per_call": [(s.get("auto") or {}).get("config") for s in st]}
            row["tokens"], row["target_calls"] = tokens, rounds
            # (an auto row's calls may run different methods: counters missing count 0)
            if any("draft_forwards" in s for s in st):
                row["draft_forwards"] = sum(s.get("draft_forwards", 0) for s in st)
                row["draft_forwards_per_token"] = round(row["draft_forwards"] / tokens, 3)
            for k in ("accepted_from_draft_chain", "accepted_from_pool_phrases",
                      "accepted_from_prompt_lookup", "free_rounds", "draft_rounds",
                      "free_tokens_accepted", "catch_up_forwards"):
                if any(k in s for s in st):
                    row[k] = sum(s.get(k, 0) for s in st)
            if any("free_offered" in s for s in st):
                row["worth_by_run"] = worth_by_run([s for s in st if "free_offered" in s])
            row["h200_projected_s"] = projected_seconds(m, runs[m], st, H200_QWEN_MS)
            rows[m] = row
        base = rows["vanilla"]["h200_projected_s"]
        for row in rows.values():
            row["h200_x_vanilla"] = round(base / row["h200_projected_s"], 3)
        res["tasks"][task] = rows
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
