"""`ouroboros-jax demo`: the main job. Loads the shipped target/draft pair, generates code with
vanilla decoding and with the fastest method available, and shows speed and exactness.

When the trained pair is not installed (it ships under `ouroboros_jax/assets/demo/`), the demo
says so plainly and builds a small random-weight pair itself: its text is gibberish, but the
comparison of methods (identical tokens, tokens/s) is still real.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Optional

import numpy as np

from .auto import warming_up
from .decoding import METHODS
from .generate import generate
from .heap import freeze_heap

FALLBACK_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    'def read_lines(path):\n    """Return the lines of the file at path without newlines."""\n',
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _random_pair():
    """A small random-weight Llama pair built here (no download): target 4 layers, draft 1."""
    import jax

    from .models import ModelConfig, init_params
    from .models.loading import Model

    tcfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4,
                       num_heads=4, num_kv_heads=2, eos_token_id=None,
                       max_position_embeddings=2048)
    dcfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=1,
                       num_heads=2, num_kv_heads=1, eos_token_id=None,
                       max_position_embeddings=2048)
    target = Model(tcfg, init_params(tcfg, jax.random.key(0), std=0.08))
    draft = Model(dcfg, init_params(dcfg, jax.random.key(1), std=0.08))
    return target, draft


def load_pair():
    """(target, draft, prompts, trained?): the shipped pair when installed, else a random one."""
    try:
        from .demo_assets import demo_pair, demo_prompts

        target, draft = demo_pair()
        return target, draft, [p["text"] for p in demo_prompts()], True
    except (ImportError, FileNotFoundError):
        target, draft = _random_pair()
        rs = np.random.RandomState(0)
        prompts = [rs.randint(0, 512, size=24).tolist() for _ in FALLBACK_PROMPTS]
        return target, draft, prompts, False


SPECULATIVE_METHODS = ("speculative", "lookahead", "ouroboros", "prompt_lookup")

# Ouroboros with these off drafts token by token and verifies one chain: speculative decoding
SD_SWITCHES = ("phrase_drafting", "lengthening", "recycling")


def switches_off(config: Optional[str]) -> list[str]:
    """The mechanism switches a config's recipe string sets False, in its order
    ("OuroborosConfig(gamma=2, ..., lengthening=False)" -> ["lengthening"])."""
    return re.findall(r"(\w+)=False", config or "")


# Ouroboros' own mechanisms (besides its SD step), as its recipe names them: free drafts are
# off by default (named when =True), the others on (named when =False)
OWN_MECHANISMS = (("free_drafts", "free drafts"), ("phrase_drafting", "phrase drafting"),
                  ("lengthening", "lengthening"), ("recycling", "recycling"),
                  ("context_phrases", "context phrases"))


def mechanisms_on(config: Optional[str]) -> list[str]:
    """Ouroboros' own mechanisms a recipe string runs, in OWN_MECHANISMS order (the pool's
    history is not one: it only carries the others' phrases across calls)."""
    off = set(switches_off(config))
    on = set(re.findall(r"(\w+)=True", config or ""))
    return [label for field, label in OWN_MECHANISMS
            if (field in on if field == "free_drafts" else field not in off)]


def _gamma(auto: dict) -> str:
    """"γN" from the chain length in auto's config string ("" when it names none)."""
    gamma = re.search(r"gamma=(\d+)", auto.get("config") or "")
    return f"γ{gamma.group(1)}" if gamma else ""


def describe_run(method: str, auto: Optional[dict]) -> tuple[str, Optional[str]]:
    """(label, why) for a method's row, from its `stats["auto"]`: the label names only the
    mechanisms that ran ("ouroboros (as speculative γ2: mechanisms off on this device)",
    "lookahead (ran vanilla)"); why is one line saying what auto turned off and why, None when
    it turned nothing off."""
    if not auto:
        return method, None
    if auto.get("method") == "vanilla" and method != "vanilla":
        reason = auto.get("reason", "").split(" (a priori")[0]
        return f"{method} (ran vanilla)", f"{method}: {reason}"
    if method == "ouroboros" and auto.get("method") == "speculative":  # `choice.as_run`
        return (f"ouroboros (as speculative {_gamma(auto)}: mechanisms off on this device)",
                f"{method}: auto turned off all its own mechanisms and ran speculative's loop: "
                f"the cost model predicts this device runs it faster without them "
                f"({auto.get('reason', '').split(' (a priori')[0]})")
    off = switches_off(auto.get("config"))
    if not off:
        if method == "ouroboros" and "free drafts" in mechanisms_on(auto.get("config")):
            return "ouroboros (free drafts on)", None
        return method, None
    why = (f"{method}: auto turned off {', '.join(off)}: the cost model predicts this device "
           f"runs it faster without them ({auto.get('reason', '').split(' (a priori')[0]})")
    free = method == "ouroboros" and "free drafts" in mechanisms_on(auto.get("config"))
    if method == "ouroboros" and all(s in off for s in SD_SWITCHES):
        g = _gamma(auto)
        if free:
            t = re.search(r"free_threshold=(\d+)", auto.get("config") or "")
            return (f"ouroboros (free drafts at matches of {t.group(1) if t else 2}+ tokens, "
                    f"else speculative {g}: its other mechanisms off on this device)", why)
        return f"ouroboros (as speculative {g}: mechanisms off on this device)", why
    return f"{method} ({'free drafts on; ' if free else ''}{', '.join(off)} off)", why


def _timed_runs(target, draft, prompts, methods: list[str], max_new_tokens: int) -> dict:
    """Every method over the prompts, batch 1: each compiled on the first prompt, then, prompt
    by prompt, every method in turn (interleaved, so that load from other processes falls on
    all methods alike rather than on whichever ran during it). Two passes over the prompts;
    each (method, prompt) keeps its faster pass."""
    # every method with config="auto": sized for this machine by its calibration, the pair's
    # agreement and the calls' own timings (ouroboros_jax/auto/), no recipe written in
    kws = {m: {} if m == "vanilla" else {"draft": draft, "config": "auto"} for m in methods}
    res = {}
    for m in methods:
        _log(f"[demo] {m}: compiling (first call) ...")
        tc = time.perf_counter()
        with warming_up():  # (its own choice compiled, as the timed calls will run it)
            generate(target, prompts[:1], method=m, max_new_tokens=max_new_tokens, **kws[m])
        res[m] = {"outs": [None] * len(prompts), "secs": [float("inf")] * len(prompts),
                  "compile_seconds": time.perf_counter() - tc}
    freeze_heap()  # full GC passes skip the warmed-up heap (heap.py)
    for rep in range(2):
        for i, p in enumerate(prompts):
            _log(f"[demo] pass {rep + 1}/2, prompt {i + 1}/{len(prompts)}: {', '.join(methods)}")
            for m in methods:
                o = generate(target, [p], method=m, max_new_tokens=max_new_tokens, **kws[m])
                if o.stats["seconds"] < res[m]["secs"][i]:
                    res[m]["outs"][i], res[m]["secs"][i] = o, o.stats["seconds"]
    out = {}
    for m, r in res.items():
        new = sum(o.stats["new_tokens"] for o in r["outs"])
        calls = sum(o.stats["target_calls"] for o in r["outs"])
        out[m] = {"outs": r["outs"], "tokens_per_second": new / sum(r["secs"]),
                  "compile_seconds": r["compile_seconds"], "eta": new / max(calls, 1)}
    return out


def run_demo(num_prompts: int | None = None, max_new_tokens: int = 128,
             method: str | None = None) -> dict:
    """Vanilla, then each speculative method (or just `method`), on the same prompts; prints
    each prompt and its completion, a table of tokens/s, speedup, eta, exactness and what
    config="auto" chose, one line per mechanism auto turned off and why, and names the fastest
    with the mechanisms it ran."""
    for name, v in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if method is not None and method != "vanilla" and method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; known: {', '.join(METHODS)}")
    t0 = time.perf_counter()
    _log("[demo] loading the model pair ...")
    target, draft, prompts, trained = load_pair()
    if not trained:
        _log("[demo] NOTE: the trained demo pair is not installed in this build; using a small "
             "random-weight pair built on the spot. Its output is not meaningful text, but the "
             "speed and exactness comparison is real.")
    if num_prompts is None:
        num_prompts = 2 if os.environ.get("CI") else min(len(prompts), 6)
    prompts = prompts[:num_prompts]
    methods = [m for m in ((method,) if method else SPECULATIVE_METHODS) if m != "vanilla"]
    results = _timed_runs(target, draft, prompts, ["vanilla", *methods], max_new_tokens)
    van = results["vanilla"]
    print("=" * 72)
    for i, o in enumerate(van["outs"]):
        head = prompts[i] if isinstance(prompts[i], str) else f"<{len(prompts[i])} token ids>"
        print(f"--- prompt {i + 1} ---\n{head.rstrip()}")
        print(f"--- completion ({o.stats['new_tokens']} tokens, every method alike) ---")
        print(o.texts[0] if o.texts else o.tokens[0])
    print("=" * 72)
    print(f"{'method':<13} {'tokens/s':>9} {'speedup':>8} {'eta':>6}  {'identical':<9}  "
          "config (auto)")
    summary = {"trained_pair": trained, "methods": {}}
    whys = []
    for m, r in results.items():
        same = all(a.tokens == b.tokens for a, b in zip(van["outs"], r["outs"]))
        speedup = r["tokens_per_second"] / van["tokens_per_second"]
        a = r["outs"][-1].stats.get("auto") or {}
        label, why = describe_run(m, a)
        chosen = "off: ran vanilla" if a.get("method") == "vanilla" else a.get("config") or ""
        print(f"{m:<13} {r['tokens_per_second']:9.1f} {speedup:7.2f}x {r['eta']:6.2f}  "
              f"{'yes' if same else 'NO':<9}  {chosen}")
        whys += [why] if why else []
        summary["methods"][m] = {"tokens_per_second": r["tokens_per_second"],
                                 "speedup": speedup, "eta": r["eta"], "identical": same,
                                 "compile_seconds": r["compile_seconds"], "auto": a or None,
                                 "label": label}
    for why in whys:  # what config="auto" turned off, one line each
        print(f"  {why}")
    ours = summary["methods"].get("ouroboros")
    if ours and (ours["auto"] or {}).get("method") == "ouroboros":
        on = mechanisms_on(ours["auto"].get("config"))
        print(f"  ouroboros ran with its own mechanisms: {', '.join(on) or 'none (its SD step)'}")
        ours["mechanisms_on"] = on
    # a row auto ran as vanilla runs vanilla's loop: its speed differs from vanilla's by noise
    # alone, so it is not a candidate for "fastest"
    ran = [m for m in results
           if m == "vanilla" or (summary["methods"][m]["auto"] or {}).get("method") != "vanilla"]
    fastest = max(ran, key=lambda m: results[m]["tokens_per_second"])
    summary["fastest"] = fastest
    summary["identical"] = all(v["identical"] for v in summary["methods"].values())
    print(f"fastest here: {summary['methods'][fastest]['label']}; identical to vanilla: "
          f"{'yes' if summary['identical'] else 'NO'}")
    if not trained:
        print("(random-weight pair: the draft never agrees with the target, so no method can "
              "be faster here; this run shows exactness, not speed)")
    print(f"(compile time excluded from tokens/s; whole demo took "
          f"{time.perf_counter() - t0:.0f} s)")
    return summary
