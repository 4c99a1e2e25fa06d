"""The shared lookahead (Jacobi) step: the tree forward (with a causal prefix of per-row length)
equals a plain causal forward along each node's ancestors, the window starts as a Hankel fill
and moves up one level per step, n-grams are harvested after warm-up, and a pool guess that
agrees with the model is accepted whole."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.decoding.common import prefill
from ouroboros_jax.decoding.jacobi import (commit_with_prefix, init_window, jacobi_step,
                                           tree_forward)
from ouroboros_jax.models import causal_mask, forward
from ouroboros_jax.pool import init_pool, insert_many, lookup, pool_occupancy
from ouroboros_jax.tree import jacobi_tree

W, N, G = 3, 4, 2
M = N - 1
LAY = jacobi_tree(W, N, G)


def _greedy(logits, positions):
    return jnp.argmax(logits, -1).astype(jnp.int32)


@partial(jax.jit, static_argnums=1)
def _causal_logits(params, config, tokens):
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return forward(params, config, tokens, pos, causal_mask(1, tokens.shape[1]))[0][0]


def _causal_last_logits(model, seq, pad=32):
    """Plain causal forward (padded to a fixed length: later tokens cannot change it)."""
    s = jnp.asarray([seq + [0] * (pad - len(seq))], jnp.int32)
    return np.asarray(_causal_logits(model.params, model.config, s)[len(seq) - 1])


def _ancestors(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def test_init_window_is_hankel_of_prompt_tail():
    prompt = jnp.asarray([[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 0, 0, 0, 0, 0, 0]])
    win = init_window(LAY, prompt, jnp.asarray([6, 2]))
    u_len = W + N - 3
    rows = [([10, 11, 12, 13, 14, 15], 6), ([20, 21], 2)]
    for b, (toks, plen) in enumerate(rows):
        u = [toks[(plen - u_len + i) % plen] for i in range(u_len)]
        for lvl in range(M):
            for c in range(W):
                if (lvl, c) != (0, 0):
                    assert int(win.grid[b, lvl, c]) == u[lvl + c - 1]
    assert win.grid.shape == (2, M, W) and not np.any(np.asarray(win.steps))


def test_tree_forward_with_prefix_equals_causal_forward(tiny_target):
    rs = np.random.RandomState(0)
    B, P = 2, 4
    seqs = [rs.randint(3, 97, size=12).tolist() for _ in range(B)]
    cached = np.array([5, 2])  # tokens already in each row's cache
    pcount = np.array([3, 0])  # prefix tokens each row still has to feed
    prompt = jnp.asarray([s[:8] for s in seqs], jnp.int32)
    cache = prefill(tiny_target.params, tiny_target.config, prompt, jnp.asarray(cached + 1), 32,
                    jnp.float32)
    prefix = jnp.asarray([s[c:c + P] for s, c in zip(seqs, cached)], jnp.int32)
    tokens = jnp.asarray(rs.randint(3, 97, size=(B, LAY.size)), jnp.int32)
    valid = np.ones((B, LAY.size), bool)
    valid[0, LAY.guess_index[1]] = False  # an absent guess: masked, never an ancestor
    logits, new, pos = tree_forward(tiny_target.params, tiny_target.config, cache, tokens,
                                    LAY.parents, LAY.depths, jnp.asarray(valid),
                                    np.arange(LAY.size), prefix, jnp.asarray(pcount))
    assert new.k.shape[2] == P + LAY.size
    for b in range(B):
        base = seqs[b][:cached[b] + pcount[b]]
        for i in range(LAY.size):
            if not valid[b, i]:
                continue
            path = [int(tokens[b, j]) for j in _ancestors(LAY.parents, i)]
            ref = _causal_last_logits(tiny_target, base + path)
            np.testing.assert_allclose(np.asarray(logits[b, i]), ref, atol=2e-4, rtol=2e-4)
            assert int(pos[b, i]) == len(base) + len(path) - 1


def test_step_moves_window_harvests_and_accepts_guess(tiny_target):
    rs = np.random.RandomState(1)
    prompt_l = rs.randint(3, 97, size=10).tolist()
    prompt = jnp.asarray([prompt_l], jnp.int32)
    plen = jnp.asarray([10])
    cache = prefill(tiny_target.params, tiny_target.config, prompt, plen, 64, jnp.float32)
    # the model's own greedy continuation of the prompt, as a pool guess keyed by `last`
    cont = []
    for _ in range(M + 1):
        cont.append(int(np.argmax(_causal_last_logits(tiny_target, prompt_l + cont))))
    # the full continuation is older (lookup index 1) than a guess agreeing on 2 tokens only
    wrong = (cont[2] + 1) % 97
    pool = insert_many(init_pool(97, G, M), jnp.asarray([prompt_l[-1], prompt_l[-1]]),
                       jnp.asarray([cont[:M], [cont[0], cont[1], wrong]], jnp.int32))
    win = init_window(LAY, prompt, plen)
    win = win.replace(steps=jnp.asarray([N - 2]))  # pretend warm: harvest this step
    last = prompt[:, -1]
    res = jacobi_step(tiny_target.params, tiny_target.config, LAY, cache, win, pool, last,
                      jnp.asarray([True]), _greedy)
    # the longest-agreeing guess wins, not the newest: M matched tokens + the bonus
    assert int(res.acc.count[0]) == N
    assert res.acc.tokens[0].tolist() == cont
    assert res.acc.path[0].tolist() == [0] + LAY.guess_index[1].tolist()
    # window moved up one level; its new bottom row = predictions at level N-2
    np.testing.assert_array_equal(res.window.grid[:, :-1], win.grid[:, 1:])
    assert int(res.window.steps[0]) == N - 1
    bottom = res.window.grid[0, -1].tolist()
    for c in range(W):
        path = [int(x) for x in ([prompt_l[-1]] + win.grid[0, 0, 1:c + 1].tolist()
                                 + win.grid[0, 1:, c].tolist())]
        assert bottom[c] == int(np.argmax(_causal_last_logits(tiny_target, prompt_l[:-1] + path)))
    # every column's n-gram is in the pool: key level0[c-1] (last for c = 0)
    keys = [prompt_l[-1]] + win.grid[0, 0, 1:].tolist()
    for c in range(W):
        phrase = win.grid[0, 1:, c].tolist() + [bottom[c]]
        got, found = lookup(res.pool, jnp.asarray(keys[c]), G)
        assert phrase in np.asarray(got)[np.asarray(found)].tolist()
    assert int(pool_occupancy(res.pool)) > int(pool_occupancy(pool))
    # committing the path advances the cache by exactly the accepted nodes
    c2 = commit_with_prefix(cache, res.new, 0, jnp.zeros((1,), jnp.int32), res.acc.path,
                            res.acc.count)
    assert int(c2.lengths[0]) == 9 + N


def test_inactive_rows_keep_window_and_pool(tiny_target):
    prompt = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32)
    plen = jnp.asarray([5])
    cache = prefill(tiny_target.params, tiny_target.config, prompt, plen, 32, jnp.float32)
    win = init_window(LAY, prompt, plen).replace(steps=jnp.asarray([5]))
    pool = init_pool(97, G, M)
    res = jacobi_step(tiny_target.params, tiny_target.config, LAY, cache, win, pool,
                      prompt[:, -1], jnp.asarray([False]), _greedy)
    np.testing.assert_array_equal(res.window.grid, win.grid)
    assert int(pool_occupancy(res.pool)) == 0 and int(res.window.steps[0]) == 5
