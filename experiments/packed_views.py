"""Does decoding on the CPU's packed views (one copy of the weights) cost speed against the
fused packed copy it replaced, or the stacked layout? Result: printed (a table); quoted in
docs/real-models.md ("Memory").

One process, one model: for each layout (`layout.set_packing`: True = views on a CPU,
"fused" = the fused copy a GPU makes, False = stacked) a compiled loop of forwards of T tokens
over a cache of `--context` tokens (`timing.forward_timer`: the weights as warm as
back-to-back forwards leave them), timed in interleaved rounds so that the machine's load
falls on every layout alike; the median per layout and its ratio to the views'.

    python -m experiments.packed_views --model ~/.cache/ouroboros-real/qwen2.5-coder-0.5b-instruct-q4.gguf
"""

from __future__ import annotations

import argparse
import statistics

LAYOUTS = (("views", True), ("fused copy", "fused"), ("stacked", False))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file or HF directory")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="T per forward")
    p.add_argument("--context", type=int, default=256, help="cached tokens the forwards attend")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)

    import ouroboros_jax as oj
    from ouroboros_jax.models import layout
    from ouroboros_jax.models.timing import forward_timer

    model = oj.load_model(a.model)
    timers = {}
    for name, kind in LAYOUTS:
        layout.set_packing(kind)
        layout.release(model)  # each layout made anew from the canonical params
        for t in a.tokens:
            slots = -(-(a.context + t) // 128) * 128  # a whole number of cache blocks
            timers[name, t] = forward_timer(model, t, a.context, slots=slots)
    layout.set_packing(None)
    times = {k: [] for k in timers}
    for _ in range(a.rounds):
        for k, timed in timers.items():
            times[k].append(timed())
    print(f"{a.model}: ms per forward over {a.context} cached tokens, median of {a.rounds} "
          "interleaved rounds (ratio to the views')")
    print("| T | " + " | ".join(n for n, _ in LAYOUTS) + " |")
    print("|---:|" + "---:|" * len(LAYOUTS))
    for t in a.tokens:
        base = statistics.median(times["views", t])
        print(f"| {t} | " + " | ".join(
            f"{statistics.median(times[n, t]) * 1e3:.1f} "
            f"({statistics.median(times[n, t]) / base:.2f}x)" for n, _ in LAYOUTS) + " |")


if __name__ == "__main__":
    main()
