"""Which quantized matmul: our `quant.linear` or qwix's `dot_general` on a qwix `QArray`?
Result: docs/quantization.md ("Why our own container").

One linear layer of Qwen2.5-Coder-1.5B's MLP (1536 x 8960, the issue's shape), x of T = 1 and
16 rows, each product jitted and timed side by side in this process (median of 30 calls after
a warm-up): float32 `x @ w`, ours (int8 per channel; int4 in groups of 128) and qwix's (int8
per channel; int4 tiled 128 along the input), plus each one's largest difference from x @ the
dequantized weight. On a CPU this shows the convert cost (XLA:CPU does not fuse it into the
dot); on a GPU or TPU it is the comparison that decides (run it there the same way).

    python experiments/quant_matmul.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from ouroboros_jax.models import quant

I, O = 1536, 8960


def timed(fn, *args, reps=30):
    fn(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((I, O)) * 0.02, jnp.float32)
    ours = {"int8": quant.quantize(w, 1, 8), "int4": quant.quantize(w, 1, 4, group_size=128)}
    theirs = {"int8": qwix.quantize(w, jnp.int8, channelwise_axes=(1,)),
              "int4": qwix.quantize(w, jnp.int4, channelwise_axes=(1,), tiled_axes={0: 128})}
    dn = (((1,), (0,)), ((), ()))
    f_float = jax.jit(lambda x, w: x @ w)
    f_ours = jax.jit(lambda x, q: quant.linear(x, q))
    f_qwix = jax.jit(lambda x, q: qwix.dot_general(x, q, dn, preferred_element_type=jnp.float32))
    print(f"{'T':>3} {'product':<14}{'ms':>9}{'x float':>9}{'max |diff|':>12}")
    for T in (1, 16):
        x = jnp.asarray(rng.standard_normal((T, I)), jnp.float32)
        base = timed(f_float, x, w)
        print(f"{T:>3} {'float32':<14}{base * 1e3:>9.3f}{1.0:>9.2f}{'':>12}")
        for scheme in ("int8", "int4"):
            ref = x @ quant.dequantize(ours[scheme])
            for name, f, q in (("ours", f_ours, ours[scheme]), ("qwix", f_qwix, theirs[scheme])):
                t = timed(f, x, q)
                ref_q = ref if name == "ours" else x @ qwix.dequantize(q)
                diff = float(jnp.max(jnp.abs(f(x, q) - ref_q)))
                print(f"{T:>3} {name + ' ' + scheme:<14}{t * 1e3:>9.3f}{t / base:>9.2f}"
                      f"{diff:>12.2e}")


if __name__ == "__main__":
    main()
