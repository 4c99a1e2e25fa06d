"""Timing one model's forward by input size, as decoding runs it: the one timer the cost model,
the engine benches and `config="auto"`'s latency probe share."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from .kv_cache import init_cache
from .llama import forward


def forward_timer(model, n: int, context: int, slots: int, batch: int = 1, inner: int = 8):
    """A compiled loop of `inner` forwards of n tokens per row at `batch` rows, after `context`
    cached tokens in a cache of `slots` slots (attention reads the blocks below `context`
    only), no dispatch per forward -> a callable returning seconds per forward (compiled here,
    so the first timing excludes compilation)."""
    cfg = model.config
    cache = init_cache(cfg, batch, slots, model.dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, n), jnp.int32)
    pos = jnp.broadcast_to(context + jnp.arange(n, dtype=jnp.int32)[None], (batch, n))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool))[None], (batch, n, n))

    def body(acc, p, t, q, m, c):
        # the input depends on the carry, so the forward cannot be hoisted out of the loop
        t = t + (acc > 1e30).astype(jnp.int32)
        logits = forward(p, cfg, t, q, m, c)[0]  # logits of every node, as verification needs
        return acc + logits[0, -1, 0]

    # inputs are arguments, not constants, so XLA cannot fold any of the work away
    f = jax.jit(lambda p, t, q, m, c: jax.lax.fori_loop(
        0, inner, lambda i, acc: body(acc, p, t, q, m, c), jnp.zeros((), jnp.float32)))
    f(model.params, tokens, pos, mask, cache).block_until_ready()  # compile

    def timed() -> float:
        t0 = time.perf_counter()
        f(model.params, tokens, pos, mask, cache).block_until_ready()
        return (time.perf_counter() - t0) / inner

    return timed
