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
    insert_context,
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
_insert_context = jax.jit(insert_context)


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


CB, CP = 2, 8  # context rows and padded width of the context property test


def context_ops(tokens, lengths):
    """The (key, phrase) inserts `insert_context` must make, in order, written out by hand:
    step k visits every row's n-gram starting at k + length - P (rows aligned at their ends),
    when it starts inside the row."""
    P = tokens.shape[1]
    out = []
    for k in range(P - M):
        for row, n in zip(tokens, lengths):
            i = k + n - P
            if i >= 0:
                out.append((int(row[i]), [int(t) for t in row[i + 1:i + 1 + M]]))
    return out


@SETTINGS
@given(st.sampled_from([V, 4, 2]), st.sampled_from(["lru", "fifo"]),
       st.lists(st.integers(0, V - 1), min_size=CB * CP, max_size=CB * CP),
       st.lists(st.integers(1, CP), min_size=CB, max_size=CB))
def test_insert_context_matches_reference(rows, policy, flat, lengths):
    tokens = np.array(flat, np.int32).reshape(CB, CP)
    pool = _insert_context(init_pool(V, G, M, rows=rows, policy=policy), tokens,
                           np.array(lengths, np.int32))
    ref = RefPool(rows, G, policy)
    for key, phrase in context_ops(tokens, lengths):
        ref.insert(key, phrase)
    assert_same(pool, ref)


# ----------------------------------------------------------------------------- concrete


def test_insert_context_holds_exactly_the_prompts_ngrams():
    """Two right-padded prompts; every key has room for all its phrases. The pool then holds
    the prompts' trigrams and nothing else (none reaching into the padding), each key's newest
    first by its last occurrence, the later of two prompts' ends newest."""
    V2, G2, N = 50, 8, 3
    a = [5, 6, 7, 5, 6, 8, 9, 5, 6, 7]  # (5 | 6 7) twice, (5 | 6 8) between
    b = [11, 5, 6, 12]
    tokens = np.full((2, 12), 49, np.int32)  # padding 49: an n-gram through it would show
    tokens[0, :len(a)], tokens[1, :len(b)] = a, b
    pool = _insert_context(init_pool(V2, G2, N - 1), tokens, np.array([len(a), len(b)]))
    want = {(int(g[0]), tuple(int(t) for t in g[1:]))
            for p in (a, b) for g in np.lib.stride_tricks.sliding_window_view(np.array(p), N)}
    filled = np.asarray(pool.stamps) > 0
    held = [(int(k), tuple(ph)) for k, ph in zip(np.asarray(pool.keys)[filled],
                                                  np.asarray(pool.phrases)[filled].tolist())]
    assert sorted(held) == sorted(want)  # each n-gram once: a repeat refreshes, never adds
    phrases, found = _lookup(pool, jnp.int32(5), G2)
    got = [tuple(p) for p, f in zip(np.asarray(phrases).tolist(), np.asarray(found)) if f]
    # b's (5 | 6 12) and a's second (5 | 6 7) both end their prompts (the same, last step; b
    # is the later row); a's (5 | 6 8) ends 4 tokens before a's end
    assert got == [(6, 12), (6, 7), (6, 8)]
    # the latest phrases win: (6 7) is refreshed by its repeat, and with more phrases than G
    # slots the oldest goes
    small = _insert_context(init_pool(V2, 2, N - 1), tokens[:1], np.array([len(a)]))
    assert found_phrases(small, 5, 2) == [(6, 7), (6, 8)]
    small = _insert_context(init_pool(V2, 2, N - 1), np.array([[5, 6, 1, 5, 6, 2, 5, 6, 3]]),
                            np.array([9]))
    assert found_phrases(small, 5, 2) == [(6, 3), (6, 2)]  # (6 1), the oldest, evicted
    # a per-row key offset moves the row's keys into its own range (per-request pools)
    moved = _insert_context(init_pool(2 * V2, G2, N - 1, rows=2 * V2), tokens,
                            np.array([len(a), len(b)]), np.array([0, V2], np.int32))
    assert found_phrases(moved, 5, G2) == [(6, 7), (6, 8)]
    assert found_phrases(moved, V2 + 5, G2) == [(6, 12)]
    assert found_phrases(moved, V2 + 11, G2) == [(5, 6)]
    # prompts too short for one n-gram (or a width below N) insert nothing
    none = _insert_context(init_pool(V2, G2, N - 1), tokens, np.array([2, 1]))
    assert int(pool_occupancy(none)) == 0 and int(none.clock) == 0
    assert int(insert_context(init_pool(V2, G2, 4), tokens[:, :3], np.array([3, 3])).clock) == 0


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
