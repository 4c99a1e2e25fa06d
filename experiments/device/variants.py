"""Why does a forward cost what it costs on the device? Result: docs/bench/device-h200.md,
section 1 (raw: docs/bench/device-h200/variants.json).

One forward timed under each combination of the two switches that change its program, each in
a fresh process (both are read at trace time).

    python -m experiments.device.variants --out $OUT          # on the device
    python -m experiments.device.variants --tiny --out /tmp/v # anywhere (CI)

- layers: `stacked` (a `lax.scan` over the stacked layer weights, the default off a CPU) or
  `packed` (one buffer per layer, the layers unrolled: `models.layout.set_packing(True)`);
- attention: `blockwise` (an online softmax in a `fori_loop` over live cache blocks, the
  default) or `dense` (one softmax over every slot: `models.attention.set_kernel("dense")`).

A `while` loop on a GPU returns its predicate to the host every iteration, and a scan over
stacked weights may copy each layer's weights out of the stack before its matmuls; these two
variants take each away in turn. Per variant and model shape: t(T) at T = 1 and 16 (bf16,
random weights built on the device, after --context cached tokens), and at the main pair's
shapes vanilla's and speculative decoding's (γ 4) seconds per token through `generate`.
Written as variants.json under --out; the last lines printed are a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = (("stacked", "blockwise"), ("stacked", "dense"), ("packed", "blockwise"),
            ("packed", "dense"))
# the first two are the pair `generate` runs; the Qwen pair's shapes price the real pair
FULL_MODELS = ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def one_variant(layers: str, attention: str, models, tiny: bool, context: int,
                sizes, new_tokens: int) -> dict:
    """Times the forwards and calls of one variant in this process (switches set first)."""
    import numpy as np

    from ouroboros_jax.models.attention import set_kernel
    from ouroboros_jax.models.layout import set_packing
    from ouroboros_jax.bench.cost_model import forward_timer
    from experiments.device.probe import random_model, tiny_configs

    set_packing(layers == "packed")
    set_kernel(attention)
    from ouroboros_jax.models.presets import PRESETS

    configs = {m: (tiny_configs()[i % 2] if tiny else PRESETS[m]) for i, m in enumerate(models)}
    out = {"layers": layers, "attention": attention, "t_of_T": {}, "calls": {}}
    built = {}
    for i, (name, cfg) in enumerate(configs.items()):
        model = built[name] = random_model(cfg, "bfloat16", i)
        out["t_of_T"][name] = {}
        for n in sizes:
            timed = forward_timer(model, int(n), context)
            out["t_of_T"][name][int(n)] = float(np.median([timed() for _ in range(7)]))
    from ouroboros_jax import generate

    target, draft = built[models[0]], built[models[1]]
    prompt = [list(np.random.default_rng(0).integers(1, target.config.vocab_size, 64))]
    for method in ("vanilla", "speculative"):
        kw = dict(draft=draft if method != "vanilla" else None, method=method, config=None,
                  max_new_tokens=new_tokens, eos_token_id=-1)
        t0 = time.perf_counter()
        generate(target, prompt, **kw)
        first = time.perf_counter() - t0
        st = generate(target, prompt, **kw).stats
        out["calls"][method] = {"seconds_per_token": st["seconds"] / st["new_tokens"],
                                "seconds_per_round": st["seconds"] / st["target_calls"],
                                "first_call_seconds": first}
    return out


def table(rows) -> str:
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layers']:>7} {r['attention']:>9}: {r['error']}")
            continue
        cells = "  ".join(f"{m} " + "/".join(f"{t * 1e3:.2f}" for t in ts.values())
                          for m, ts in r["t_of_T"].items())
        calls = "  ".join(f"{m} {c['seconds_per_token'] * 1e3:.2f} ms/tok"
                          for m, c in r["calls"].items())
        lines.append(f"{r['layers']:>7} {r['attention']:>9}: t(T) ms {cells} | {calls}")
    return "\n".join(lines)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "device-out")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CI, any CPU)")
    ap.add_argument("--context", type=int, default=None, help="default 512, --tiny 16")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32, --tiny 4")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # LAYERS,ATTENTION: child
    a = ap.parse_args(argv)
    context = a.context or (16 if a.tiny else 512)
    new_tokens = a.new_tokens or (4 if a.tiny else 32)
    models = ("tiny-target", "tiny-draft") if a.tiny else FULL_MODELS
    sizes = (1, 16)
    if a.one:
        layers, attention = a.one.split(",")
        print(json.dumps(one_variant(layers, attention, models, a.tiny, context, sizes,
                                     new_tokens)))
        return []
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for layers, attention in VARIANTS:
        cmd = [sys.executable, "-m", "experiments.device.variants", "--one",
               f"{layers},{attention}", "--context", str(context), "--new-tokens",
               str(new_tokens)] + (["--tiny"] if a.tiny else [])
        t0 = time.perf_counter()
        # from the repository root, where `experiments` is importable (it is not installed)
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                  os.path.abspath(__file__)))))
        if proc.returncode == 0:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            row = {"layers": layers, "attention": attention,
                   "error": proc.stderr.strip().splitlines()[-1][-300:]}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"[variants] {layers}/{attention}: {row['seconds']:.0f} s", file=sys.stderr,
              flush=True)
        with open(os.path.join(a.out, "variants.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
