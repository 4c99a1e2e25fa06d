"""What does the serving engine's host work cost per step, this checkout against another?
Result: docs/bench/engine-host.md (raw: docs/bench/engine_host.json).

The serving engine's host time per step and its tokens/s, this checkout against another (e.g.
the pre-change commit), side by side in one process.

    git worktree add /tmp/base <commit>
    python -m experiments.engine_host --base /tmp/base --busy 1 8 16 --tokens 256

The other checkout's package is imported under another name (`oj_base`, `engine_speed.
load_tree`); both serve the demo model (each loads its own copy; fp32, its real BPE
tokenizer, vanilla decoding, EOS ignored) and every repetition runs both, the order
alternating. Measures, per number of busy slots (every request submitted at once, each `--tokens` long):

- `host_ms`: host time per device step: the CPU time of the thread running `Engine.step()`
  minus that of its wait for the device (its `fetch` of the step's outputs, timed around
  `block_until_ready`): scheduling, dispatch, reading the outputs, detokenizing, streaming
  (CPU time, not wall time: on a shared machine a descheduled thread's wall time is noise);
- `tok_s`: tokens/s of the engine's own background loop (`start`, submit, wait, `stop`), where
  the new engine overlaps its host work with the next device step.

Compile time is excluded (`warmup`, and one untimed run of each measure first).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _timed_fetch(engine_mod, waits: list) -> None:
    """engine_mod.fetch, which reads a step's outputs, with its device wait recorded."""
    import jax

    real = engine_mod.fetch

    def fetch(tree):
        t0 = time.thread_time()
        jax.block_until_ready(tree)
        waits.append(time.thread_time() - t0)
        return real(tree)

    engine_mod.fetch = fetch


def _engine(pkg, target, slots: int, cache: int, prompt_width: int):
    eng = pkg.serving.Engine(target, method="vanilla", config=None, slots=slots,
                             max_cache_len=cache, rounds_per_step=4)
    eng.warmup(prompt_widths=(prompt_width,))
    return eng


def host_per_step(pkg, eng, waits: list, prompts: list, tokens: int) -> float:
    """CPU seconds of host work per step (the stepping thread's `thread_time`, so time the
    thread spends descheduled on a loaded machine does not count) with len(prompts) requests
    running together."""
    params = pkg.serving.RequestParams(max_tokens=tokens, stop_token_ids=())
    hs = [eng.submit(p, params) for p in prompts]
    eng.step()  # the inserts
    waits.clear()
    wall, steps = 0.0, 0
    while not all(h.done for h in hs):
        t0 = time.thread_time()
        eng.step()
        wall += time.thread_time() - t0
        steps += 1
    return (wall - sum(waits)) / steps


def tokens_per_second(pkg, eng, prompts: list, tokens: int) -> float:
    params = pkg.serving.RequestParams(max_tokens=tokens, stop_token_ids=())
    eng.start()
    t0 = time.perf_counter()
    hs = [eng.submit(p, params) for p in prompts]
    n = sum(len(h.result(timeout=3600).token_ids) for h in hs)
    wall = time.perf_counter() - t0
    eng.stop()
    return n / wall


def run(base: str, busy: list, tokens: int, reps: int) -> dict:
    import importlib

    import ouroboros_jax as oj

    from experiments.engine_speed import load_tree

    pkgs = {"base": load_tree("oj_base", base), "new": oj}
    # each package's own Model (the same weights): each engine checks its target's type
    targets = {k: pkg.demo_pair("float32")[0] for k, pkg in pkgs.items()}
    target = targets["new"]
    texts = [p["text"] for p in oj.demo_prompts()]
    ids = [target.tokenizer(t)["input_ids"][-48:] for t in texts]  # one prompt bucket (64)
    slots = max(busy)
    cache = 64 + tokens
    waits = {k: [] for k in pkgs}
    engines, threaded = {}, {}  # a stopped engine takes no requests until start(): two each
    for k, pkg in pkgs.items():
        _timed_fetch(importlib.import_module(pkg.__name__ + ".serving.engine"), waits[k])
        engines[k] = _engine(pkg, targets[k], slots, cache, 64)
        threaded[k] = _engine(pkg, targets[k], slots, cache, 64)
    samples = {k: {f"{m}_{b}": [] for b in busy for m in ("host_ms", "tok_s")} for k in pkgs}
    for r in range(reps + 1):  # the first repetition compiles: not kept
        for b in busy:
            prompts = [ids[i % len(ids)] for i in range(b)]
            for k in (("base", "new") if r % 2 == 0 else ("new", "base")):
                h = host_per_step(pkgs[k], engines[k], waits[k], prompts, tokens)
                t = tokens_per_second(pkgs[k], threaded[k], prompts, tokens)
                print(f"rep {r} busy {b} {k}: host {1e3 * h:.2f} ms/step, {t:.1f} tok/s"
                      + ("" if r else " (compiling: not kept)"), flush=True)
                if r:
                    samples[k][f"host_ms_{b}"].append(1e3 * h)
                    samples[k][f"tok_s_{b}"].append(t)
    med = {k: {n: float(np.median(v)) for n, v in s.items()} for k, s in samples.items()}
    paired = {n: float(np.median(np.asarray(samples["new"][n]) / np.asarray(samples["base"][n])))
              for n in samples["new"]}
    return {"median": med, "paired_new_over_base": paired, "samples": samples,
            "settings": dict(base=base, busy=busy, tokens=tokens, reps=reps, slots=slots)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--busy", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    res = run(a.base, a.busy, a.tokens, a.reps)
    print(f"| measure | base ({a.base}) | new | new/base (paired median) |")
    print("|---|---:|---:|---:|")
    for n in res["median"]["new"]:
        print(f"| {n} | {res['median']['base'][n]:.3f} | {res['median']['new'][n]:.3f} | "
              f"{res['paired_new_over_base'][n]:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
