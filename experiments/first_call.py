"""What does a fresh process's first call cost per method, against vanilla's? Result: printed
(JSON); listed in docs/performance.md ("Other benchmarks").

The first call of each method in a fresh, cold process (no auto table, no compilation
cache), as a user's one-off script or `ouroboros-jax generate` pays it; methods interleaved
over repeats, each (method, repeat) its own process; or, with --one-process, every method's
first call one after the other in one fresh process per repeat (what a notebook that tries
each method pays; a later method may run a loop an earlier one compiled).

    python -m experiments.first_call --reps 3 --max-new-tokens 128
    python -m experiments.first_call --reps 3 --max-new-tokens 128 --one-process

Default models: the demo pair. Prints one JSON object: per method the first call's seconds
per repeat, their median, and the median ratio to vanilla's first call in the same repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import jax
# where the first call's seconds go: jax's trace, lowering and backend-compile durations
# (summed per event, and the longest compiles with their program names from jax_log_compiles)
events, compiles = {}, []
def on_duration(name, secs, **kw):
    n, s = events.get(name, (0, 0.0))
    events[name] = (n + 1, s + secs)
jax.monitoring.register_event_duration_secs_listener(on_duration)
import logging
class Grab(logging.Handler):
    def emit(self, r):
        m = r.getMessage()
        if m.startswith("Finished"):
            compiles.append([m.rsplit(" in ", 1)[0], float(m.rsplit(" ", 2)[-2])])
logging.getLogger("jax._src.dispatch").addHandler(Grab())
logging.getLogger("jax._src.dispatch").setLevel(logging.DEBUG)
jax.config.update("jax_log_compiles", True)
import ouroboros_jax as oj
method, n, target_dir, draft_dir, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
if target_dir:
    target = oj.load_model(target_dir)
    draft = oj.load_model(draft_dir) if draft_dir else None
else:
    target, draft = oj.demo_pair()
from ouroboros_jax.decoding import METHODS
for method in method.split(","):  # (several: each one's first call, one after the other)
    events.clear(); compiles.clear()
    kw = {} if method == "vanilla" else {"config": "auto"}
    if METHODS[method].needs_draft:
        kw["draft"] = draft
    t, c = time.perf_counter(), time.process_time()
    out = oj.generate(target, [prompt], method=method, max_new_tokens=n, **kw)
    first, cpu = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"method": method, "first_call": first, "first_call_cpu": cpu,
                      "tokens": out.tokens[0], "auto": out.stats.get("auto"),
                      "events": {k.rsplit("/", 1)[-1]: [n, round(s, 3)]
                                 for k, (n, s) in events.items()},
                      "compiles": sorted(compiles, key=lambda c: -c[1])[:12]}), flush=True)
"""

PROMPT = 'def merge_sorted(left, right):\n    """Merge two sorted lists into one sorted list."""\n'


def first_call(method: str, n: int, target: str = "", draft: str = "", prompt: str = PROMPT
               ) -> dict:
    """One fresh process with empty auto and compilation caches -> its first call's JSON."""
    return first_calls([method], n, target, draft, prompt)[method]


def first_calls(methods: list, n: int, target: str = "", draft: str = "", prompt: str = PROMPT
                ) -> dict:
    """One fresh process with empty auto and compilation caches, each method's first call in
    it in turn -> {method: its first call's JSON}."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, OUROBOROS_JAX_CACHE=os.path.join(d, "auto"),
                   JAX_COMPILATION_CACHE_DIR=os.path.join(d, "jax"),
                   JAX_ENABLE_COMPILATION_CACHE="false", HF_HUB_OFFLINE="1")
        env.pop("XLA_FLAGS", None)
        r = subprocess.run([sys.executable, "-c", _CHILD, ",".join(methods), str(n), target,
                            draft, prompt], env=env, capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"{','.join(methods)}: child failed\n{r.stderr[-2000:]}")
    outs = [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("{")]
    return {o["method"]: o for o in outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.first_call")
    ap.add_argument("--methods", default="vanilla,speculative,ouroboros")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--target", default="", help="target directory (default: the demo pair)")
    ap.add_argument("--draft", default="")
    ap.add_argument("--one-process", action="store_true",
                    help="every method's first call in one fresh process per repeat, in the "
                    "order given (vanilla first where not named), not a process per (method, repeat)")
    a = ap.parse_args(argv)
    methods = a.methods.split(",")
    if "vanilla" not in methods:
        methods = ["vanilla"] + methods
    secs = {m: [] for m in methods}
    cpus = {m: [] for m in methods}  # the process's CPU seconds in the call: on a loaded
    # machine (other jobs on its cores) steadier than the wall clock
    same = {m: True for m in methods}
    auto, where = {}, {}  # where: the last repeat's jax durations and longest compiles
    for r in range(a.reps):
        ref = None
        together = (first_calls(methods, a.max_new_tokens, a.target, a.draft)
                    if a.one_process else None)
        for m in methods:
            o = (together[m] if together is not None
                 else first_call(m, a.max_new_tokens, a.target, a.draft))
            secs[m].append(o["first_call"])
            cpus[m].append(o["first_call_cpu"])
            ref = o["tokens"] if m == "vanilla" else ref
            same[m] &= o["tokens"] == ref
            auto[m] = o["auto"]
            where[m] = {"events": o["events"], "longest": o["compiles"][:4]}
            print(f"[first_call] repeat {r + 1}: {m} {o['first_call']:.1f} s "
                  f"({o['first_call_cpu']:.1f} s CPU)", file=sys.stderr, flush=True)
    van, van_cpu = np.array(secs["vanilla"]), np.array(cpus["vanilla"])
    res = {"command": "python -m experiments.first_call " + " ".join(
        sys.argv[1:] if argv is None else argv), "methods": {}}
    for m in methods:
        s = np.array(secs[m])
        res["methods"][m] = {"seconds": [round(x, 2) for x in s], "median": float(np.median(s)),
                             "ratio_to_vanilla": [round(x, 2) for x in s / van],
                             "ratio_median": float(np.median(s / van)),
                             "cpu_seconds": [round(x, 2) for x in cpus[m]],
                             "cpu_ratio_median": float(np.median(np.array(cpus[m]) / van_cpu)),
                             "identical": same[m], "auto": auto[m], "jax": where[m]}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
