"""Is this checkout's decoding engine faster than another's? Result: printed (JSON), quoted by
the change it measured (the attention block size, models/attention.py `BLOCK`).

Engine speed, side by side in one process: this checkout against another (e.g. the
pre-change commit).

    git worktree add /tmp/base <commit>
    python -m experiments.engine_speed --base /tmp/base --reps 7

The other checkout's package is imported under another name (`oj_base`), both run on the same
loaded weights, and every repetition times every measure of both in turn (the order alternating),
so load from other jobs on a shared machine falls on both alike; the report gives medians, their
ratios, and the median of the paired ratios (adjacent runs), the number to trust under load. Measures, on the demo pair (fp32):

- `eos`: a demo prompt whose greedy generation stops at EOS after 115 tokens, generated with
  max_new_tokens=128 and with 1536 (same tokens, 4x the cache slots): tokens/s of each and
  their ratio (1.0 = the padded cache costs nothing);
- `vanilla512`: vanilla tokens/s on 512-token generations (EOS ignored), batch 1;
- `fwd_S_C`: one target forward of 1 token after C cached tokens in a cache of S slots (ms).

Compile time is excluded everywhere (every call is made once before it is timed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

EOS_PROMPT = 1  # demo prompt index: greedy output ends with EOS after 115 tokens
V512_PROMPTS = (0, 2)
FWD_CASES = ((256, 128), (1024, 512), (2048, 128))


def load_tree(name: str, tree: str):
    """The `ouroboros_jax` package of another checkout, imported as `name`."""
    init = os.path.join(os.path.abspath(tree), "ouroboros_jax", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _measures(pkg, target, prompts):
    """{name: callable -> (seconds, payload)} for one package."""
    import importlib

    cost_model = importlib.import_module(pkg.__name__ + ".bench.cost_model")

    def gen(prompt, n, **kw):
        def f():
            t0 = time.perf_counter()
            out = pkg.generate(target, [prompt], max_new_tokens=n, **kw)
            return time.perf_counter() - t0, out.tokens[0]
        return f

    m = {"eos_128": gen(prompts[EOS_PROMPT], 128), "eos_1536": gen(prompts[EOS_PROMPT], 1536)}
    for i in V512_PROMPTS:
        m[f"vanilla512_p{i}"] = gen(prompts[i], 512, eos_token_id=-1)
    for slots, ctx in FWD_CASES:
        timed = cost_model.forward_timer(target, 1, ctx, inner=16, slots=slots)
        m[f"fwd_{slots}_{ctx}"] = lambda timed=timed: (timed(), None)
    return m


def run(base: str, reps: int) -> dict:
    import ouroboros_jax as oj

    pkgs = {"base": load_tree("oj_base", base), "new": oj}
    target, _ = oj.demo_pair("float32")
    prompts = [p["text"] for p in oj.demo_prompts()]
    meas = {k: _measures(p, target, prompts) for k, p in pkgs.items()}
    samples: dict = {k: {n: [] for n in meas[k]} for k in pkgs}
    tokens: dict = {k: {} for k in pkgs}
    for k in pkgs:  # compile
        for n, f in meas[k].items():
            tokens[k][n] = f()[1]
    for r in range(reps):
        for n in meas["new"]:
            for k in (("base", "new") if r % 2 == 0 else ("new", "base")):
                samples[k][n].append(meas[k][n]()[0])
    res: dict = {"paired": _paired(samples, tokens)}
    for k in pkgs:
        med = {n: float(np.median(v)) for n, v in samples[k].items()}
        eos_toks = len(tokens[k]["eos_128"])
        r = {"eos_128_tok_s": eos_toks / med["eos_128"],
             "eos_1536_tok_s": len(tokens[k]["eos_1536"]) / med["eos_1536"],
             "vanilla512_tok_s": float(np.mean([512 / med[f"vanilla512_p{i}"]
                                                for i in V512_PROMPTS]))}
        r["eos_ratio"] = r["eos_1536_tok_s"] / r["eos_128_tok_s"]
        for slots, ctx in FWD_CASES:
            r[f"fwd_{slots}_{ctx}_ms"] = 1e3 * med[f"fwd_{slots}_{ctx}"]
        r["eos_same_tokens"] = tokens[k]["eos_128"] == tokens[k]["eos_1536"]
        r["eos_tokens"] = eos_toks
        res[k] = r
    res["same_tokens_base_new"] = all(tokens["base"][n] == tokens["new"][n] for n in tokens["new"]
                                      if not n.startswith("fwd"))
    return res


def _paired(samples, tokens) -> dict:
    """new/base speed ratios from the two adjacent runs of each repetition, median over
    repetitions (robust to load that drifts slower than one repetition)."""
    def ratio(n):  # base seconds / new seconds = new speed / base speed
        return float(np.median(np.asarray(samples["base"][n]) / np.asarray(samples["new"][n])))

    out = {n: ratio(n) for n in samples["new"]}
    # the padded-cache penalty within each package, pairing the 128 and 1536 runs of a rep
    for k in ("base", "new"):
        out[f"{k}_eos_ratio"] = float(np.median(
            (len(tokens[k]["eos_1536"]) / np.asarray(samples[k]["eos_1536"]))
            / (len(tokens[k]["eos_128"]) / np.asarray(samples[k]["eos_128"]))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    res = run(a.base, a.reps)
    keys = [k for k, v in res["new"].items() if isinstance(v, float)]
    print(f"| measure | base ({a.base}) | new | new/base |")
    print("|---|---:|---:|---:|")
    for k in keys:
        b, n = res["base"][k], res["new"][k]
        print(f"| {k} | {b:.3f} | {n:.3f} | {n / b:.2f} |")
    print("\nPaired (median over repetitions of the ratio between adjacent runs):")
    for n, v in res["paired"].items():
        print(f"  {n}: {v:.2f}" + ("" if "eos_ratio" in n else " (new speed / base speed)"))
    for k in ("base", "new"):
        print(f"{k}: EOS after {res[k]['eos_tokens']} tokens, same tokens with 128 and 1536: "
              f"{res[k]['eos_same_tokens']}")
    print(f"base and new give the same tokens: {res['same_tokens_base_new']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
