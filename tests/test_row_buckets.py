"""Engine steps over the busy head of the slots (`serving.row_buckets`): a step of b rows leaves
the engine's state and outputs as a step of every slot does, for every method and both
sampling modes, and one request runs one-row steps."""

import jax
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.models.kv_cache import KVCache, settle
from ouroboros_jax.serving import Engine, RequestParams
from ouroboros_jax.serving import executor
from ouroboros_jax.serving.row_buckets import buckets, rows_for

from conftest import REPEAT

_DEVICE_STEP = executor.device_step
# small trees: the cache holds 64 positions
CONFIGS = {"vanilla": None, "prompt_lookup": None, "speculative": oj.SpeculativeConfig(gamma=3),
           "lookahead": oj.LookaheadConfig(window=4, ngram=4, guesses=4),
           "ouroboros": oj.OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)}


def test_buckets_and_the_rows_a_step_needs():
    assert buckets(8) == (1, 2, 4, 8)
    assert buckets(6) == (1, 2, 4, 6)
    assert buckets(1) == (1,)
    assert buckets(8, sharded=True) == (8,)
    sizes = buckets(8)
    assert rows_for([0], sizes) == 1
    assert rows_for([1], sizes) == 2
    assert rows_for([0, 2], sizes) == 4  # the highest busy slot decides, not the count
    assert rows_for([4], sizes) == 8
    assert rows_for([7], buckets(8)) == 8
    assert rows_for([4], buckets(6)) == 6


def _settled(dev):
    """dev's leaves, KV caches settled and their slots past each row's length zeroed: a row
    outside a step's bucket keeps its last writes pending until a step includes it (settled,
    the same slots), and a step may write garbage past a done row's length (invisible)."""
    def one(x):
        if isinstance(x, KVCache):
            s = settle(x)
            held = (np.arange(s.num_slots)[None, :] < np.asarray(s.lengths)[:, None])
            held = held[None, :, :, None, None]
            return (np.where(held, s.k, 0), np.where(held, s.v, 0), s.lengths)
        return x
    return jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(one, dev, is_leaf=lambda x: isinstance(x, KVCache)))


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("method", ["vanilla", "speculative", "prompt_lookup", "lookahead",
                                    "ouroboros"])
def test_a_head_step_equals_a_full_step(tiny_pair, method, greedy):
    """Two busy slots of four, mid-generation: one step over rows [0, 2) and one over all four,
    from copies of the same state, give the same outputs and (caches settled) the same
    state, leaf for leaf."""
    target, draft, _ = tiny_pair
    eng = Engine(target, draft if method in ("speculative", "ouroboros") else None,
                 method=method, config=CONFIGS[method], slots=4, max_cache_len=64,
                 rounds_per_step=2)
    params = RequestParams(max_tokens=30, temperature=0.0 if greedy else 0.9, seed=3)
    for p in (REPEAT[0], REPEAT[2]):
        eng.submit(p, params)
    eng.step()  # both admitted (slots 0 and 1) and a step run
    ex = eng._executor
    kw = dict(round_fn=ex.spec.round, cfg=ex.levels[0][1], greedy=greedy, rounds=ex.rounds,
              width=ex.width)
    stop = jax.numpy.zeros((4,), bool)
    head_dev, head_out = _DEVICE_STEP(ex.pair, executor._copy(ex.dev), stop, rows=2, **kw)
    full_dev, full_out = _DEVICE_STEP(ex.pair, executor._copy(ex.dev), stop, rows=None, **kw)
    out = ex.read(np.asarray(head_out))
    assert out.counts[:2].min() > 0  # the step did emit for both busy rows
    np.testing.assert_array_equal(np.asarray(head_out), np.asarray(full_out))
    a, b = _settled(head_dev), _settled(full_dev)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_same_state(np.asarray(x), np.asarray(y))


def assert_same_state(x: np.ndarray, y: np.ndarray) -> None:
    """What is exact by construction (tokens, counts, lengths, flags: every integer and bool
    leaf) bit for bit; floats within rounding. The K/V a 2-row step writes come from dots of
    another shape than the 4-row step's, and how the dot kernel splits its sums depends on the
    shape and the CPU: bit-identical on AVX-512 Xeons, 224 of 16,384 elements apart by at most
    3.4e-5 relative where oneDNN runs its AVX2 kernels (an AMD EPYC, or
    ONEDNN_MAX_CPU_ISA=AVX2). A wrong row or slot is off by O(1), far outside the tolerance."""
    assert x.dtype == y.dtype and x.shape == y.shape
    if np.issubdtype(x.dtype, np.floating):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
    else:
        np.testing.assert_array_equal(x, y)


def test_one_request_runs_one_row_steps(tiny_target, monkeypatch):
    """With one request in an 8-slot engine every step computes one row; with requests in
    slots 0 to 2, four (the smallest bucket holding slot 2)."""
    seen = []
    real = executor.device_step

    def spy(pair, dev, stop, **kw):
        seen.append(kw["rows"])
        return real(pair, dev, stop, **kw)

    monkeypatch.setattr(executor, "device_step", spy)
    eng = Engine(tiny_target, method="vanilla", config=None, slots=8, max_cache_len=64,
                 rounds_per_step=2)
    eng.submit(REPEAT[0], RequestParams(max_tokens=9))
    while eng.step():
        pass
    assert seen and set(seen) == {1}
    seen.clear()
    hs = [eng.submit(p, RequestParams(max_tokens=n))
          for p, n in ((REPEAT[0], 12), (REPEAT[1], 2), (REPEAT[2], 12))]
    eng.step()  # admitted into slots 0, 1, 2
    assert seen[-1] == 4
    while eng.step():
        pass
    assert all(h.done for h in hs)
