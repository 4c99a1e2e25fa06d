"""Tests for ouroboros_jax.decoding.verify: the accept walk against a plain-Python walk on random
small trees, and the commit of the accepted path.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ouroboros_jax.decoding.verify import Accepted, accept_walk, commit_path
from ouroboros_jax.tree import np_depths
from ouroboros_jax.models.kv_cache import KVCache, NewKV

SETTINGS = settings(max_examples=40, deadline=None)
ALPHABET = 3  # few distinct tokens, so children often match the target's choice
B = 3

# Static parents as a tuple -> one compiled walk per distinct tree, reused when drawn again.
_walk = jax.jit(lambda parents, *a: accept_walk(np.array(parents), *a), static_argnums=0)
_commit = jax.jit(commit_path)


def ref_walk(parents, tokens, valid, choices):
    """One row: from the root, take the target's choice; descend into the first valid child
    carrying it, else stop. Returns (path, emitted tokens)."""
    cur, path = 0, [0]
    while True:
        y = choices[cur]
        kids = [j for j in range(len(parents))
                if parents[j] == cur and valid[j] and tokens[j] == y]
        if not kids:
            return path, [choices[i] for i in path]
        cur = min(kids)
        path.append(cur)


@st.composite
def trees(draw, sizes=(1, 2, 3, 4, 5, 6, 7)):
    """parents (node 0 the root; other -1 nodes are unreachable from it), B rows of node
    tokens, validity and choices."""
    t = draw(st.sampled_from(sizes))
    parents = np.array([-1] + [draw(st.integers(-1, i - 1)) for i in range(1, t)], np.int32)
    grid = lambda elems: np.array(draw(st.lists(st.lists(elems, min_size=t, max_size=t),
                                                min_size=B, max_size=B)))
    tokens = grid(st.integers(0, ALPHABET - 1)).astype(np.int32)
    valid = grid(st.booleans()).astype(bool)
    choices = grid(st.integers(0, ALPHABET - 1)).astype(np.int32)
    return parents, tokens, valid, choices


@SETTINGS
@given(trees())
def test_accept_walk_matches_reference(tree):
    parents, tokens, valid, choices = tree
    acc = _walk(tuple(parents.tolist()), jnp.asarray(tokens), jnp.asarray(valid),
                jnp.asarray(choices))
    Q = int(np_depths(parents).max()) + 1
    chex.assert_shape([acc.path, acc.tokens], (B, Q))
    chex.assert_shape(acc.count, (B,))
    chex.assert_type([acc.path, acc.tokens, acc.count], jnp.int32)
    path, toks, count = (np.asarray(x) for x in (acc.path, acc.tokens, acc.count))
    for b in range(B):
        ref_path, ref_tokens = ref_walk(parents.tolist(), tokens[b], valid[b], choices[b])
        assert count[b] == len(ref_path)
        assert path[b, :count[b]].tolist() == ref_path
        assert toks[b, :count[b]].tolist() == ref_tokens


class AcceptWalkChain(chex.TestCase):
    """The walk inside a jitted decode loop and called eagerly gives the same result."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_chain_is_longest_agreeing_prefix(self):
        # chain [x, d1..d4]; the target agrees with d1, d2 then disagrees.
        walk = self.variant(lambda *a: accept_walk(np.arange(5) - 1, *a))
        tokens = jnp.array([[9, 5, 6, 7, 8], [9, 5, 6, 7, 8], [9, 5, 6, 7, 8]], jnp.int32)
        choices = jnp.array([[5, 6, 1, 0, 0], [5, 6, 7, 8, 4], [1, 0, 0, 0, 0]], jnp.int32)
        acc = walk(tokens, jnp.ones((3, 5), bool), choices)
        chex.assert_trees_all_equal(acc.count, jnp.array([3, 5, 1], jnp.int32))
        assert np.asarray(acc.tokens)[0, :3].tolist() == [5, 6, 1]
        assert np.asarray(acc.tokens)[1].tolist() == [5, 6, 7, 8, 4]  # all accepted + bonus
        assert np.asarray(acc.tokens)[2, :1].tolist() == [1]
        chex.assert_trees_all_equal(acc.path[1], jnp.arange(5, dtype=jnp.int32))
        # an invalid node is never entered even when it carries the target's choice
        valid = jnp.ones((3, 5), bool).at[1, 3].set(False)
        acc = walk(tokens, valid, choices)
        chex.assert_trees_all_equal(acc.count, jnp.array([3, 3, 1], jnp.int32))


@SETTINGS
@given(trees(sizes=(6,)), st.lists(st.integers(0, 4), min_size=B, max_size=B), st.data())
def test_commit_path_writes_path_nodes_in_order(tree, start, data):
    parents, tokens, valid, choices = tree
    T, S = len(parents), 12
    # the accepted path from the reference walk, padded to T (one compiled commit for all)
    walks = [ref_walk(parents.tolist(), tokens[b], valid[b], choices[b])[0] for b in range(B)]
    path = np.array([w + [0] * (T - len(w)) for w in walks], np.int32)
    count = np.array([len(w) for w in walks], np.int32)
    kept = np.array([data.draw(st.integers(0, int(c))) for c in count], np.int32)
    acc = Accepted(path=jnp.asarray(path), tokens=jnp.zeros((B, T), jnp.int32),
                   count=jnp.asarray(count))
    # new K/V of node i of row b hold the value 100 * b + i (+0.5 for v)
    val = (100 * np.arange(B)[:, None] + np.arange(T)[None]).astype(np.float32)
    new_k = jnp.asarray(np.broadcast_to(val[None, :, :, None, None], (1, B, T, 1, 1)))
    cache = KVCache(k=-jnp.ones((1, B, S, 1, 1)), v=-jnp.ones((1, B, S, 1, 1)),
                    lengths=jnp.asarray(start, jnp.int32))
    out = _commit(cache, NewKV(k=new_k, v=new_k + 0.5), acc, jnp.asarray(kept))
    chex.assert_trees_all_equal_shapes_and_dtypes(out, cache)  # a commit never reshapes
    k, v = np.asarray(out.k)[0, :, :, 0, 0], np.asarray(out.v)[0, :, :, 0, 0]
    for b in range(B):
        want = -np.ones(S, np.float32)
        want[start[b]:start[b] + kept[b]] = 100 * b + path[b, :kept[b]]
        np.testing.assert_array_equal(k[b], want)
        np.testing.assert_array_equal(v[b], np.where(want >= 0, want + 0.5, -1))
    chex.assert_trees_all_equal(out.lengths, jnp.asarray(start, jnp.int32) + kept)
