"""Engine speed, side by side: this checkout against another (e.g. the pre-change commit).

    git worktree add /tmp/base <commit>
    python -m ouroboros_jax.bench.engine_speed --tree /tmp/base --tree . --rounds 3

Each round runs one worker process per tree, alternating (so load from other jobs on a shared
machine falls on both alike), and the report gives per-tree medians and the ratios between
trees. A worker imports `ouroboros_jax` from its tree and measures, on the demo pair (fp32):

- `eos`: a demo prompt whose greedy generation stops at EOS after 115 tokens, generated with
  max_new_tokens=128 and with 1536 (same tokens, 4x the cache slots): tokens/s of each and
  their ratio (1.0 = the padded cache costs nothing);
- `vanilla512`: vanilla tokens/s on 512-token generations (EOS ignored), batch 1;
- `fwd_S_C`: one target forward of 1 token after C cached tokens in a cache of S slots (ms).

Compile time is excluded everywhere (every call is made once before it is timed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

EOS_PROMPT = 1  # demo prompt index: greedy output ends with EOS after 115 tokens
V512_PROMPTS = (0, 2)


def _timed(fn, reps):
    fn()  # compile / warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), out


def worker(reps: int) -> dict:
    import ouroboros_jax as oj
    from ouroboros_jax.bench.cost_model import _forward_timer

    target, _ = oj.demo_pair("float32")
    prompts = [p["text"] for p in oj.demo_prompts()]
    res: dict = {}
    p = prompts[EOS_PROMPT]
    toks = {}
    for n in (128, 1536):
        s, out = _timed(lambda: oj.generate(target, [p], max_new_tokens=n), reps)
        toks[n] = out.tokens[0]
        res[f"eos_{n}_tok_s"] = len(out.tokens[0]) / s
    res["eos_same_tokens"] = toks[128] == toks[1536]
    res["eos_tokens"] = len(toks[128])
    res["eos_ratio"] = res["eos_1536_tok_s"] / res["eos_128_tok_s"]
    tps = []
    for i in V512_PROMPTS:
        s, out = _timed(lambda: oj.generate(target, [prompts[i]], max_new_tokens=512,
                                            eos_token_id=-1), reps)
        tps.append(len(out.tokens[0]) / s)
    res["vanilla512_tok_s"] = float(np.mean(tps))
    for slots, ctx in ((256, 128), (1024, 512), (2048, 128)):
        timed = _forward_timer(target, 1, ctx, inner=16, slots=slots)
        res[f"fwd_{slots}_{ctx}_ms"] = 1e3 * float(np.median([timed() for _ in range(5 * reps)]))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", help="checkout to measure (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(a.reps)), flush=True)
        return
    trees = [os.path.abspath(t) for t in (a.tree or ["."])]
    runs: dict = {t: [] for t in trees}
    for r in range(a.rounds):
        for t in (trees if r % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=t, JAX_PLATFORMS="cpu")
            # this file runs as the worker; PYTHONPATH makes it import the tree's package
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                "--reps", str(a.reps)], cwd=t, env=env,
                               capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"worker in {t} failed:\n{p.stderr[-3000:]}")
            runs[t].append(json.loads(line[0][7:]))
            print(f"[round {r}] {t}: {runs[t][-1]}", file=sys.stderr, flush=True)
    keys = [k for k, v in runs[trees[0]][0].items() if isinstance(v, float)]
    med = {t: {k: float(np.median([x[k] for x in runs[t]])) for k in keys} for t in trees}
    print("| measure | " + " | ".join(trees) + (" | last/first |" if len(trees) > 1 else " |"))
    print("|---" * (len(trees) + 1 + (len(trees) > 1)) + "|")
    for k in keys:
        row = [f"{med[t][k]:.3f}" for t in trees]
        if len(trees) > 1:
            row.append(f"{med[trees[-1]][k] / med[trees[0]][k]:.2f}")
        print(f"| {k} | " + " | ".join(row) + " |")
    for t in trees:
        print(f"{t}: same tokens 128 vs 1536: {[x['eos_same_tokens'] for x in runs[t]]}, "
              f"EOS after {runs[t][0]['eos_tokens']} tokens")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trees": trees, "runs": runs, "medians": med}, f, indent=2)


if __name__ == "__main__":
    main()
