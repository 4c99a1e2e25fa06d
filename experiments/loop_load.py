"""Is a loop read back from the persistent compile cache cheap? Result: printed (JSON); figures in
docs/real-models.md ("The first answer, process by process").

Two fresh processes over one fresh compile cache and auto store, each one `generate` call
(config="auto"): the first compiles the call's loop and writes it to the cache, the second
reads it back (auto's choice is the same: the first process's choice is stored). Per process:
the call's seconds and jax's own durations: tracing, lowering to MLIR, backend compile, and
cache retrieval (jax re-traces and re-lowers a function even where the cache holds its
program: the cache is keyed by the lowered module).

    python -m experiments.loop_load                                   # the demo pair
    python -m experiments.loop_load --target T.gguf --draft D.gguf --chat "..."
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
import jax
events = {}
def on_duration(name, secs, **kw):
    n, s = events.get(name, (0, 0.0))
    events[name] = (n + 1, s + secs)
def on_event(name, **kw):
    n, s = events.get(name, (0, 0.0))
    events[name] = (n + 1, s)
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
import ouroboros_jax as oj
from ouroboros_jax import compile_cache
compile_cache.enable(sys.argv[5])
target_path, draft_path, chat, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if target_path:
    target, draft = oj.load_model(target_path), oj.load_model(draft_path)
else:
    target, draft = oj.demo_pair()
prompt = [[{"role": "user", "content": chat}]] if chat else [sys.argv[6]]
events.clear()
t = time.perf_counter()
out = oj.generate(target, prompt, draft=draft, max_new_tokens=n)
call = time.perf_counter() - t
print(json.dumps({"call_seconds": round(call, 2),
                  "decode_seconds": round(out.stats["decode_seconds"], 2),
                  "auto": {k: out.stats["auto"][k] for k in ("method", "config", "compiled")},
                  "events": {k.rsplit("/", 1)[-1]: [n, round(s, 3)]
                             for k, (n, s) in sorted(events.items())},
                  "tokens": out.tokens[0]}))
"""


PROMPT = 'def merge_sorted(left, right):\n    """Merge two sorted lists into one sorted list."""\n'


def one(target: str, draft: str, chat: str, n: int, cache: str, store: str) -> dict:
    env = dict(os.environ, OUROBOROS_JAX_CACHE=store, HF_HUB_OFFLINE="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _CHILD, target, draft, chat, str(n), cache, PROMPT],
                       env=env, capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"child failed\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.loop_load")
    ap.add_argument("--target", default="", help="target (default: the demo pair)")
    ap.add_argument("--draft", default="")
    ap.add_argument("--chat", default="", help="one user message (default: a code prompt)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        cache, store = os.path.join(d, "xla"), os.path.join(d, "auto")
        runs = [one(a.target, a.draft, a.chat, a.max_new_tokens, cache, store)
                for _ in range(2)]
    same = runs[0]["tokens"] == runs[1]["tokens"]
    for r in runs:
        r.pop("tokens")
    print(json.dumps({"command": "python -m experiments.loop_load " + " ".join(
        sys.argv[1:] if argv is None else argv), "compiling": runs[0], "from_cache": runs[1],
        "same_tokens": same}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
