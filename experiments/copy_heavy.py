"""Do the methods (and a mechanism switch) pay on copy-heavy chat requests? Result:
docs/methods.md ("Ouroboros": context phrases on copy-heavy requests).

Copy-heavy chat requests, one prompt per call as a user makes it: vanilla vs the other
methods interleaved prompt by prompt, repeated, with the ratio of each repeat side by side.

    python -m experiments.copy_heavy --target DIR \
        --spec-bench ../shared/data/spec_bench/question.jsonl --per-task 4 --reps 3

`--switch FIELD` runs every method whose config has that mechanism switch twice, with it on
(label METHOD+FIELD) and off (METHOD-FIELD), interleaved like the other methods: an ablation of
one switch on the same prompts in the same run (e.g. `--switch context_phrases`).

Prompts: `workloads.copy_heavy_prompts` (code rewrites, Spec-Bench summarization and RAG;
with --demo-prompts also the demo pair's held-out code prompts, task "code"),
wrapped in the target tokenizer's chat template when it has one (a chat model answers a
request, it does not continue it). Every method runs with config="auto" unless --config gives
one. Prints one JSON object: per method its tokens/s, its speedup over vanilla per repeat
(median and spread), eta, the share of output 4-grams found in the prompt, and whether every
output equals vanilla's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import numpy as np


def chat_ids(model, text: str) -> list[int]:
    """The request as the model's chat template renders it (plain tokens when it has none)."""
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return list(tok(text)["input_ids"])


def copied_share(prompt: list[int], out: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that occur in the prompt."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    outs = [tuple(out[i:i + n]) for i in range(len(out) - n + 1)]
    return sum(g in grams for g in outs) / max(len(outs), 1)


def run(target, prompts: list[list[int]], lengths: list[int], methods: dict, reps: int,
        log=print, tasks: Optional[list[str]] = None) -> dict:
    """methods {label: generate kwargs}; "vanilla" must be one. Interleaved: each repeat runs
    every prompt once per method, methods in turn. tasks (one per prompt) adds the same figures
    per task ("per_task")."""
    from ouroboros_jax.generate import generate

    for label, kw in methods.items():  # compile (and auto's probe) outside the timings
        t = time.perf_counter()
        generate(target, [prompts[0]], max_new_tokens=lengths[0], **kw)
        log(f"[copy_heavy] {label}: first call {time.perf_counter() - t:.1f} s")
    secs = {m: np.zeros((reps, len(prompts))) for m in methods}
    outs = {m: [None] * len(prompts) for m in methods}
    stats = {m: [None] * len(prompts) for m in methods}
    for r in range(reps):
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            for m, kw in methods.items():
                o = generate(target, [p], max_new_tokens=n, **kw)
                secs[m][r, i] = o.stats["seconds"]
                outs[m][i], stats[m][i] = o.tokens[0], o.stats
        log(f"[copy_heavy] repeat {r + 1}/{reps} done")

    def summary(idx: list[int]) -> dict:
        """Every method's figures over the prompts idx."""
        tokens = sum(len(outs["vanilla"][i]) for i in idx)
        van = secs["vanilla"][:, idx].sum(axis=1)
        out = {}
        for m in methods:
            per_rep = van / secs[m][:, idx].sum(axis=1)
            rounds = sum(stats[m][i]["target_calls"] for i in idx)
            out[m] = {
                "tokens_per_second": float(tokens / np.median(secs[m][:, idx].sum(axis=1))),
                "speedup_median": float(np.median(per_rep)),
                "speedup_per_rep": [round(float(x), 3) for x in per_rep],
                "eta": sum(len(outs[m][i]) for i in idx) / max(rounds, 1),
                "identical": [outs[m][i] for i in idx] == [outs["vanilla"][i] for i in idx],
                "auto": stats[m][idx[-1]].get("auto"),
            }
        return out

    everything = list(range(len(prompts)))
    res = {"prompts": len(prompts), "new_tokens": sum(len(o) for o in outs["vanilla"]),
           "reps": reps, "methods": summary(everything)}
    if tasks is not None:
        res["per_task"] = {t: summary([i for i in everything if tasks[i] == t])
                           for t in dict.fromkeys(tasks)}
    res["copied_4gram_share"] = float(np.mean([copied_share(p, o) for p, o in
                                               zip(prompts, outs["vanilla"])]))
    return res


def switch_variants(methods: dict, field: str) -> dict:
    """methods {label: generate kwargs} with every method whose config has the mechanism switch
    `field` (its `KNOBS.switches`) replaced by two runs: field on (label+field) and off
    (label-field). Such a method needs a config object (auto's choice has no switch to flip)."""
    import dataclasses

    from ouroboros_jax.decoding import METHODS

    out = {}
    for label, kw in methods.items():
        space = METHODS[kw["method"]].knobs
        if space is None or field not in {s.field for s in space.switches}:
            out[label] = kw
            continue
        if not dataclasses.is_dataclass(kw.get("config")):
            raise SystemExit(f"--switch {field}: give --config for {label}")
        for sign, on in (("+", True), ("-", False)):
            out[f"{label}{sign}{field}"] = {
                **kw, "config": dataclasses.replace(kw["config"], **{field: on})}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.copy_heavy",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model directory")
    ap.add_argument("--draft", help="draft directory (for methods that need one)")
    ap.add_argument("--spec-bench", help="Spec-Bench question.jsonl (summarization + RAG)")
    ap.add_argument("--per-task", type=int, default=4, help="prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="vanilla,prompt_lookup")
    ap.add_argument("--config", action="append", default=[], metavar="METHOD=JSON",
                    help="a config instead of auto, e.g. prompt_lookup='{\"length\": 8}'")
    ap.add_argument("--switch", metavar="FIELD",
                    help="run each method having this mechanism switch with it on and off")
    ap.add_argument("--demo-prompts", action="store_true",
                    help="add the demo pair's held-out code prompts (task code)")
    a = ap.parse_args(argv)
    for name in ("per_task", "max_new_tokens", "reps"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    import ouroboros_jax as oj
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.bench.workloads import copy_heavy_prompts, demo_code_prompts, limit_per_task

    target = oj.load_model(a.target)
    draft = oj.load_model(a.draft) if a.draft else None
    overrides = {}
    for item in a.config:
        m, _, js = item.partition("=")
        overrides[m] = json.loads(js)
    methods = {}
    for m in a.methods.split(","):
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown method {m!r}; known: {', '.join(METHODS)}")
        spec = METHODS[m]
        kw = {"method": m}
        if m != "vanilla":
            kw["config"] = spec.config_type(**overrides[m]) if m in overrides else "auto"
        if spec.needs_draft:
            if draft is None:
                raise SystemExit(f"--methods {m} needs --draft")
            kw["draft"] = draft
        methods[m] = kw
    if "vanilla" not in methods:
        methods = {"vanilla": {"method": "vanilla"}, **methods}
    if a.switch:
        methods = switch_variants(methods, a.switch)
    prompts = copy_heavy_prompts(a.spec_bench) + (demo_code_prompts() if a.demo_prompts else [])
    prompts = limit_per_task(prompts, a.per_task)
    ids = [chat_ids(target, p.turns[0]) for p in prompts]
    res = run(target, ids, [a.max_new_tokens] * len(ids), methods, a.reps,
              log=lambda s: print(s, file=sys.stderr, flush=True),
              tasks=[p.task for p in prompts])
    res["command"] = "python -m experiments.copy_heavy " + " ".join(
        sys.argv[1:] if argv is None else argv)
    res["tasks"] = sorted({p.task for p in prompts})
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
