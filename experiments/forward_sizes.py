"""What does one forward of T tokens cost, by how the model's weights are kept? Result:
docs/quantization.md ("The draft's own form, w8a8") and docs/performance.md.

    python -m experiments.forward_sizes --model D.gguf --quantize none,int8,w8a8 \
        --sizes 1,2,4,9,16 --context 64

For each --quantize form (none: the dtype's float weights): the model loaded so
(`load_model(quantize=)`), then for each T of --sizes the median of --reps timings of
`models.timing.forward_timer` (a compiled loop of forwards of T tokens after --context cached
tokens, the weights as warm as back-to-back forwards leave them). Prints one JSON line per form.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF directory or a .gguf file")
    ap.add_argument("--quantize", default="none", help="comma-separated: none, int8, int4, w8a8")
    ap.add_argument("--sizes", default="1,2,4,9,16", help="comma-separated token counts T")
    ap.add_argument("--context", type=int, default=64, help="cached tokens before the forward")
    ap.add_argument("--reps", type=int, default=5, help="timings per size (median)")
    args = ap.parse_args(argv)

    import ouroboros_jax as oj
    from ouroboros_jax.models.timing import forward_timer

    sizes = [int(t) for t in args.sizes.split(",")]
    for form in args.quantize.split(","):
        model = oj.load_model(args.model, quantize=None if form == "none" else form)
        ms = {}
        for t in sizes:
            timer = forward_timer(model, t, args.context, args.context + max(sizes) + 16,
                                  inner=4)
            ms[t] = round(1000 * statistics.median(timer() for _ in range(args.reps)), 1)
        print(json.dumps({"quantize": form, "context": args.context, "ms_by_tokens": ms}),
              flush=True)
        del model


if __name__ == "__main__":
    main()
