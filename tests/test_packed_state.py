"""The serving engine's device state with its small leaves packed (`serving/packed_state.py`)
and a step's outputs read on the host (`executor.StepOutput.rows`): the packed state
round-trips bit for bit, a packed step gives what an unpacked one gives, and the host's rows
are the packed outputs' fields."""

import jax
import jax.numpy as jnp
import numpy as np

import ouroboros_jax as oj
from ouroboros_jax.decoding.common import SOURCES
from ouroboros_jax.serving import Engine, RequestParams, executor
from ouroboros_jax.serving.packed_state import Packed, layout_of, pack, packed, unpack, unpacked

from conftest import REPEAT


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        # bit for bit (NaN payloads and -0.0 included)
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                      np.atleast_1d(np.asarray(y)).view(np.uint8))


def test_every_packable_dtype_round_trips_bit_for_bit():
    tree = {"b": jnp.asarray([True, False, True]), "i": jnp.asarray([-5, 0, 2**31 - 1], jnp.int32),
            "u": jnp.asarray([0, 2**32 - 1, 7], jnp.uint32),
            "f": jnp.asarray([np.nan, -0.0, 1e-38, -3.5], jnp.float32),
            "scalar": jnp.asarray(4, jnp.int32), "big": jnp.arange(5000, dtype=jnp.float32),
            "half": jnp.ones((2,), jnp.bfloat16), "empty": jnp.zeros((0,), jnp.int32)}
    p = packed(tree)
    # the large leaf, the bf16 one and the empty one travel as they are; the rest in one
    # int32 vector
    assert len(p.big) == 3 and p.small.dtype == jnp.int32 and p.small.shape == (3 + 3 + 3 + 4 + 1,)
    _leaves_equal(unpacked(p), tree)
    _leaves_equal(jax.jit(lambda t: unpack(pack(t, layout_of(tree))))(tree), tree)
    assert layout_of(tree) == p.layout  # one registry entry per layout


def _engine(tiny_pair, method, config):
    target, draft, _ = tiny_pair
    eng = Engine(target, draft if method in ("speculative", "ouroboros") else None,
                 method=method, config=config, slots=4, max_cache_len=64, rounds_per_step=2)
    for p, n in ((REPEAT[0], 20), (REPEAT[3], 7)):
        eng.submit(p, RequestParams(max_tokens=n))
    eng.step()  # admitted, and one step run
    return eng


def test_a_packed_step_equals_an_unpacked_one(tiny_pair):
    """The engine's held state is packed (a few leaves); the same step on it and on its
    unpacked copy gives the same outputs and the same state."""
    eng = _engine(tiny_pair, "ouroboros", oj.OuroborosConfig(gamma=3, window=3, ngram=3,
                                                            guesses=3, suffixes=2))
    ex = eng._executor
    assert isinstance(ex.held, Packed)
    n_packed, n_plain = (len(jax.tree_util.tree_leaves(x)) for x in (ex.held, ex.dev))
    assert n_packed <= n_plain // 2, (n_packed, n_plain)
    kw = dict(round_fn=ex.spec.round, cfg=ex.levels[0][1], greedy=True, rounds=ex.rounds,
              width=ex.width, rows=None)
    stop = np.zeros((4,), bool)
    plain_dev, plain_out = executor.device_step(ex.pair, executor._copy(ex.dev), stop, **kw)
    held_dev, held_out = executor.device_step(ex.pair, executor._copy(ex.held), stop, **kw)
    assert isinstance(held_dev, Packed) and not isinstance(plain_dev, Packed)
    np.testing.assert_array_equal(np.asarray(plain_out), np.asarray(held_out))
    assert np.asarray(plain_out)[ex.slots * ex.width:][:2].min() > 0  # both rows emitted
    _leaves_equal(unpacked(held_dev), plain_dev)


def test_rows_read_the_packed_fields(tiny_pair):
    """StepOutput.rows against the fields cut from the packed array with numpy."""
    rng = np.random.default_rng(0)
    B, E, k = 5, 4, 3
    toks = rng.integers(0, 1000, (B, E))
    counts = rng.integers(0, E + 1, (B,))
    kept, live = rng.integers(1, 4, (k, B)), rng.random((k, B)) < 0.7
    prop = rng.integers(0, 5, (k, B))
    done = rng.random((B,)) < 0.5
    sources = rng.integers(0, 9, (B, len(SOURCES)))
    own = np.arange(17, 17 + len(executor.OWN_COUNTERS))  # pool hits 17, then the others
    flat = np.asarray(executor.StepOutput.pack(toks, counts, kept, live, prop, done, own,
                                               sources))
    out = executor.StepOutput(flat, B, E, k)
    assert out.hits == 17
    assert out.own == dict(zip(executor.OWN_COUNTERS, own.tolist()))
    names = ("pool_phrases", "draft_chain")
    busy = [4, 0, 2]
    for r, row in zip(busy, out.rows(busy, names)):
        assert row.tokens == toks[r, :counts[r]].tolist()
        assert row.kept == kept[live[:, r], r].tolist()
        assert row.proposed == prop[live[:, r], r].tolist()
        assert row.sources == {s: int(sources[r, SOURCES.index(s)]) for s in names}
        assert row.done == bool(done[r])
    np.testing.assert_array_equal(out.counts, counts)
    np.testing.assert_array_equal(out.done, done)
