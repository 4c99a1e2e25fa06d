"""A fixed-size, padded KV cache with per-row lengths.

Letters (package glossary): L layers, B batch rows, S cache slots, T new tokens of one forward,
A tokens committed by one `commit`, K kv heads, D head dim.

Slot `s` of row `b` holds the token at absolute position `s`; slots `>= lengths[b]` are garbage and
invisible to attention. Rolling back is therefore just lowering a length, and a forward never
writes the cache: it returns the new tokens' K/V (`NewKV`), and `commit` decides which of them
become part of the prefix (all of them in vanilla decoding, only the accepted tree path in
speculative verification).

A cache may defer its writes (`pending_slots` > 0, what decoding's target caches do): `commit`
then keeps the appended tokens' K/V in a small `Pending` buffer and `settle` writes them into
the cache, so a decoding loop's round writes the cache first and reads it afterwards. Why:
XLA:CPU copies a buffer that a while loop (attention's loop over cache blocks) reads and a
scatter then updates in place; with the round's reads first and its commit last, every round
copied the whole cache twice, K and V each (measured: SmolLM2 at 8 slots x 2048 slots, 216 ms
a token; with the write first, no copies, 75 ms). `lengths` count the
pending tokens too, so positions, rollback and visibility read as before; a forward refuses a
cache with writes pending (the kernels would read stale slots), so every reader settles first.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

# slots a deferring cache keeps pending (decoding's target caches): covers every default
# method's commit (vanilla 1, speculative gamma + 1, a tree's accepted path); a wider commit
# is written at once, which is only slower
PENDING_SLOTS = 16


@struct.dataclass
class Pending:
    """Appends `commit` has not yet written into the cache (`settle` writes them).

    Attributes:
        k: [L, B, A, K, D] the appended keys, in order; v likewise.
        at: int32[B], the slot the first of them goes to (the row's length before them).
        count: int32[B], how many of the A are real.
    """

    k: jax.Array
    v: jax.Array
    at: jax.Array
    count: jax.Array


@struct.dataclass
class KVCache:
    """A model's committed keys and values.

    k / v may hold more rows than `lengths` (a `head_rows` view, what the engine's step runs
    on while only its first slots are busy): rows [0, B) of them are this cache's, B =
    lengths.shape[0], and the rest pass through untouched.

    Attributes:
        k: [L, B, S, K, D] keys, slot s = position s; garbage at s >= lengths (B or more rows).
        v: [L, B, S, K, D] values, likewise.
        lengths: int32[B], committed tokens per row (pending ones included).
        pending: None (settled) or the `Pending` appends not yet written into k / v.
        pending_slots: static; 0: commits write at once, else they wait in a `Pending` of
            that many slots until `settle`.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    pending: Optional[Pending] = None
    pending_slots: int = struct.field(pytree_node=False, default=0)

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


def init_cache(config, batch: int, slots: int, dtype=jnp.float32,
               pending_slots: int = 0) -> KVCache:
    """An empty cache: k, v zeros [L, B, S, K, D], lengths zeros [B]; with pending_slots > 0
    (capped at S) one that defers its writes, holding an empty `Pending`."""
    shape = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)
    cache = KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                    lengths=jnp.zeros((batch,), jnp.int32),
                    pending_slots=min(pending_slots, slots))
    return with_empty_pending(cache)


def with_empty_pending(cache: KVCache) -> KVCache:
    """A settled cache as a decoding loop carries it: with an empty `Pending` when it defers
    its writes (so its pytree is the same before and after a round's commit)."""
    if cache.pending_slots == 0 or cache.pending is not None:
        return cache
    L, _, _, K, D = cache.k.shape
    B = cache.lengths.shape[0]
    z = jnp.zeros((L, B, cache.pending_slots, K, D), cache.k.dtype)
    zi = jnp.zeros((B,), jnp.int32)
    return cache.replace(pending=Pending(k=z, v=z, at=zi, count=zi))


def settle(cache: KVCache) -> KVCache:
    """The cache with its pending appends written into k / v (pending None): what a forward
    reads. A no-op for a settled cache."""
    if cache.pending is None:
        return cache
    p = cache.pending
    return cache.replace(k=_write_window(cache.k, p.k, p.at, p.count),
                         v=_write_window(cache.v, p.v, p.at, p.count), pending=None)


def _write_window(c: jax.Array, x: jax.Array, at: jax.Array, counts: jax.Array) -> jax.Array:
    """c [L, B, S, K, D] with x[:, b, a] at slot at[b] + a for a < counts[b] (x [L, B, A, K,
    D], A <= S); writes past the last slot are dropped rather than clamped, so an overflow
    can never overwrite the prefix."""
    B, A, S = x.shape[1], x.shape[2], c.shape[2]
    # Every row writes a window of A in-range slots, [start, start + A), holding its new tokens
    # from slot at[b] on and its old contents elsewhere. In-range, distinct indices let XLA
    # update the cache in place; a bounds-checked ("drop") scatter becomes a select over the
    # whole cache, i.e. a copy of all S slots per commit.
    start = jnp.clip(at, 0, S - A)
    slot = start[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]  # [B, A]
    a = slot - at[:, None]  # which appended token lands in this slot
    valid = ((a >= 0) & (a < counts[:, None]))[None, :, :, None, None]
    sel = jnp.take_along_axis(x, jnp.clip(a, 0, A - 1)[None, :, :, None, None], axis=2)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
    return c.at[:, rows, slot].set(jnp.where(valid, sel.astype(c.dtype), c[:, rows, slot]),
                                   mode="promise_in_bounds")


def commit(cache: KVCache, new: NewKV, indices: jax.Array, counts: jax.Array) -> KVCache:
    """Appends a chosen subset of the new tokens to each row.

    indices: int32[B, A], which of the T new tokens to append, in order; counts: int32[B], how
    many of the A to keep (the rest are ignored). Row b receives new[indices[b, a]] at slot
    lengths[b] + a for a < counts[b]; lengths grow by counts. Writes that would fall past the
    last slot are dropped rather than clamped, so an overflow can never overwrite the prefix.
    A deferring cache (`pending_slots`) settles what was pending and keeps these appends
    pending instead (written at once when A exceeds its pending slots).
    """
    S = cache.num_slots
    if indices.shape[1] > S:  # more offered than the cache can ever hold
        indices, counts = indices[:, :S], jnp.minimum(counts, S)
    cache = settle(cache)
    A, P = indices.shape[1], cache.pending_slots
    defer = 0 < A <= P
    if defer:  # pad to the pending buffer's width; counts keep the padding out
        indices = jnp.pad(indices, ((0, 0), (0, P - A)))
    pick = lambda x: jnp.take_along_axis(x, indices[None, :, :, None, None], axis=2)
    k, v = pick(new.k).astype(cache.k.dtype), pick(new.v).astype(cache.v.dtype)
    counts = counts.astype(jnp.int32)
    lengths = cache.lengths + counts
    if defer:
        return cache.replace(lengths=lengths,
                             pending=Pending(k=k, v=v, at=cache.lengths, count=counts))
    return with_empty_pending(cache.replace(
        k=_write_window(cache.k, k, cache.lengths, counts),
        v=_write_window(cache.v, v, cache.lengths, counts), lengths=lengths))


def commit_prefix(cache: KVCache, new: NewKV, counts: jax.Array) -> KVCache:
    """Appends the first counts[b] new tokens of each row (vanilla decoding, prefill)."""
    B, T = new.k.shape[1], new.k.shape[2]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return commit(cache, new, idx, counts)


def head_rows(cache: KVCache, b: int) -> KVCache:
    """The cache of rows [0, b) (static b): lengths and pending writes sliced, k / v kept
    whole, so a forward reads and a commit writes those rows where they lie (no copy of the
    cache). `put_head_rows` merges it back."""
    p = cache.pending
    pending = None if p is None else p.replace(k=p.k[:, :b], v=p.v[:, :b], at=p.at[:b],
                                               count=p.count[:b])
    return cache.replace(lengths=cache.lengths[:b], pending=pending)


def put_head_rows(cache: KVCache, head: KVCache) -> KVCache:
    """cache with rows [0, b) as head (`head_rows`' view after its rounds) has them: head's
    k / v (every row, the others untouched), its lengths and pending writes over the first b."""
    put = lambda full, part, axis: jax.lax.dynamic_update_slice_in_dim(full, part, 0, axis)
    pending = None
    if cache.pending is not None:
        p, q = cache.pending, head.pending
        pending = p.replace(k=put(p.k, q.k, 1), v=put(p.v, q.v, 1), at=put(p.at, q.at, 0),
                            count=put(p.count, q.count, 0))
    return cache.replace(k=head.k, v=head.v, lengths=put(cache.lengths, head.lengths, 0),
                         pending=pending)


def rollback(cache: KVCache, lengths: jax.Array) -> KVCache:
    """Forgets everything at and past `lengths` (int32[B]); no data moves."""
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths.astype(jnp.int32)))
