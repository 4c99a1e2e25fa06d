"""Does every method's output equal vanilla's on the device, and at what acceptance? Result:
docs/bench/device-h200.md, section 2. The device script's exactness and real-acceptance stage:
the shipped demo pair (a 20M target and a 5M draft trained on the same code, agreement about
0.65) run by every method on the device, at batch 1, in each dtype asked for.

Random weights (the t(T) and per-round stages) agree on nothing, so they price a round but never
show a method's yield; the demo pair does, and it is small enough to load anywhere. Two things
are read off it:
  * exactness on the device's arithmetic: each method's greedy tokens against vanilla's in the
    same dtype, prompt by prompt. A CPU's fp32 matmul rounds a T-token and a 1-token product
    alike often enough that the CPU tests never see a flip; a GPU's kernels differ by shape
    (tiling, split-K, TF32 for fp32 under JAX's default precision), so a near-tie can resolve
    differently in a verification forward than in vanilla's step. Counted, not assumed.
  * tokens/s and eta per method at the paper's recipe (config=None) and at config="auto"'s
    choice, from the second call on (each (method, config) compiles on the first prompt).
A model of 20M parameters is launch-bound on any accelerator: its tokens/s say what a round's
fixed cost is, not what an 8B target gives (the t(T) stage and the projection say that).
"""

from __future__ import annotations

import time


def load_demo(dtype: str):
    """(target, draft, prompt texts) of the shipped demo pair in `dtype`."""
    from ouroboros_jax.demo_assets import demo_pair, demo_prompts

    target, draft = demo_pair(dtype)
    return target, draft, [p["text"] for p in demo_prompts()]


def first_difference(a: list, b: list) -> int:
    """Index of the first token where a and b differ (len of the shorter when one is a prefix
    of the other); -1 when equal."""
    if a == b:
        return -1
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


PAPER_AND_AUTO = (("paper", None), ("auto", "auto"))


def demo_rows(methods, dtypes, num_prompts: int, new_tokens: int, in_budget=None,
              configs=PAPER_AND_AUTO):
    """Yields one row per (dtype, method, config label): first-call seconds, tokens/s and eta
    over `num_prompts` prompts (calls after the first), and, against vanilla in the same dtype,
    how many prompts gave identical tokens and where the first difference fell. EOS is honoured
    (real text); `in_budget()` False: the rest are yielded as skipped. configs: (label,
    config) pairs run per method (vanilla runs its first only)."""
    from ouroboros_jax import generate
    from ouroboros_jax.decoding import METHODS as SPECS

    for dtype in dtypes:
        target, draft, texts = load_demo(dtype)
        prompts = texts[:num_prompts]
        ref = None
        for m in ("vanilla", *[m for m in methods if m != "vanilla"]):
            for label, config in configs[:1] if m == "vanilla" else configs:
                if in_budget is not None and not in_budget():
                    yield {"dtype": dtype, "method": m, "config": label, "skipped": "budget"}
                    continue
                kw = dict(draft=draft if SPECS[m].needs_draft else None, method=m,
                          config=config, max_new_tokens=new_tokens)
                start = time.perf_counter()
                generate(target, prompts[:1], **kw)  # compiles (auto: chooses)
                first = time.perf_counter() - start
                outs, secs = [], 0.0
                for p in prompts:
                    start = time.perf_counter()
                    o = generate(target, [p], **kw)
                    secs += time.perf_counter() - start  # the wall clock the user sees
                    outs.append(o)
                toks = [o.tokens[0] for o in outs]
                if m == "vanilla":
                    ref = toks
                diffs = [first_difference(a, b) for a, b in zip(toks, ref)]
                new = sum(o.stats["new_tokens"] for o in outs)
                calls = sum(o.stats["target_calls"] for o in outs)
                auto = outs[-1].stats.get("auto") if label == "auto" else None
                yield {"dtype": dtype, "method": m, "config": label,
                       "chosen": (auto or {}).get("config") if label == "auto"
                       else repr(SPECS[m].default_config()),
                       "ran": (auto or {}).get("method", m) if label == "auto" else m,
                       "first_call_seconds": first, "new_tokens": new,
                       "tokens_per_second": new / secs, "eta": new / max(calls, 1),
                       "identical": sum(d < 0 for d in diffs), "prompts": len(prompts),
                       "first_difference": diffs}
