"""How much of a run do its counted forwards explain? Result: docs/performance.md ("The cost
model beside the measurement") and docs/auto.md.

Measured time / cost-model prediction, with every measurement paired with a latency
measurement taken right after it.

    python -m experiments.cost_check --reps 5 --max-new-tokens 256

The bench's cost model (`cost_model.py`) times forwards once, after all methods ran; on a shared
machine whose load changes by the minute that pairs a run with a latency table measured under
other load. Here each repetition runs every method on the same demo prompts (batch 1, greedy,
EOS ignored so the counts are fixed) and then times, in the same minute, the forwards that
method used (target and draft forwards of its input sizes after the contexts the run visits,
one per number of live attention blocks and weighted by its share of the run
(context_mix), in a cache
of the run's slots, a round's first draft forward right after a target forward as it runs in a
round (cost_model.first_draft_timer), and the prefills); the ratio measured / predicted is taken per repetition
and the median over repetitions is reported. A ratio near 1 means the work outside the forwards
(acceptance walk, pool, commits, the loop) is noise.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import numpy as np

from ouroboros_jax.bench.cost_model import (LatencyTable, first_draft_timer, forward_sizes,
                                            forward_timer, predict_seconds, prompt_bucket,
                                            validate)
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.models.attention import BLOCK
from ouroboros_jax.request import cache_slots

# The small trees of the README's CPU bench.
CONFIGS = {"speculative": {"gamma": 3}, "lookahead": {"window": 4, "ngram": 3, "guesses": 4},
           "ouroboros": {"gamma": 2, "window": 4, "ngram": 3, "guesses": 4, "suffixes": 2}}


def context_mix(prompt_lengths, new_tokens: int, block: Optional[int] = None) -> list:
    """[(context, weight)]: the committed cache lengths a run's forwards see, grouped by the
    number of live attention blocks (what attention's cost follows: models/attention.py), one
    representative context (the group's mean) per group, weights summing to 1.

    A call with prompt length p and n new tokens ignoring EOS runs its forwards after p - 1 ..
    p + n - 2 committed tokens; a method emitting several tokens per round samples the same
    range more sparsely, so the mix is the same for every method."""
    C = block or BLOCK
    groups: dict = {}
    for p in prompt_lengths:
        for ctx in range(max(int(p) - 1, 0), int(p) + int(new_tokens) - 1):
            groups.setdefault(-(-ctx // C), []).append(ctx)
    total = sum(len(v) for v in groups.values())
    return [(int(round(np.mean(v))), len(v) / total) for _, v in sorted(groups.items())]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--methods", default="vanilla,speculative,lookahead,ouroboros")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    for name in ("reps", "prompts", "max_new_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    unknown = [m for m in a.methods.split(",") if m.strip() not in
               ("vanilla", "speculative", "lookahead", "ouroboros")]
    if unknown:
        ap.error(f"--methods: unknown method(s) {', '.join(unknown)}; choose from vanilla, "
                 "speculative, lookahead, ouroboros")

    import ouroboros_jax as oj
    target, draft = oj.demo_pair("float32")
    texts = [p["text"] for p in oj.demo_prompts()[:a.prompts]]
    plens = [len(target.tokenizer(t)["input_ids"]) for t in texts]
    mix = context_mix(plens, a.max_new_tokens)  # [(context, weight)]
    cfg_types = {"speculative": oj.SpeculativeConfig, "lookahead": oj.LookaheadConfig,
                 "ouroboros": oj.OuroborosConfig}
    methods = [m.strip() for m in a.methods.split(",")]
    setups = {}
    for m in methods:
        cfg = cfg_types[m](**CONFIGS[m]) if m in cfg_types else None
        n_t, n_s, n_s1 = forward_sizes(m, cfg)
        slots = cache_slots(prompt_bucket(int(np.median(plens))), a.max_new_tokens,
                            METHODS[m].margin(cfg) if cfg is not None else 0)
        timers = {("t", c): forward_timer(target, n_t, c, slots=slots) for c, _ in mix}
        if n_s:
            timers.update({("s", c): forward_timer(draft, n_s, c, slots=slots) for c, _ in mix})
            # verification then the next round's first draft forward, as a round runs them
            timers.update({("ts1", c): first_draft_timer(target, n_t, draft, n_s1, c, slots=slots)
                           for c, _ in mix})
        for P in sorted({prompt_bucket(n) for n in plens}):
            timers[(f"pt{P}", None)] = forward_timer(target, P, 0, inner=2)
            if n_s:
                timers[(f"ps{P}", None)] = forward_timer(draft, P, 0, inner=2)

        def gen(m=m, cfg=cfg):
            secs, tc, df = 0.0, 0, 0
            for t in texts:
                out = oj.generate(target, [t], draft=draft if n_s else None, method=m,
                                  config=cfg, max_new_tokens=a.max_new_tokens, eos_token_id=-1)
                secs += out.stats["seconds"]
                tc += out.stats["target_calls"]
                df += out.stats.get("draft_forwards", out.stats["draft_calls"])
            return secs, tc, df

        gen()  # compile
        setups[m] = (gen, timers, (n_t, n_s, n_s1))

    ratios: dict = {m: [] for m in methods}
    detail: dict = {m: [] for m in methods}
    for r in range(a.reps):
        for m in methods:
            gen, timers, (n_t, n_s, n_s1) = setups[m]
            secs, tc, df = gen()
            med = {k: float(np.median([f() for _ in range(3)])) for k, f in timers.items()}
            lat: dict = {}
            for (kind, c), v in med.items():  # the run's contexts, by their share
                lat[kind] = lat.get(kind, 0.0) + v * (dict(mix)[c] if c is not None else 1.0)
            pre = sum(lat[f"pt{prompt_bucket(n)}"] + (lat[f"ps{prompt_bucket(n)}"] if n_s else 0)
                      for n in plens)
            table = LatencyTable(target={n_t: lat["t"]}, draft={n_s: lat["s"]} if n_s else {},
                                 draft_first={n_s1: lat["ts1"] - lat["t"]} if n_s else {})
            pred = predict_seconds(tc, df, n_t, n_s, table, n_s1 if n_s else None, pre)
            ratios[m].append(secs / pred)
            detail[m].append({"measured_s": secs, "predicted_s": pred, "target_calls": tc,
                              "draft_forwards": df, "latency_ms": {k: 1e3 * v
                                                                   for k, v in lat.items()}})
            print(f"[rep {r}] {m}: measured {secs:.3f} s, predicted {pred:.3f} s, "
                  f"ratio {secs / pred:.3f}", flush=True)
    ctxs = ", ".join(f"{c} ({w:.0%})" for c, w in mix)
    print(f"\n{a.prompts} demo prompts x {a.max_new_tokens} new tokens, contexts {ctxs}, "
          f"{a.reps} repetitions")
    print("| method | target calls | draft forwards | measured / predicted (median) | range |")
    print("|---|---:|---:|---:|---|")
    for m in methods:
        v = ratios[m]
        print(f"| {m} | {detail[m][0]['target_calls']} | {detail[m][0]['draft_forwards']} | "
              f"{np.median(v):.3f} | {min(v):.3f}-{max(v):.3f} |")
    print(validate([{"measured_seconds": float(np.median(ratios[m])), "predicted_seconds": 1.0}
                    for m in methods])["summary"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ratios": ratios, "detail": detail, "contexts": mix}, f, indent=2)


if __name__ == "__main__":
    main()
