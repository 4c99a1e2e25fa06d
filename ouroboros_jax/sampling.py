"""Turning logits into tokens: the processed distribution (temperature, top-k, top-p) and
reproducible random keys.

Keys are folded from (seed, row, position): the token that lands at absolute position `p` of
row `b` is always drawn with the same key, however many tokens a step accepts and whichever
decoding method runs. With deterministic draft candidates this makes a speculative method's
sampled output identical to vanilla sampling's for the same seed, not only equal in law
(docs/algorithm.md section 6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    """Dynamic sampling knobs (arrays, so changing them never recompiles).

    Greedy decoding is a static choice made by the caller (`greedy=True`), not temperature 0
    at run time, so the greedy path carries no sort over the vocabulary.

    Attributes:
        temperature: f32[].
        top_k: int32[] (0 = off).
        top_p: f32[] (1 = off).
        seed: uint32[] (or int32[]): the root of every token key (`token_key`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array

    @staticmethod
    def make(temperature=1.0, top_k=0, top_p=1.0, seed=0) -> "SamplingParams":
        return SamplingParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                              jnp.asarray(top_p, jnp.float32), jnp.asarray(seed, jnp.uint32))


def process_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """[..., V] logits -> [..., V] log-probabilities of the processed distribution.

    Order as in transformers: temperature, then top-k, then top-p (keep the smallest set of
    most likely tokens whose probability reaches top_p; always at least one token).
    """
    x = logits.astype(jnp.float32) / jnp.maximum(sp.temperature, 1e-6)
    V = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)
    kth = jnp.take_along_axis(sorted_x, jnp.broadcast_to(k - 1, x.shape[:-1])[..., None], -1)
    x = jnp.where(x < kth, -jnp.inf, x)
    sorted_x = jnp.where(jnp.arange(V) < k, sorted_x, -jnp.inf)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep_sorted = before < sp.top_p
    keep_sorted = keep_sorted.at[..., 0].set(True)
    # threshold = smallest kept logit; ties at the threshold are kept (as transformers does)
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    thresh = jnp.take_along_axis(sorted_x, n_keep - 1, -1)
    x = jnp.where(x < thresh, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


def token_key(seed: jax.Array, row: jax.Array, position: jax.Array) -> jax.Array:
    """The key for the token at absolute `position` of batch `row` (scalars)."""
    base = jax.random.key(seed)
    return jax.random.fold_in(jax.random.fold_in(base, row), position)


def choose_tokens(logits: jax.Array, positions: jax.Array, sp: SamplingParams | None,
                  greedy: bool) -> jax.Array:
    """Target's next token at every node: logits [B,T,V], positions int[B,T] (the position
    the chosen token will occupy) -> int32[B,T]. Greedy: argmax; else a draw from the
    processed distribution with the (row, position) key."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    B, T = positions.shape
    logp = process_logits(logits, sp)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    keys = jax.vmap(jax.vmap(lambda r, p: token_key(sp.seed, r, p)))(rows, positions)
    draw = jax.vmap(jax.vmap(lambda k, lp: jax.random.categorical(k, lp)))
    return draw(keys, logp).astype(jnp.int32)


def token_probability(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits [B,Q,V], tokens int32[B,Q] -> f32[B,Q]: the plain softmax probability of each
    token (a greedy draft's confidence in its own choice, for adaptive drafting)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.exp(jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0])
