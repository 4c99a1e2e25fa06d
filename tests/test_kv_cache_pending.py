"""A KV cache that defers its writes (`kv_cache.settle`) holds what an eager one does, a forward
refuses it unsettled, and the engine's compiled step no longer copies the whole cache."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from ouroboros_jax.models import commit, forward, init_cache, rollback
from ouroboros_jax.models.kv_cache import NewKV, settle
from ouroboros_jax.serving import executor

_DEVICE_STEP = executor.device_step  # the jitted step, before any test wraps it


def _new(rs, L, B, T, K, D):
    return NewKV(k=jnp.asarray(rs.randn(L, B, T, K, D), jnp.float32),
                 v=jnp.asarray(rs.randn(L, B, T, K, D), jnp.float32))


class _Cfg:
    num_layers, num_kv_heads, head_dim = 2, 2, 4


def _random_model(config, seed: int):
    """A float32 `Model` of random weights for `config`."""
    from ouroboros_jax.models import Model
    from ouroboros_jax.models.llama import init_params

    return Model(config=config, params=init_params(config, jax.random.key(seed), jnp.float32))


def test_deferred_commits_settle_to_the_eager_cache():
    """Random commits (narrower than, as wide as and wider than the pending slots, some past
    the end) and rollbacks: after each, the settled deferring cache's committed slots and
    lengths equal the eager cache's."""
    rs = np.random.RandomState(0)
    B, S, P = 3, 24, 4
    eager = init_cache(_Cfg, B, S)
    lazy = init_cache(_Cfg, B, S, pending_slots=P)
    assert eager.pending is None and lazy.pending is not None
    for step in range(40):
        if step % 7 == 6:
            to = jnp.asarray(rs.randint(0, S, size=B), jnp.int32)
            eager, lazy = rollback(eager, to), rollback(lazy, to)
            continue
        T, A = int(rs.randint(1, 8)), int(rs.choice([1, 2, P, P + 2]))
        new = _new(rs, 2, B, T, 2, 4)
        idx = jnp.asarray(rs.randint(0, T, size=(B, A)), jnp.int32)
        counts = jnp.asarray(rs.randint(0, A + 1, size=B), jnp.int32)
        eager, lazy = commit(eager, new, idx, counts), commit(lazy, new, idx, counts)
        assert (lazy.pending is not None) and lazy.pending.k.shape[2] == P
        got = settle(lazy)
        np.testing.assert_array_equal(got.lengths, eager.lengths)
        for b in range(B):
            n = min(int(eager.lengths[b]), S)
            np.testing.assert_array_equal(got.k[:, b, :n], eager.k[:, b, :n])
            np.testing.assert_array_equal(got.v[:, b, :n], eager.v[:, b, :n])


def test_a_forward_refuses_a_cache_with_writes_pending(tiny_target):
    m = tiny_target
    cache = init_cache(m.config, 1, 32, pending_slots=4)
    tok, pos, mask = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), \
        jnp.ones((1, 1, 1), bool)
    with pytest.raises(ValueError, match="settle"):
        forward(m.params, m.config, tok, pos, mask, cache)
    logits, _ = forward(m.params, m.config, tok, pos, mask, settle(cache))
    assert logits.shape == (1, 1, m.config.vocab_size)


def _step_cache_copies(monkeypatch, method: str, pending: int) -> dict:
    """{rows: copies of a whole target-cache-shaped buffer} in the engine's compiled steps, one
    per row bucket (a tiny random model in the packed layout decoding uses on a CPU, 2 slots x
    256: steps of 1 and of 2 rows)."""
    import ouroboros_jax.decoding.common as common
    from ouroboros_jax import serving
    from ouroboros_jax.models import layout
    from ouroboros_jax.models.config import ModelConfig

    monkeypatch.setattr(common, "PENDING_SLOTS", pending)
    monkeypatch.setattr(layout, "PACK_MIN_BYTES", 0)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    draft = None
    if method != "vanilla":  # a 1-layer draft: its cache has another shape
        draft = _random_model(dataclasses.replace(cfg, num_layers=1), 1)
    eng = serving.Engine(_random_model(cfg, 0), draft, method=method, config=None,
                         slots=2, max_cache_len=256, rounds_per_step=2)
    seen = {}
    real = _DEVICE_STEP

    def spy(pair, dev, stop, **kw):
        if kw["greedy"]:
            seen[kw["rows"]] = (pair, dev, stop, kw)
        return real(pair, dev, stop, **kw)

    monkeypatch.setattr(executor, "device_step", spy)
    eng.warmup(prompt_widths=(16,))
    shape = "f32[2,2,256,2,16]"  # [L, B, S, K, D]
    out = {}
    for rows, (pair, dev, stop, kw) in seen.items():
        txt = real.lower(pair, dev, stop, **kw).compile().as_text()
        out[rows] = sum(1 for line in txt.splitlines()
                        if " copy(" in line and line.split("=", 1)[-1].strip().startswith(shape))
    return out


@pytest.mark.parametrize("method", ["vanilla"])
def test_the_engine_step_updates_the_target_cache_in_place(monkeypatch, method):
    """With the target's commits deferred no round copies its cache, in the step of every row
    bucket (a one-row step reads and writes its row where it lies); written at once (pending
    slots 0, the control), XLA:CPU copies it every round."""
    assert max(_step_cache_copies(monkeypatch, method, 0).values()) > 0
    jax.clear_caches()
    assert _step_cache_copies(monkeypatch, method, 16) == {1: 0, 2: 0}
