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
        from .training.assets import demo_pair, demo_prompts

        target, draft = demo_pair()
        return target, draft, [p["text"] for p in demo_prompts()], True
    except (ImportError, FileNotFoundError):
        target, draft = _random_pair()
        rs = np.random.RandomState(0)
        prompts = [rs.randint(0, 512, size=24).tolist() for _ in FALLBACK_PROMPTS]
        return target, draft, prompts, False


def best_method() -> str:
    for m in ("ouroboros", "lookahead", "speculative"):
        if m in METHODS:
            return m
    return "vanilla"


def demo_config(method: str):
    """The paper's recipes are sized for GPUs (a 247-token draft tree per step); on a CPU,
    where a forward's cost grows with every token it scores, smaller trees are faster."""
    import jax

    from .decoding.lookahead import LookaheadConfig
    from .decoding.ouroboros import OuroborosConfig

    if jax.default_backend() != "cpu":
        return None
    return {"ouroboros": OuroborosConfig(gamma=6, window=6, ngram=4, guesses=6, suffixes=3),
            "lookahead": LookaheadConfig(window=6, ngram=4, guesses=6)}.get(method)


def run_demo(num_prompts: int | None = None, max_new_tokens: int = 128,
             method: str | None = None) -> dict:
    t0 = time.perf_counter()
    _log("[demo] loading the model pair ...")
    target, draft, prompts, trained = load_pair()
    if not trained:
        _log("[demo] NOTE: the trained demo pair is not installed in this build; using a small "
             "random-weight pair built on the spot. Its output is not meaningful text, but the "
             "speed and exactness comparison is real.")
    if num_prompts is None:
        num_prompts = 2 if os.environ.get("CI") else len(prompts)
    prompts = prompts[:num_prompts]
    method = method or best_method()
    results = {}
    for m in ("vanilla", method) if method != "vanilla" else ("vanilla",):
        kw = {} if m == "vanilla" else {"draft": draft, "config": demo_config(m)}
        _log(f"[demo] {m}: compiling (first call) ...")
        tc = time.perf_counter()
        generate(target, prompts[:1], method=m, max_new_tokens=max_new_tokens, **kw)
        compile_s = time.perf_counter() - tc
        outs, secs, new = [], 0.0, 0
        for i, p in enumerate(prompts):
            _log(f"[demo] {m}: prompt {i + 1}/{len(prompts)}")
            o = generate(target, [p], method=m, max_new_tokens=max_new_tokens, **kw)
            outs.append(o)
            secs += o.stats["seconds"]
            new += o.stats["new_tokens"]
        results[m] = {"outs": outs, "tokens_per_second": new / secs, "compile_seconds": compile_s,
                      "eta": float(np.mean([o.stats["eta"] for o in outs]))}
    van = results["vanilla"]
    print("=" * 72)
    for i, o in enumerate(van["outs"]):
        head = prompts[i] if isinstance(prompts[i], str) else f"<{len(prompts[i])} token ids>"
        print(f"--- prompt {i + 1} ---\n{head}", end="")
        print(o.texts[0] if o.texts else o.tokens[0])
    print("=" * 72)
    summary = {"trained_pair": trained, "method": method,
               "vanilla_tokens_per_second": van["tokens_per_second"]}
    print(f"vanilla      : {van['tokens_per_second']:8.1f} tokens/s")
    if method != "vanilla":
        r = results[method]
        same = all(a.tokens == b.tokens for a, b in zip(van["outs"], r["outs"]))
        speedup = r["tokens_per_second"] / van["tokens_per_second"]
        print(f"{method:<13}: {r['tokens_per_second']:8.1f} tokens/s   "
              f"tokens per target call (eta) {r['eta']:.2f}")
        print(f"speedup      : {speedup:.2f}x")
        print(f"identical to vanilla: {'yes' if same else 'NO'}")
        if not trained:
            print("(random-weight pair: the draft never agrees with the target, so no method can "
                  "be faster here; this run shows exactness, not speed)")
        summary.update(method_tokens_per_second=r["tokens_per_second"], speedup=speedup,
                       identical=same)
    print(f"(compile time excluded from tokens/s; whole demo took "
          f"{time.perf_counter() - t0:.0f} s)")
    return summary
