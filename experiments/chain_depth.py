"""What does a deeper chain buy on the real pair's chat answer, against what its forwards cost?
Result: docs/real-models.md ("Stop 62": γ 12 decodes the first-contact answer in 21.1 s against
γ 8's 25.2 s; the draft's 1-token forward 98 ms, the target's 310 ms, its 9-token one 686 ms).

    python -m experiments.chain_depth --gammas 8,12,16,24

Loads the pair once (float32), times each model's forward of 1 and of γ+1 tokens
(`models.timing.forward_timer`, 64 cached tokens of 256 slots, median of 3 after one), then
for each γ runs speculative decoding on the first-contact chat prompt twice and reports the
second call's wall clock, its rounds (target forwards), draft forwards and η, and whether its
tokens equal the first γ's (greedy: they must).
"""

from __future__ import annotations

import argparse
import statistics
import time

CHAT = ("Write a Python function that returns the n-th Fibonacci number iteratively, with a "
        "docstring.")


def main(argv=None) -> None:
    import os

    import ouroboros_jax as oj
    from ouroboros_jax.models import load_model
    from ouroboros_jax.models.timing import forward_timer

    real = os.path.expanduser("~/.cache/ouroboros-real")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=f"{real}/qwen2.5-coder-1.5b-instruct-q4_k.gguf")
    ap.add_argument("--draft", default=f"{real}/qwen2.5-coder-0.5b-instruct-q4.gguf")
    ap.add_argument("--gammas", default="8,12,16,24")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    gammas = [int(g) for g in a.gammas.split(",")]
    target = load_model(a.target, dtype="float32")
    draft = load_model(a.draft, dtype="float32")

    def ms(model, n):
        timer = forward_timer(model, n, context=64, slots=256)
        timer()
        return 1000 * statistics.median(timer() for _ in range(3))

    sizes = sorted({1} | {g + 1 for g in gammas})
    print("forward ms:", {"draft 1": round(ms(draft, 1), 1),
                          **{f"target {n}": round(ms(target, n), 1) for n in sizes}}, flush=True)
    prompt = [[{"role": "user", "content": CHAT}]]
    first = None
    for g in gammas:
        kw = dict(draft=draft, method="speculative", config=oj.SpeculativeConfig(gamma=g),
                  max_new_tokens=a.max_new_tokens)
        oj.generate(target, prompt, **kw)  # compiles
        t0 = time.perf_counter()
        out = oj.generate(target, prompt, **kw)
        wall = time.perf_counter() - t0
        s = out.stats
        first = first if first is not None else out.tokens
        print(f"gamma {g}: {wall:.2f} s, rounds {s['target_calls']}, draft forwards "
              f"{s['draft_calls']}, eta {s['eta']:.2f}, tokens == gamma {gammas[0]}'s: "
              f"{out.tokens == first}", flush=True)


if __name__ == "__main__":
    main()
