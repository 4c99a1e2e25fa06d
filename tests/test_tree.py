"""Tests for ouroboros_jax.tree: the parents -> mask/depth primitive and the static layouts.

Properties are checked against a plain-Python recursive ancestor walk; the layouts against
parents written out by hand from docs/algorithm.md section 1.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ouroboros_jax.tree import (
    chain_parents,
    chain_with_branches,
    jacobi_tree,
    tree_depths,
    tree_mask,
)

SETTINGS = settings(max_examples=50, deadline=None)

# One jitted function each; jax caches one executable per shape, shapes are kept few.
_jit_mask = jax.jit(tree_mask)
_jit_depths = jax.jit(tree_depths)


# ----------------------------------------------------------------------------- reference


def ref_ancestors(parents, i):
    """Strict ancestors of node i, by walking up recursively."""
    p = parents[i]
    return set() if p < 0 else {p} | ref_ancestors(parents, p)


def ref_mask(parents, valid=None):
    t = len(parents)
    valid = [True] * t if valid is None else list(valid)
    out = np.zeros((t, t), dtype=bool)
    for i in range(t):
        for j in ref_ancestors(parents, i) | {i}:
            out[i, j] = valid[j] or i == j
    return out


def ref_depths(parents):
    return np.array([len(ref_ancestors(parents, i)) for i in range(len(parents))])


@st.composite
def forests(draw, sizes=(1, 2, 3, 5, 8, 13)):
    """Random topological parents arrays of a few fixed sizes (few shapes -> few compiles)."""
    t = draw(st.sampled_from(sizes))
    return np.array([draw(st.integers(-1, i - 1)) for i in range(t)], dtype=np.int32)


# ----------------------------------------------------------------------------- primitive


@SETTINGS
@given(forests())
def test_mask_and_depths_match_reference(parents):
    np.testing.assert_array_equal(np.asarray(tree_mask(parents)), ref_mask(parents.tolist()))
    np.testing.assert_array_equal(np.asarray(tree_depths(parents)), ref_depths(parents.tolist()))


@SETTINGS
@given(forests(), st.data())
def test_valid_masks_columns_but_keeps_self(parents, data):
    t = len(parents)
    valid = np.array(data.draw(st.lists(st.booleans(), min_size=t, max_size=t)))
    got = np.asarray(tree_mask(parents, valid))
    np.testing.assert_array_equal(got, ref_mask(parents.tolist(), valid.tolist()))
    assert got.diagonal().all()  # every softmax row has at least itself


@SETTINGS
@given(forests(sizes=(8,)), forests(sizes=(8,)), forests(sizes=(8,)))
def test_jit_traced_batched_equals_numpy(p0, p1, p2):
    batch = np.stack([p0, p1, p2])  # [B=3, T=8]
    valid = np.stack([np.ones(8, bool), p0 >= 0, np.zeros(8, bool)])
    got = _jit_mask(jnp.asarray(batch), jnp.asarray(valid))
    depths = _jit_depths(jnp.asarray(batch))
    chex.assert_shape(got, (3, 8, 8))
    chex.assert_shape(depths, (3, 8))
    chex.assert_type([got, depths], [jnp.bool_, jnp.int32])
    got, depths = np.asarray(got), np.asarray(depths)
    for b in range(3):
        np.testing.assert_array_equal(got[b], np.asarray(tree_mask(batch[b], valid[b])))
        np.testing.assert_array_equal(depths[b], ref_depths(batch[b].tolist()))


def test_chain_is_causal():
    for n in (1, 2, 7):
        mask = np.asarray(tree_mask(chain_parents(n)))
        np.testing.assert_array_equal(mask, np.tri(n, dtype=bool))
        np.testing.assert_array_equal(np.asarray(tree_depths(chain_parents(n))), np.arange(n))
    assert chain_parents(0).shape == (0,)


def test_fully_invalid_rows_have_self_and_softmax_is_finite():
    parents = jacobi_tree(4, 3, 2).parents
    mask = np.asarray(tree_mask(parents, np.zeros(len(parents), bool)))
    np.testing.assert_array_equal(mask, np.eye(len(parents), dtype=bool))
    scores = jnp.where(mask, 0.0, -jnp.inf)
    assert np.isfinite(np.asarray(jax.nn.softmax(scores, axis=-1))).all()


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 0, 3], [-2, 0]])
def test_non_topological_parents_rejected(bad):
    with pytest.raises(ValueError, match="parents"):
        tree_mask(np.array(bad))


# ----------------------------------------------------------------------------- jacobi layout


def test_jacobi_worked_size_w5_n4():
    for g in (0, 1, 5):
        lay = jacobi_tree(5, 4, g)
        assert lay.window_size == 1 + 4 + 2 * 5 == 15
        assert lay.size == 15 + g * 3 == len(lay.parents)


def test_jacobi_hand_written_w3_n4_g2():
    # [ last | level0: 2 | level1: 3 | level2: 3 | guess0: 3 | guess1: 3 ], from the spec text:
    #  level0[0] off last, level0[1] off level0[0]; level1[0] off last, level1[i] off
    #  level0[i-1]; level2[i] off level1[i]; each guess a chain off last.
    lay = jacobi_tree(3, 4, 2)
    expected = [-1,  0, 1,  0, 1, 2,  3, 4, 5,  0, 9, 10,  0, 12, 13]  # fmt: skip
    np.testing.assert_array_equal(lay.parents, expected)
    np.testing.assert_array_equal(lay.level_index, [[-1, 1, 2], [3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(lay.key_index, [0, 1, 2])
    np.testing.assert_array_equal(lay.guess_index, [[9, 10, 11], [12, 13, 14]])
    np.testing.assert_array_equal(lay.depths, [0, 1, 2, 1, 2, 3, 2, 3, 4, 1, 2, 3, 1, 2, 3])
    np.testing.assert_array_equal(lay.depths, np.asarray(tree_depths(lay.parents)))
    # level2[2] sees last, level0[0..1], level1[2] and itself
    assert set(np.flatnonzero(np.asarray(tree_mask(lay.parents))[8])) == {0, 1, 2, 5, 8}


@SETTINGS
@given(st.integers(1, 6), st.integers(3, 6), st.integers(0, 4))
def test_jacobi_layout_follows_spec_rules(w, n, g):
    lay = jacobi_tree(w, n, g)
    m = n - 1
    chex.assert_shape(lay.level_index, (m, w))
    chex.assert_shape(lay.guess_index, (g, m))
    chex.assert_shape([lay.parents, lay.depths], (lay.size,))
    assert lay.size == 1 + (w - 1) + (n - 2) * w + g * m
    # every node appears exactly once across last / levels / guesses
    used = [0] + [i for i in lay.level_index.ravel() if i >= 0] + list(lay.guess_index.ravel())
    assert sorted(used) == list(range(lay.size))
    par, lvl = lay.parents, lay.level_index
    assert par[0] == -1
    for j in range(w - 1):  # level0[j] is at column j + 1
        assert par[lvl[0, j + 1]] == (0 if j == 0 else lvl[0, j])
    for i in range(w):
        assert par[lvl[1, i]] == (0 if i == 0 else lvl[0, i])  # off level0[i-1]
        for level in range(2, m):
            assert par[lvl[level, i]] == lvl[level - 1, i]
        for level in range(m):  # position offsets: column + level
            if lvl[level, i] >= 0:
                assert lay.depths[lvl[level, i]] == i + level
    for q in range(g):
        assert par[lay.guess_index[q, 0]] == 0
        assert list(par[lay.guess_index[q, 1:]]) == list(lay.guess_index[q, :-1])
    np.testing.assert_array_equal(lay.key_index, np.where(lvl[0] < 0, 0, lvl[0]))
    np.testing.assert_array_equal(lay.depths, ref_depths(par.tolist()))


def test_jacobi_rejects_bad_sizes():
    with pytest.raises(ValueError, match="ngram"):
        jacobi_tree(5, 2, 3)
    with pytest.raises(ValueError, match="window"):
        jacobi_tree(0, 4, 3)
    with pytest.raises(ValueError, match="guesses"):
        jacobi_tree(5, 4, -1)


def test_layouts_are_cached_and_read_only():
    assert jacobi_tree(5, 4, 3) is jacobi_tree(5, 4, 3)
    assert chain_with_branches(4, 3, 2) is chain_with_branches(4, 3, 2)
    with pytest.raises(ValueError):
        jacobi_tree(5, 4, 3).parents[0] = 7


# ----------------------------------------------------------------------------- chain + branches


def test_chain_with_branches_hand_written():
    lay = chain_with_branches(3, 2, 2)  # chain 0-1-2, branches (3, 4) and (5, 6) off node 2
    np.testing.assert_array_equal(lay.parents, [-1, 0, 1, 2, 3, 2, 5])
    np.testing.assert_array_equal(lay.chain_index, [0, 1, 2])
    np.testing.assert_array_equal(lay.branch_index, [[3, 4], [5, 6]])
    np.testing.assert_array_equal(lay.depths, [0, 1, 2, 3, 4, 3, 4])
    mask = np.asarray(tree_mask(lay.parents))
    assert not mask[5, 3] and not mask[6, 4]  # branches never see each other


@SETTINGS
@given(st.integers(1, 6), st.integers(0, 4), st.integers(0, 4))
def test_chain_with_branches_properties(c, k, m):
    lay = chain_with_branches(c, k, m)
    assert lay.size == c + k * m
    chex.assert_shape([lay.parents, lay.depths], (lay.size,))
    np.testing.assert_array_equal(lay.parents[:c], chain_parents(c))
    chex.assert_shape(lay.branch_index, (k, m))
    for b in range(k):
        for t in range(m):
            node = lay.branch_index[b, t]
            assert lay.parents[node] == (c - 1 if t == 0 else lay.branch_index[b, t - 1])
            assert lay.depths[node] == c + t
    np.testing.assert_array_equal(lay.depths, ref_depths(lay.parents.tolist()))


def test_plain_speculative_and_guess_verification_shapes():
    spec = chain_with_branches(5, 0, 3)
    np.testing.assert_array_equal(spec.parents, chain_parents(5))
    guesses = chain_with_branches(1, 4, 3)  # `last` then G = 4 guess chains off it
    assert guesses.size == 13 and (guesses.parents[guesses.branch_index[:, 0]] == 0).all()
    with pytest.raises(ValueError, match="chain_len"):
        chain_with_branches(0, 2, 2)


# ----------------------------------------------------------------------------- under jit


class LayoutMasksUnderJit(chex.TestCase):
    """The masks a decode loop builds inside jit (parents traced) equal the eager ones and the
    reference walk, for the layouts the methods use, missing branches included."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_layout_masks_and_depths(self):
        mask_fn, depth_fn = self.variant(tree_mask), self.variant(tree_depths)
        for lay in (chain_with_branches(4, 3, 2), jacobi_tree(3, 4, 2)):
            valid = np.arange(lay.size) % 3 != 2
            mask = mask_fn(jnp.asarray(lay.parents), jnp.asarray(valid))
            depths = depth_fn(jnp.asarray(lay.parents))
            chex.assert_shape(mask, (lay.size, lay.size))
            chex.assert_trees_all_equal(
                (mask, depths),
                (ref_mask(lay.parents.tolist(), valid.tolist()), ref_depths(lay.parents.tolist())))
            chex.assert_trees_all_equal(depths, lay.depths)
