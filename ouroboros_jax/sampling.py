"""Turning logits into tokens: the processed distribution (temperature, top-k, top-p) and
reproducible random keys.

Keys are folded from (seed, stream, position): the token that lands at absolute position `p` of
a row is always drawn with the same key, however many tokens a step accepts and whichever
decoding method runs. A row's stream is its row number in `generate` (so row b of a call with
`seed` draws from fold_in(key(seed), b)); the serving engine gives every request stream 0 and its
own seed, so a request's draws depend on neither its slot nor its neighbours. With deterministic draft candidates this makes a speculative method's
sampled output identical to vanilla sampling's for the same seed, not only equal in law
(docs/algorithm.md section 6).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    """Dynamic sampling knobs (arrays, so changing them never recompiles).

    Greedy decoding is a static choice made by the caller (`greedy=True`), not temperature 0
    at run time, so the greedy path carries no sort over the vocabulary. A sampling loop
    (`greedy=False`) can still hold greedy rows (`greedy_rows`): the serving engine mixes
    greedy and sampled requests in one batch.

    Every knob is either one scalar for the batch or one value per row ([B]).

    Attributes:
        temperature: f32[] or f32[B].
        top_k: int32[] or int32[B] (0 = off).
        top_p: f32[] or f32[B] (1 = off).
        seed: uint32[] or uint32[B]: the root of every token key (`token_key`).
        stream: int32[B] or None (the batch row): the number folded into a row's seed.
        greedy_rows: bool[B] or None (none): rows that take the argmax in a sampling loop.
        logprobs: static; -1: emitted tokens get no log-probabilities (the loop is as
            without them); k >= 0: every emitted token's log-probability is computed from the
            forward that chose it and written beside it, with the k most likely tokens'
            (`decoding/logprobs.py`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    stream: Optional[jax.Array] = None
    greedy_rows: Optional[jax.Array] = None
    logprobs: int = struct.field(pytree_node=False, default=-1)

    @staticmethod
    def make(temperature=1.0, top_k=0, top_p=1.0, seed=0) -> "SamplingParams":
        return SamplingParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                              jnp.asarray(top_p, jnp.float32), jnp.asarray(seed, jnp.uint32))


def _per_row(v: jax.Array, ndim: int) -> jax.Array:
    """A knob (scalar or [B]) shaped to broadcast against an array of `ndim` dims led by B."""
    v = jnp.asarray(v)
    return v if v.ndim == 0 else v.reshape(v.shape + (1,) * (ndim - v.ndim))


def process_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """[B, ..., V] logits -> [B, ..., V] log-probabilities of the processed distribution.

    Order as in transformers: temperature, then top-k, then top-p (keep the smallest set of
    most likely tokens whose probability reaches top_p; always at least one token). Knobs
    given per row apply to their row.
    """
    nd = logits.ndim
    x = logits.astype(jnp.float32) / jnp.maximum(_per_row(sp.temperature, nd), 1e-6)
    V = x.shape[-1]
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]  # descending
    top_k = _per_row(sp.top_k, nd - 1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)  # [] or [B, 1..]
    kth = jnp.take_along_axis(sorted_x, jnp.broadcast_to(k - 1, x.shape[:-1])[..., None], -1)
    x = jnp.where(x < kth, -jnp.inf, x)
    sorted_x = jnp.where(jnp.arange(V) < k[..., None], sorted_x, -jnp.inf)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep_sorted = before < _per_row(sp.top_p, nd)
    keep_sorted = keep_sorted.at[..., 0].set(True)
    # threshold = smallest kept logit; ties at the threshold are kept (as transformers does)
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    thresh = jnp.take_along_axis(sorted_x, n_keep - 1, -1)
    x = jnp.where(x < thresh, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


def token_key(seed: jax.Array, row: jax.Array, position: jax.Array) -> jax.Array:
    """The key for the token at absolute `position` of stream `row` (scalars)."""
    base = jax.random.key(seed)
    return jax.random.fold_in(jax.random.fold_in(base, row), position)


def token_keys(sp: SamplingParams, positions: jax.Array) -> jax.Array:
    """positions int[B,T] -> token_key(seed, stream, position) [B,T], each row with its own
    seed and stream (the batch row when `sp.stream` is None)."""
    B, T = positions.shape
    stream = jnp.arange(B) if sp.stream is None else sp.stream
    rows = jnp.broadcast_to(stream[:, None], (B, T))
    seeds = jnp.broadcast_to(_per_row(sp.seed, 2), (B, T))
    return jax.vmap(jax.vmap(token_key))(seeds, rows, positions)


def greedy_where(sp: Optional[SamplingParams], greedy_choice: jax.Array, sampled: jax.Array
                 ) -> jax.Array:
    """Per row [B, ...]: greedy_choice where the row is greedy (`sp.greedy_rows`), else
    sampled; sampled as is when no row is greedy."""
    if sp is None or sp.greedy_rows is None:
        return sampled
    return jnp.where(_per_row(sp.greedy_rows, sampled.ndim), greedy_choice, sampled)


def choose_tokens(logits: jax.Array, positions: jax.Array, sp: SamplingParams | None,
                  greedy: bool) -> jax.Array:
    """Target's next token at every node: logits [B,T,V], positions int[B,T] (the position
    the chosen token will occupy) -> int32[B,T]. Greedy: argmax; else a draw from the
    processed distribution with the (stream, position) key (argmax for `sp.greedy_rows`)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = process_logits(logits, sp)
    keys = token_keys(sp, positions)
    draw = jax.vmap(jax.vmap(lambda k, lp: jax.random.categorical(k, lp)))
    sampled = draw(keys, logp).astype(jnp.int32)
    if sp.greedy_rows is None:
        return sampled
    return greedy_where(sp, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)


def token_probability(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits [B,Q,V], tokens int32[B,Q] -> f32[B,Q]: the plain softmax probability of each
    token (a greedy draft's confidence in its own choice, for adaptive drafting)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.exp(jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0])
