"""The blockwise attention kernel against the dense reference: ragged rows, tree masks, sliding
windows, empty rows, and proof that cache blocks past the longest row are never read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models.attention import (blockwise_attention, dense_attention,
                                            kernel_for_backend, live_block_count, set_kernel)

L, B, S, T, H, K, D = 2, 4, 512, 5, 4, 2, 16


def _inputs(lengths, seed=0):
    rs = np.random.RandomState(seed)
    f = lambda *s: jnp.asarray(rs.randn(*s).astype(np.float32))  # noqa: E731
    q, k_new, v_new = f(B, T, H, D), f(B, T, K, D), f(B, T, K, D)
    cache_k, cache_v = f(L, B, S, K, D), f(L, B, S, K, D)
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = lengths[:, None] + jnp.asarray([0, 1, 1, 2, 2])[None]  # a small tree
    parent = np.array([-1, 0, 0, 1, 2])
    mask = np.eye(T, dtype=bool)
    for i in range(T):
        j = parent[i]
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    mask = jnp.broadcast_to(jnp.asarray(mask), (B, T, T))
    return q, k_new, v_new, positions, mask, cache_k, cache_v, lengths


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("lengths", [[0, 130, 300, 17], [64, 64, 64, 64], [0, 0, 0, 0],
                                     [500, 1, 250, 128]])
def test_blockwise_equals_dense(lengths, window):
    args = _inputs(lengths)
    for layer in (0, 1):
        ref = dense_attention(*args, jnp.int32(layer), window)
        for block in (64, 128, 512):
            got = blockwise_attention(*args, jnp.int32(layer), window, block=block)
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_blocks_past_the_longest_row_are_never_read():
    lengths = [130, 17, 0, 100]
    q, k_new, v_new, pos, mask, ck, cv, lens = _inputs(lengths)
    ref = dense_attention(q, k_new, v_new, pos, mask, ck, cv, lens, jnp.int32(0), None)
    live = int(live_block_count(lens, S, 64)) * 64  # 192: every slot from here on is poison
    assert live == 192
    ck = ck.at[:, :, live:].set(jnp.nan)
    cv = cv.at[:, :, live:].set(jnp.nan)
    got = jax.jit(lambda *a: blockwise_attention(*a, block=64))(
        q, k_new, v_new, pos, mask, ck, cv, lens, jnp.int32(0), None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_kernel_seam():
    assert kernel_for_backend("cpu") is blockwise_attention
    assert kernel_for_backend("tpu") is blockwise_attention
    # a GPU's while loop returns to the host every iteration: dense there (measured, BY_BACKEND)
    assert kernel_for_backend("gpu") is dense_attention
    set_kernel("blockwise")
    try:
        assert kernel_for_backend("gpu") is blockwise_attention
    finally:
        set_kernel(None)
    set_kernel("dense")
    try:
        assert kernel_for_backend("gpu") is dense_attention
    finally:
        set_kernel(None)
    with pytest.raises(ValueError, match="attention kernel"):
        set_kernel("flash")
