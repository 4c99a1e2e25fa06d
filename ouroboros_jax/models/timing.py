"""Timing forwards by input size, as decoding runs them: the one timer the cost model, the
engine benches and `config="auto"`'s latency probe share.

A forward's time depends on what ran just before it, not only on its input size: on a CPU a
model whose weights fit in the last-level cache (the demo draft: about 13 MB of fp32 weights
read per token, in a 32 MB L3) runs faster when it runs again and again than right after the
target has streamed its own weights through that cache, as every decoding round does. So the
timer takes a sequence of forwards (`sequence_timer`) and `forward_timer` is the one-forward case.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from . import few_rows
from .kv_cache import init_cache
from .layout import decode_params
from .llama import causal_mask, forward


def timing_tokens(batch: int, n: int, vocab: int) -> jax.Array:
    """int32[batch, n] token ids a timed forward takes: all different (a stride through the
    vocabulary), as a verification's nodes are. A mixture of experts routes each token to its
    own experts, so its forward's cost depends on how many distinct experts the tokens reach:
    n copies of one token route to the same k experts in every layer, and time a verification
    of n nodes at about the price of one token's experts."""
    ids = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
    return (ids * 7919 + 1) % vocab  # distinct while batch * n <= vocab (7919 is prime)


def _inputs(model, n: int, context: int, slots: int, batch: int):
    """(tokens, positions, causal mask, cache) of an n-token forward per row after `context`
    cached tokens in a cache of `slots` slots."""
    cache = init_cache(model.config, batch, slots, model.dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
    tokens = timing_tokens(batch, n, model.config.vocab_size)
    pos = jnp.broadcast_to(context + jnp.arange(n, dtype=jnp.int32)[None], (batch, n))
    mask = causal_mask(batch, n)
    return tokens, pos, mask, cache


def read_all(logits: jax.Array, kv) -> jax.Array:
    """A scalar that depends on every logit [B,T,V] and every new K and V [L,B,T,K,D] of a
    forward, so a timed forward computes all of what decoding reads:
    - every logit, as decoding's argmax over each scored node reads them: one element
      (logits[0, -1, 0]) let XLA slice the LM head down to one column, which priced
      Qwen2.5-0.5B's 1-token forward at 70 ms where its decode step takes 95;
    - every new K/V, as decoding writes them to its cache: dropped, they let XLA fuse each
      layer's projections differently, which priced the demo target's 2- and 5-token forwards
      at 4.78 / 5.18 ms where its prompt-lookup rounds (a 2- or 5-token forward each, with
      the round's other work) take 4.38 / 4.84; read, they time 4.14 / 4.29 ms."""
    return jnp.max(logits) + jnp.max(kv.k) + jnp.max(kv.v)


def sequence_timer(steps, context: int, slots: int, batch: int = 1, inner: int = 8):
    """steps: [(model, n), ...] forwards run in this order -> a callable returning seconds per
    pass over the sequence. A step (model, n, q) computes logits for q of its n nodes only (a
    forward with `select`, as the lookahead step's), (model, n) for all of them (as verify).

    A compiled loop of `inner` passes; each forward takes n tokens per row at `batch` rows after
    `context` cached tokens in a cache of `slots` slots (attention reads the blocks below
    `context` only), with no dispatch per forward. Compiled here, so the first timing excludes
    compilation."""
    models = [s[0] for s in steps]
    inputs = [_inputs(s[0], s[1], context, slots, batch) for s in steps]
    selects = [None if len(s) < 3 else jnp.broadcast_to(jnp.arange(s[2], dtype=jnp.int32)[None],
                                                         (batch, s[2])) for s in steps]

    def one_pass(acc, params, inputs):
        for m, p, (t, q, mask, c), sel in zip(models, params, inputs, selects):
            # the input depends on the carry, so no forward can be hoisted out of the loop
            t = t + (acc > 1e30).astype(jnp.int32)
            logits, kv = forward(p, m.config, t, q, mask, c, select=sel)
            acc = acc + read_all(logits, kv)
        return acc

    # params and inputs are arguments, not constants, so XLA cannot fold any of the work away
    # (a cache captured as a constant of zeros would let it drop attention over the cache)
    f = jax.jit(lambda params, inputs: jax.lax.fori_loop(
        0, inner, lambda i, acc: one_pass(acc, params, inputs), jnp.zeros((), jnp.float32)))
    # the layout decoding runs on (packed on a CPU, layout.py), so a probe times what it prices
    params = [decode_params(m) for m in models]
    f(params, inputs).block_until_ready()  # compile

    def timed() -> float:
        t0 = time.perf_counter()
        f(params, inputs).block_until_ready()
        return (time.perf_counter() - t0) / inner

    return timed


def forward_timer(model, n: int, context: int, slots: int, batch: int = 1, inner: int = 8):
    """`sequence_timer` of one forward of n tokens per row: seconds per forward, the model's
    weights as warm in the CPU's caches as back-to-back forwards leave them."""
    return sequence_timer([(model, n)], context, slots, batch=batch, inner=inner)


def matmul_timer(rows: int, k: int, dtype, inner: int = 8):
    """A callable returning seconds per [rows, k] x [k, k] matmul of `dtype`: a compiled loop of
    `inner` matmuls, each multiplying the last one's whole product (nothing hoisted, and no
    reduction for XLA to fuse the product into), the weights an argument (nothing folded).
    Compiled here: the first timing excludes compilation. The device calibration's one
    measurement (`config="auto"`: bandwidth at 1 row, flop rate at many)."""
    w = jnp.full((k, k), 1.0 / k, dtype)  # keeps the carried product at ones
    x = jnp.ones((rows, k), dtype)
    # the product the models run (`few_rows.matmul`: the few-row CPU kernel where it applies),
    # so that a calibration prices the verification forwards decoding will actually run
    f = jax.jit(lambda w, x: jax.lax.fori_loop(0, inner, lambda i, a: few_rows.matmul(a, w), x))
    f(w, x).block_until_ready()  # compile

    def timed() -> float:
        t0 = time.perf_counter()
        f(w, x).block_until_ready()
        return (time.perf_counter() - t0) / inner

    return timed
