"""Tree verification shared by every speculative method: the accept walk and the commit of
the accepted path.

The walk (docs/algorithm.md section 2.3): start at the root (node 0, the pending token). At each node
take the target's next token y there (`choices`: argmax, or a draw from the processed
distribution with the (row, position) key). If a valid child carries y, move to it; otherwise
stop. Every token emitted is the target's own choice given an accepted prefix, so greedy output
equals vanilla's exactly, and with deterministic candidates sampled output is distributed as
vanilla's (identical for the same seed, since keys depend only on row and position).

Letters (package glossary): B rows, T tree nodes, A = max depth + 1 (most tokens one walk can
emit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..models.kv_cache import KVCache, NewKV, commit
from ..tree import np_depths


@struct.dataclass
class Accepted:
    """The outcome of one accept walk per row.

    Attributes:
        path: int32[B,A], the tree indices of the walked nodes, path[:, 0] = 0 (the root);
            valid up to count (0 after).
        tokens: int32[B,A], the emitted tokens: tokens[:, i] = the model's choice after
            path[:, i] (the matched children's tokens, then the bonus/correction).
        count: int32[B], tokens emitted = matched nodes + 1.
    """

    path: jax.Array
    tokens: jax.Array
    count: jax.Array


def accept_walk(parents: np.ndarray, node_tokens: jax.Array, node_valid: jax.Array,
                choices: jax.Array) -> Accepted:
    """parents int[T] (static numpy, node 0 the root); node_tokens int32[B,T];
    node_valid bool[B,T]; choices int32[B,T] (target's token after each node) -> Accepted.

    Among several valid children carrying y the lowest index wins (duplicates are harmless).
    """
    parents = np.asarray(parents)
    T = len(parents)
    A = int(np_depths(parents).max()) + 1
    child_of = jnp.asarray(parents[None, :] == np.arange(T)[:, None])  # [T(parent), T(child)]
    B = node_tokens.shape[0]

    def descend(i, carry):
        cur, alive, path, count = carry
        y = jnp.take_along_axis(choices, cur[:, None], 1)[:, 0]
        match = child_of[cur] & node_valid & (node_tokens == y[:, None]) & alive[:, None]
        found = jnp.any(match, axis=1)
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)
        cur = jnp.where(found, nxt, cur)
        path = path.at[:, i + 1].set(jnp.where(found, nxt, 0))
        return cur, found, path, count + found.astype(jnp.int32)

    path = jnp.zeros((B, A), jnp.int32)
    init = (jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), path, jnp.ones((B,), jnp.int32))
    _, _, path, count = jax.lax.fori_loop(0, A - 1, descend, init)
    tokens = jnp.take_along_axis(choices, path, 1)
    return Accepted(path=path, tokens=tokens, count=count)


def commit_path(cache: KVCache, new: NewKV, acc: Accepted, kept: jax.Array) -> KVCache:
    """Writes the K/V of the first `kept` path nodes (root first) into the cache.

    Emitting k tokens consumes the pending root and the k-1 matched nodes before the last
    emitted token, so exactly `kept` nodes of the path become committed prefix.
    """
    return commit(cache, new, acc.path, kept)
