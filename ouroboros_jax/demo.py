"""`ouroboros-jax demo`: the main job. Loads the shipped target/draft pair, generates code with
vanilla decoding and with the fastest method available, and shows speed and exactness.

When the trained pair is not installed (it ships under `ouroboros_jax/assets/demo/`), the demo
says so plainly and builds a small random-weight pair itself: its text is gibberish, but the
comparison of methods (identical tokens, tokens/s) is still real.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .decoding import METHODS
from .generate import generate

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


def _timed_runs(target, draft, prompts, methods: list[str], max_new_tokens: int) -> dict:
    """Every method over the prompts, batch 1: each compiled on the first prompt, then, prompt
    by prompt, every method in turn (interleaved, so that load from other processes falls on
    all methods alike rather than on whichever ran during it). Two passes over the prompts;
    each (method, prompt) keeps its faster pass."""
    # every method with config="auto": sized for this machine by its calibration, the pair's
    # agreement and the calls' own timings (decoding/auto.py), no recipe written in
    kws = {m: {} if m == "vanilla" else {"draft": draft, "config": "auto"} for m in methods}
    res = {}
    for m in methods:
        _log(f"[demo] {m}: compiling (first call) ...")
        tc = time.perf_counter()
        generate(target, prompts[:1], method=m, max_new_tokens=max_new_tokens, **kws[m])
        res[m] = {"outs": [None] * len(prompts), "secs": [float("inf")] * len(prompts),
                  "compile_seconds": time.perf_counter() - tc}
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
    the code, a table of tokens/s, speedup, eta and exactness, and names the fastest."""
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
        print(f"--- prompt {i + 1} ---\n{head}", end="")
        print(o.texts[0] if o.texts else o.tokens[0])
    print("=" * 72)
    print(f"{'method':<12} {'tokens/s':>9} {'speedup':>8} {'eta':>6}  {'identical':<9}  config (auto)")
    summary = {"trained_pair": trained, "methods": {}}
    for m, r in results.items():
        same = all(a.tokens == b.tokens for a, b in zip(van["outs"], r["outs"]))
        speedup = r["tokens_per_second"] / van["tokens_per_second"]
        a = r["outs"][-1].stats.get("auto") or {}
        chosen = ("off: ran vanilla (" + a["reason"].split(" (")[0].split(":")[0] + ")"
                  if a.get("method") == "vanilla" else a.get("config") or "")
        print(f"{m:<12} {r['tokens_per_second']:9.1f} {speedup:7.2f}x {r['eta']:6.2f}  "
              f"{'yes' if same else 'NO':<9}  {chosen}")
        summary["methods"][m] = {"tokens_per_second": r["tokens_per_second"],
                                 "speedup": speedup, "eta": r["eta"], "identical": same,
                                 "compile_seconds": r["compile_seconds"], "auto": a or None}
    fastest = max(results, key=lambda m: results[m]["tokens_per_second"])
    summary["fastest"] = fastest
    summary["identical"] = all(v["identical"] for v in summary["methods"].values())
    print(f"fastest here: {fastest}; identical to vanilla: "
          f"{'yes' if summary['identical'] else 'NO'}")
    if not trained:
        print("(random-weight pair: the draft never agrees with the target, so no method can "
              "be faster here; this run shows exactness, not speed)")
    elif fastest != "ouroboros":
        print("(config=auto sized every method for this machine from a latency probe and the "
              "pair's agreement; on a CPU a forward's cost grows with every token it scores, so "
              "trees stay small here; `ouroboros-jax bench --cost-model` prices the counts both ways)")
    print(f"(compile time excluded from tokens/s; whole demo took "
          f"{time.perf_counter() - t0:.0f} s)")
    return summary
