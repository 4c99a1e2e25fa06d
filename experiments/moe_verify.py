"""What does a mixture-of-experts target's forward of T tokens cost, grouped beside one-hot: a
verification of T nodes against a decoding step (issue 57)? Result: docs/performance.md,
"Mixture-of-experts verification".

    python -m experiments.moe_verify --reps 5

A random MoE model (`--experts` experts, top `--top-k`, layers of `--hidden` / `--expert-ffn`:
by default 8 experts, top 2, about 480 MB of fp32 weights) runs forwards of T tokens (random
ids, fixed seed: tokens route to different experts, as a verification tree's do) per row after
`--context` cached tokens, for each T of `--sizes`, through both expert paths
(`ModelConfig.moe_dispatch`): "grouped" (routed rows sorted by expert; below Y routed rows
only the routed experts' weights are gathered and read, `llama._moe_grouped`) and "onehot"
(every expert on every token). Interleaved over `--reps` rounds (the machine may be shared):
medians in ms, with the distinct experts the T tokens route to in the first layer. Prints one
JSON object.

Beside the measured times, the cost model's (decoding/cost.py, auto/prices.py) for the
grouped path: the expected distinct experts under uniform routing (`cost.expected_experts`),
"union_ms" the model's shape (dense weights plus those experts read at this device's
calibrated bandwidth, active flops per token) scaled to the measured grouped t(1), and
"auto_ms" what `config="auto"` prices: the shape times the measured t(1), t(2), t(8) over it,
read between them as `prices.anchored` does (when 1, 2 and 8 are among the sizes; exact there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.auto import prices
from ouroboros_jax.decoding import cost
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models import Model
from ouroboros_jax.models.kv_cache import init_cache
from ouroboros_jax.models.llama import (causal_mask, embed_tokens, forward, init_params, rms_norm,
                                        route)


def moe_config(args, dispatch: str) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.expert_ffn, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.heads // 2,
                       max_position_embeddings=4096, num_experts=args.experts,
                       experts_per_token=args.top_k, moe_intermediate_size=args.expert_ffn,
                       norm_topk_prob=True, moe_dispatch=dispatch)


def forward_timer(params, config: ModelConfig, tokens: np.ndarray, context: int,
                  inner: int = 4):
    """A callable returning seconds per forward of tokens int[B,T] after `context` cached
    tokens: a compiled loop of `inner` forwards (each reading all logits, so none is folded
    away), compiled here."""
    B, T = tokens.shape
    cache = init_cache(config, B, context + T + 16, jnp.float32)
    cache = dataclasses.replace(cache, lengths=jnp.full((B,), context, jnp.int32))
    pos = jnp.broadcast_to(context + jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    mask = causal_mask(B, T)

    def one(acc, params, toks):
        toks = toks + (acc > 1e30).astype(jnp.int32)  # depends on the carry: not hoisted
        logits, kv = forward(params, config, toks, pos, mask, cache)
        return acc + jnp.max(logits) + jnp.max(kv.k)

    f = jax.jit(lambda p, t: jax.lax.fori_loop(0, inner, lambda i, a: one(a, p, t),
                                               jnp.zeros((), jnp.float32)))
    toks = jnp.asarray(tokens, jnp.int32)
    f(params, toks).block_until_ready()

    def timed() -> float:
        t0 = time.perf_counter()
        f(params, toks).block_until_ready()
        return (time.perf_counter() - t0) / inner

    return timed


def first_layer_experts(params, config: ModelConfig, tokens: np.ndarray) -> int:
    """Distinct experts the tokens' embeddings route to in layer 0 (its router applied to the
    normed embeddings, an indication of the union a verification reads)."""
    x = embed_tokens(params, config, jnp.asarray(tokens))
    h = rms_norm(x, params["layers"]["mlp_norm"][0], config.rms_norm_eps)
    experts, _ = route(config, h.reshape(-1, config.hidden_size),
                       params["layers"]["router"][0])
    return int(np.unique(np.asarray(experts)).size)


def predicted(params, config: ModelConfig, context: int, sizes, measured: dict) -> dict:
    """{"union_ms": {T: ms}, "auto_ms": {T: ms} or None}: the cost model's grouped t(T) (see the
    module's docstring) from this device's calibration and the measured grouped {T: ms}."""
    rates = prices.calibrate(jnp.float32)
    everything = sorted(set(sizes) | set(prices.ANCHOR_SIZES))
    shape = cost.shape_latency(prices.model_shape(Model(config, params)), rates, 1, context,
                               everything)
    union = {T: measured[1] * shape[T] / shape[1] for T in sizes}
    if not all(n in measured for n in prices.ANCHOR_SIZES):
        return {"union_ms": union, "auto_ms": None}
    anchor = tuple(measured[n] / shape[n] for n in prices.ANCHOR_SIZES)
    return {"union_ms": union, "auto_ms": prices.anchored({T: shape[T] for T in sizes}, anchor)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--expert-ffn", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args(argv)

    configs = {d: moe_config(args, d) for d in ("grouped", "onehot")}
    params = init_params(configs["grouped"], jax.random.key(0))
    weights = sum(a.nbytes for a in jax.tree.leaves(params))
    rng = np.random.RandomState(0)
    tokens = {T: rng.randint(0, args.vocab, size=(1, T)) for T in args.sizes}
    timers = {(d, T): forward_timer(params, configs[d], tokens[T], args.context)
              for d in configs for T in args.sizes}
    runs: dict = {k: [] for k in timers}
    for _ in range(args.reps):  # interleaved: drift on a shared machine hits both paths alike
        for k, timed in timers.items():
            runs[k].append(timed())
    rows = []
    for T in args.sizes:
        g = statistics.median(runs[("grouped", T)]) * 1e3
        o = statistics.median(runs[("onehot", T)]) * 1e3
        rows.append({"T": T, "grouped_ms": round(g, 3), "onehot_ms": round(o, 3),
                     "onehot_over_grouped": round(o / g, 2),
                     "layer0_distinct_experts": first_layer_experts(params, configs["grouped"],
                                                                    tokens[T])})
    t1 = rows[0]["grouped_ms"]
    for r in rows:
        r["grouped_over_t1"] = round(r["grouped_ms"] / t1, 2)
    if 1 in args.sizes:
        model = predicted(params, configs["grouped"], args.context, args.sizes,
                          {r["T"]: r["grouped_ms"] for r in rows})
        for r in rows:
            r["uniform_experts"] = round(cost.expected_experts(args.experts, args.top_k,
                                                               r["T"]), 2)
            # (microseconds kept: on a toy model the curve rises by less than 1e-3 ms a step,
            # and rounding to ms/1000 made two sizes tie)
            r["union_ms"] = round(model["union_ms"][r["T"]], 6)
            r["auto_ms"] = None if model["auto_ms"] is None else round(
                model["auto_ms"][r["T"]], 3)
    out = {"weights_mb": round(weights / 2**20), "experts": args.experts,
           "top_k": args.top_k, "backend": jax.default_backend(), "rows": rows}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
