"""A fixed-size, padded KV cache with per-row lengths.

Letters (package glossary): L layers, B batch rows, S cache slots, T new tokens of one forward,
A tokens committed by one `commit`, K kv heads, D head dim.

Slot `s` of row `b` holds the token at absolute position `s`; slots `>= lengths[b]` are garbage and
invisible to attention. Rolling back is therefore just lowering a length, and a forward never
writes the cache: it returns the new tokens' K/V (`NewKV`), and `commit` decides which of them
become part of the prefix (all of them in vanilla decoding, only the accepted tree path in
speculative verification).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """A model's committed keys and values.

    Attributes:
        k: [L, B, S, K, D] keys, slot s = position s; garbage at s >= lengths.
        v: [L, B, S, K, D] values, likewise.
        lengths: int32[B], committed tokens per row.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]


@struct.dataclass
class NewKV:
    """K/V of the T tokens of one forward, not yet part of any cache.

    Attributes:
        k: [L, B, T, K, D] keys of the new tokens, in input order.
        v: [L, B, T, K, D] values, likewise.
    """

    k: jax.Array
    v: jax.Array


def init_cache(config, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
    """An empty cache: k, v zeros [L, B, S, K, D], lengths zeros [B]."""
    shape = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


def commit(cache: KVCache, new: NewKV, indices: jax.Array, counts: jax.Array) -> KVCache:
    """Appends a chosen subset of the new tokens to each row.

    indices: int32[B, A], which of the T new tokens to append, in order; counts: int32[B], how
    many of the A to keep (the rest are ignored). Row b receives new[indices[b, a]] at slot
    lengths[b] + a for a < counts[b]; lengths grow by counts. Writes that would fall past the
    last slot are dropped rather than clamped, so an overflow can never overwrite the prefix.
    """
    S = cache.num_slots
    if indices.shape[1] > S:  # more offered than the cache can ever hold
        indices, counts = indices[:, :S], jnp.minimum(counts, S)
    B, A = indices.shape
    # Every row writes a window of A in-range slots, [start, start + A), holding its new tokens
    # from slot lengths[b] on and its old contents elsewhere. In-range, distinct indices let
    # XLA update the cache in place; a bounds-checked ("drop") scatter becomes a
    # select over the whole cache, i.e. a copy of all S slots per commit.
    start = jnp.clip(cache.lengths, 0, S - A)
    slot = start[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]  # [B, A]
    a = slot - cache.lengths[:, None]  # which appended token lands in this slot
    valid = ((a >= 0) & (a < counts[:, None]))[None, :, :, None, None]
    src = jnp.take_along_axis(indices, jnp.clip(a, 0, A - 1), axis=1)  # [B, A]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))

    def write(c, x):  # c [L, B, S, K, D], x [L, B, T, K, D]
        sel = jnp.take_along_axis(x, src[None, :, :, None, None], axis=2).astype(c.dtype)
        return c.at[:, rows, slot].set(jnp.where(valid, sel, c[:, rows, slot]),
                                       mode="promise_in_bounds")

    return KVCache(k=write(cache.k, new.k), v=write(cache.v, new.v),
                   lengths=cache.lengths + counts.astype(jnp.int32))


def commit_prefix(cache: KVCache, new: NewKV, counts: jax.Array) -> KVCache:
    """Appends the first counts[b] new tokens of each row (vanilla decoding, prefill)."""
    B, T = new.k.shape[1], new.k.shape[2]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return commit(cache, new, idx, counts)


def rollback(cache: KVCache, lengths: jax.Array) -> KVCache:
    """Forgets everything at and past `lengths` (int32[B]); no data moves."""
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths.astype(jnp.int32)))
