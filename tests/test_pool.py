"""Tests for ouroboros_jax.pool: the fixed-shape phrase pool against a Python row-LRU reference.

With R = V the reference is exactly the Ouroboros dict token -> list of <= G phrases; with
R < V it is the same per row k % R, the row's G slots shared by the keys that land there.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ouroboros_jax.pool import (
    clear_pool,
    init_pool,
    insert,
    insert_many,
    lookup,
    pool_bytes,
    pool_occupancy,
)

SETTINGS = settings(max_examples=50, deadline=None)

V, G, M, P = 6, 3, 2, 16  # tiny vocab, slots per row, phrase length, inserts per batch

# Jitted once; jax keeps one executable per (rows, policy) and shape, all kept few.
_insert = jax.jit(insert)
_insert_many = jax.jit(insert_many)
_lookup = jax.jit(lookup, static_argnums=2)


class RefPool:
    """Plain-Python reference: row -> list of (key, phrase) ordered oldest to newest."""

    def __init__(self, rows, guesses, policy="lru"):
        self.rows, self.guesses, self.policy = rows, guesses, policy
        self.table = {}

    def insert(self, key, phrase, valid=True):
        if not valid or key < 0:
            return
        entries = self.table.setdefault(key % self.rows, [])
        item = (key, tuple(phrase))
        if item in entries:
            if self.policy == "lru":
                entries.remove(item)
                entries.append(item)
            return
        if len(entries) == self.guesses:
            entries.pop(0)
        entries.append(item)

    def lookup(self, key, k):
        if key < 0:
            return []
        hits = [p for kk, p in reversed(self.table.get(key % self.rows, [])) if kk == key]
        return hits[:k]

    def occupancy(self):
        return sum(len(v) for v in self.table.values())


def assert_same(pool, ref, keys=range(-1, V + 2)):
    """Every key's lookup (all k = G slots, newest first) and the occupancy agree."""
    keys = np.array(list(keys), dtype=np.int32)
    phrases, found = map(np.asarray, _lookup(pool, jnp.asarray(keys), G))
    for key, ph, fd in zip(keys, phrases, found):
        want = ref.lookup(int(key), G)
        assert fd.tolist() == [True] * len(want) + [False] * (G - len(want)), key
        assert [tuple(p) for p in ph[: len(want)]] == want, key
        assert (ph[len(want):] == 0).all()
    assert int(pool_occupancy(pool)) == ref.occupancy()


ops = st.lists(
    st.tuples(
        st.integers(-1, V + 1),  # keys beyond V exercise the modulo; -1 is padding
        st.lists(st.integers(0, 2), min_size=M, max_size=M),  # 9 phrases: duplicates are common
        st.booleans() | st.just(True),
    ),
    max_size=P,
)


def as_batch(op_list):
    """Pad to P inserts with valid=False so every example reuses one compiled insert_many."""
    pad = [(0, [0] * M, False)] * (P - len(op_list))
    keys, phrases, valid = zip(*(list(op_list) + pad))
    return np.array(keys, np.int32), np.array(phrases, np.int32), np.array(valid, bool)


# ----------------------------------------------------------------------------- properties


@SETTINGS
@given(st.sampled_from([V, 4, 2]), st.sampled_from(["lru", "fifo"]), st.lists(ops, max_size=3))
def test_insert_many_matches_reference(rows, policy, batches):
    pool, ref = init_pool(V, G, M, rows=rows, policy=policy), RefPool(rows, G, policy)
    for op_list in batches:  # several batches: state carries across calls like decode steps
        pool = _insert_many(pool, *as_batch(op_list))
        for key, phrase, valid in op_list:
            ref.insert(key, phrase, valid)
        assert_same(pool, ref)


@SETTINGS
@given(ops)
def test_insert_many_equals_successive_inserts(op_list):
    keys, phrases, valid = as_batch(op_list)
    batched = _insert_many(init_pool(V, G, M, rows=4), keys, phrases, valid)
    one_by_one = init_pool(V, G, M, rows=4)
    for key, phrase, ok in zip(keys, phrases, valid):
        one_by_one = _insert(one_by_one, key, phrase, ok)
    chex.assert_trees_all_equal(batched, one_by_one)  # structure (static fields) and leaves


@SETTINGS
@given(ops, st.integers(1, G))
def test_smaller_k_is_prefix(op_list, k):
    pool = _insert_many(init_pool(V, G, M, rows=4), *as_batch(op_list))
    keys = jnp.arange(V)
    full_p, full_f = _lookup(pool, keys, G)
    part_p, part_f = _lookup(pool, keys, k)
    chex.assert_shape([part_p, full_p[:, :k]], (V, k, M))
    chex.assert_trees_all_equal((part_p, part_f), (full_p[:, :k], full_f[:, :k]))


# ----------------------------------------------------------------------------- concrete


def fill(pool, items):
    for key, phrase in items:
        pool = _insert(pool, key, jnp.array(phrase))
    return pool


def found_phrases(pool, key, k=G):
    phrases, found = _lookup(pool, key, k)
    return [tuple(p) for p, f in zip(np.asarray(phrases).tolist(), np.asarray(found)) if f]


def test_lookup_newest_first():
    pool = fill(init_pool(V, G, M), [(1, [1, 1]), (1, [2, 2]), (2, [9, 9]), (1, [3, 3])])
    assert found_phrases(pool, 1) == [(3, 3), (2, 2), (1, 1)]
    assert found_phrases(pool, 1, k=2) == [(3, 3), (2, 2)]
    phrases, found = _lookup(pool, 5, G)
    assert not np.asarray(found).any() and not np.asarray(phrases).any()


def test_reinsert_refreshes_then_full_key_evicts_oldest():
    pool = fill(init_pool(V, G, M), [(1, [1, 1]), (1, [2, 2]), (1, [3, 3])])
    pool = fill(pool, [(1, [1, 1])])  # refresh: (1, 1) becomes newest, nothing added
    assert found_phrases(pool, 1) == [(1, 1), (3, 3), (2, 2)]
    assert int(pool_occupancy(pool)) == 3
    pool = fill(pool, [(1, [4, 4])])  # key full: the oldest, (2, 2), goes
    assert found_phrases(pool, 1) == [(4, 4), (1, 1), (3, 3)]


def test_fifo_does_not_refresh():
    pool = fill(init_pool(V, G, M, policy="fifo"), [(1, [1, 1]), (1, [2, 2]), (1, [3, 3])])
    clock = int(pool.clock)
    pool = fill(pool, [(1, [1, 1]), (1, [4, 4])])  # re-insert ignored, so (1, 1) is evicted
    assert found_phrases(pool, 1) == [(4, 4), (3, 3), (2, 2)]
    assert int(pool.clock) == clock + 1


def test_collisions_share_a_row_when_rows_below_vocab():
    pool = init_pool(V, G, M, rows=2)  # keys 1, 3, 5 share row 1
    pool = fill(pool, [(1, [1, 1]), (3, [3, 3]), (5, [5, 5])])
    pool = fill(pool, [(1, [1, 1]), (1, [1, 2])])  # refresh key 1, then evict the oldest: key 3
    assert found_phrases(pool, 1) == [(1, 2), (1, 1)]
    assert found_phrases(pool, 3) == []
    assert found_phrases(pool, 5) == [(5, 5)]
    assert found_phrases(pool, 0) == []  # row 0 untouched
    assert int(pool_occupancy(pool)) == 3


def test_invalid_and_negative_inserts_are_no_ops():
    pool = fill(init_pool(V, G, M), [(1, [1, 1])])
    for key, ok in [(2, False), (-1, True), (1, False)]:
        after = _insert(pool, key, jnp.array([7, 7]), ok)
        chex.assert_trees_all_equal(after, pool)


def test_lookup_vmaps_like_batched_keys():
    pool = fill(init_pool(V, G, M, rows=4), [(1, [1, 1]), (5, [5, 5]), (1, [2, 2])])
    keys = jnp.array([1, 5, 0, -1])
    vm = jax.vmap(lambda k: lookup(pool, k, 2))(keys)
    bat = _lookup(pool, keys, 2)
    chex.assert_shape(bat, [(4, 2, M), (4, 2)])
    chex.assert_trees_all_equal(vm, bat)


def test_sizes_bytes_and_clear():
    big = jax.eval_shape(lambda: init_pool(152064, 20, 6))  # abstract: no 40 MiB allocation
    chex.assert_shape([big.keys, big.stamps], (65536, 20))
    chex.assert_shape(big.phrases, (65536, 20, 6))
    assert pool_bytes(big) == 65536 * 20 * (4 + 6 * 4 + 4) + 4 == 41_943_044
    small = init_pool(V, G, M)
    assert small.rows == V and pool_bytes(small) == V * G * (4 + 4 * M + 4) + 4
    full = fill(small, [(1, [1, 1]), (2, [2, 2])])
    cleared = clear_pool(full)
    assert int(pool_occupancy(cleared)) == 0 and int(cleared.clock) == 0
    assert (cleared.rows, cleared.policy) == (full.rows, full.policy)


def test_argument_checks():
    with pytest.raises(ValueError, match="policy"):
        init_pool(V, G, M, policy="random")
    with pytest.raises(ValueError, match="rows"):
        init_pool(V, G, M, rows=0)
    pool = init_pool(V, G, M)
    with pytest.raises(ValueError, match="k must be"):
        lookup(pool, 1, G + 1)
    with pytest.raises(ValueError, match="phrase"):
        insert(pool, 1, jnp.zeros(M + 1, jnp.int32))


def test_save_and_load_round_trip(tmp_path):
    from ouroboros_jax.pool import load_pool, save_pool

    pool = init_pool(vocab_size=11, guesses=3, phrase_len=2, rows=5)
    pool = insert_many(pool, jnp.array([1, 6, 1, 4], jnp.int32),
                       jnp.array([[2, 3], [4, 5], [7, 8], [9, 9]], jnp.int32),
                       jnp.array([True, True, True, False]))
    save_pool(tmp_path / "p.npz", pool)
    back = load_pool(tmp_path / "p.npz", vocab_size=11, phrase_len=2)
    chex.assert_trees_all_equal(back, pool)  # arrays, and vocab_size/policy (static fields)
    assert back.vocab_size == 11
    got, found = lookup(back, jnp.int32(1), 2)
    assert np.asarray(found).tolist() == [True, True]
    assert np.asarray(got).tolist() == [[7, 8], [2, 3]]
    with pytest.raises(ValueError, match="vocab_size 11, not 12"):
        load_pool(tmp_path / "p.npz", vocab_size=12)
    with pytest.raises(ValueError, match="phrases have 2 tokens, not 3"):
        load_pool(tmp_path / "p.npz", phrase_len=3)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable pool file"):
        load_pool(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError):
        load_pool(tmp_path / "missing.npz")
