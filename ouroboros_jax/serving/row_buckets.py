"""Steps over the busy head of the slots: a step computes rows [0, b) of its B slots, b the
smallest bucket holding every busy slot, so one request costs a one-row step, not a B-row one.

Why: on a CPU a forward's cost grows with its rows, even at one token each (its matmuls are
not bound by reading the weights alone: SmolLM2-135M f32, vanilla, 1 / 2 / 4 / 8 rows: 29 /
40 / 48 / 75 ms a round), and the engine's step ran every slot whether busy or not.
Admission takes the lowest free slot (`scheduler`), so the busy slots gather at the head:
concurrency 1 always runs in slot 0.

Each bucket is a compiled step of its own (b static); the rows past b pass through the step
untouched, which is what a full step does to them too (free slots are done rows: no round
changes them). The KV caches are not sliced: `kv_cache.head_rows` keeps k / v whole and the
forward reads, and the commit writes, rows [0, b) where they lie, so no step copies a cache.
The phrase pool has no slot axis and is shared by the rows; it is carried as it is.

Letters (package glossary): B slots, b rows a step computes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from ..models.kv_cache import KVCache, head_rows, put_head_rows


def buckets(slots: int, sharded: bool = False) -> tuple:
    """The row counts steps compile for: powers of two below slots, then slots ((slots,)
    when sharded: rows split over the mesh's "data" axis are not cut to a head)."""
    if sharded:
        return (slots,)
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return tuple(out) + (slots,)


def rows_for(busy: Sequence[int], sizes: Sequence[int]) -> int:
    """The smallest bucket of sizes holding every busy slot (indices, not empty)."""
    top = max(busy) + 1
    return min(b for b in sizes if b >= top)


def _bare(dev):
    """(dev without its pool, the pool or None): the pool is no slot-indexed leaf."""
    pool = getattr(dev.state, "pool", None)
    if pool is None:
        return dev, None
    return dev.replace(state=dev.state.replace(pool=None)), pool


def _with_pool(dev, pool):
    return dev if pool is None else dev.replace(state=dev.state.replace(pool=pool))


def take_head(dev, B: int, b: int):
    """dev (the engine's `DeviceState`, B slots) -> the same over rows [0, b): every leaf with
    a slot axis [B, ...] sliced, KV caches as `kv_cache.head_rows` views, the rest (the pool,
    the method's scalar counters) as they are."""
    bare, pool = _bare(dev)

    def one(x):
        if isinstance(x, KVCache):
            return head_rows(x, b)
        return x[:b] if x.ndim and x.shape[0] == B else x

    head = jax.tree_util.tree_map(one, bare, is_leaf=lambda x: isinstance(x, KVCache))
    return _with_pool(head, pool)


def put_head(dev, head, B: int):
    """dev with rows [0, b) as head (`take_head`'s result after its rounds) has them; the
    pool and counters as head has them."""
    bare, _ = _bare(dev)
    hbare, pool = _bare(head)

    def one(x, h):
        if isinstance(x, KVCache):
            return put_head_rows(x, h)
        if x.ndim and x.shape[0] == B:
            return jax.lax.dynamic_update_slice_in_dim(x, h.astype(x.dtype), 0, 0)
        return h

    out = jax.tree_util.tree_map(one, bare, hbare, is_leaf=lambda x: isinstance(x, KVCache))
    return _with_pool(out, pool)


def pad_rows(x: jax.Array, B: int, axis: int = 1) -> jax.Array:
    """A per-row output over b rows ([k, b] by default) zero-padded to B rows."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, B - x.shape[axis])
    return jax.numpy.pad(x, pad)


def describe(sizes: Sequence[int], rows: Optional[int]) -> str:
    """How progress names a step's rows."""
    return "" if rows is None or rows == max(sizes) else f", {rows} row{'s' * (rows > 1)}"
