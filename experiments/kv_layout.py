"""Is the KV cache faster as [L,B,K,S,D] than as its [L,B,S,K,D]? Result: printed; equal within
noise, so the cache kept slots before heads (commit 7409493).

KV layout: [L,B,S,K,D] (slots before heads, the cache's layout) against [L,B,K,S,D].

    python -m experiments.kv_layout

Times, in one process and interleaved, the two things the layout touches on the demo target's
shape (L 8, K 6, D 64, fp32, batch 1): the blockwise attention of every layer over a
half-full 1024-slot cache for T = 1 and 16 new tokens, and the commit of 4 new tokens. Prints
ms per call and the ratio K-major / S-major (> 1: the cache's layout is faster).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.models.attention import BLOCK, online_update

L, B, S, K, D, J = 8, 1, 1024, 6, 64, 1


def _attend(kmajor: bool, q, cache_k, cache_v, length):
    """Every layer's blockwise attention over the cache; q [B,T,K,J,D]."""
    T = q.shape[1]
    Z = BLOCK
    scale = 1.0 / math.sqrt(D)
    n = (length + Z - 1) // Z

    def layer(acc_out, l):
        def body(i, carry):
            if kmajor:
                kb = jax.lax.dynamic_slice(cache_k, (l, 0, 0, i * Z, 0), (1, B, K, Z, D))[0]
                vb = jax.lax.dynamic_slice(cache_v, (l, 0, 0, i * Z, 0), (1, B, K, Z, D))[0]
                s = jnp.einsum("btkjd,bkzd->bkjtz", q, kb) * scale
                vis = (i * Z + jnp.arange(Z)) < length
                m, lsum, acc = carry
                m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, -1e30), -1))
                p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                return (m_new, lsum * corr + p.sum(-1),
                        acc * corr[..., None] + jnp.einsum("bkjtz,bkzd->bkjtd", p, vb))
            kb = jax.lax.dynamic_slice(cache_k, (l, 0, i * Z, 0, 0), (1, B, Z, K, D))[0]
            vb = jax.lax.dynamic_slice(cache_v, (l, 0, i * Z, 0, 0), (1, B, Z, K, D))[0]
            s = jnp.einsum("btkjd,bzkd->bkjtz", q, kb) * scale
            vis = (i * Z + jnp.arange(Z)) < length
            return online_update(carry, s, vis, vb)

        init = (jnp.full((B, K, J, T), -1e30), jnp.zeros((B, K, J, T)),
                jnp.zeros((B, K, J, T, D)))
        _, lsum, acc = jax.lax.fori_loop(0, n, body, init)
        return acc_out + (acc / lsum[..., None]).sum(), None

    return jax.lax.scan(layer, jnp.zeros(()), jnp.arange(L))[0]


def _commit(kmajor: bool, cache_k, new_k, length):
    A = new_k.shape[2]
    slot = length + jnp.arange(A)
    if kmajor:
        return cache_k.at[:, :, :, slot].set(jnp.swapaxes(new_k, 2, 3))
    return cache_k.at[:, :, slot].set(new_k)


def main():
    rs = np.random.RandomState(0)
    out = {}
    timers = {}
    for kmajor in (False, True):
        shape = (L, B, K, S, D) if kmajor else (L, B, S, K, D)
        ck = jnp.asarray(rs.randn(*shape).astype(np.float32))
        cv = jnp.asarray(rs.randn(*shape).astype(np.float32))
        for T in (1, 16):
            q = jnp.asarray(rs.randn(B, T, K, J, D).astype(np.float32))
            f = jax.jit(lambda q, ck, cv, n, km=kmajor: jax.lax.fori_loop(
                0, 8, lambda i, a: a + _attend(km, q + a * 0, ck, cv, n), jnp.zeros(())))
            timers[(kmajor, f"attend T={T}")] = (f, (q, ck, cv, jnp.int32(512)), 8)
        new = jnp.asarray(rs.randn(L, B, 4, K, D).astype(np.float32))
        g = jax.jit(lambda ck, new, km=kmajor: jax.lax.fori_loop(
            0, 8, lambda i, c: _commit(km, c, new, 500 + i), ck), donate_argnums=0)
        timers[(kmajor, "commit A=4")] = (g, (ck, new), 8)
    samples = {k: [] for k in timers}
    for k, (f, args, _) in timers.items():
        if k[1].startswith("commit"):
            args = (jnp.array(args[0]), args[1])  # the commit donates its cache
        jax.block_until_ready(f(*args))
    for _ in range(15):
        for k, (f, args, inner) in timers.items():
            if k[1].startswith("commit"):
                args = (jnp.array(args[0]), args[1])
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            samples[k].append((time.perf_counter() - t0) / inner)
    for k, v in samples.items():
        out[k] = 1e3 * float(np.median(v))
    for what in ("attend T=1", "attend T=16", "commit A=4"):
        s, k = out[(False, what)], out[(True, what)]
        print(f"{what}: [L,B,S,K,D] {s:.3f} ms, [L,B,K,S,D] {k:.3f} ms, K-major/S-major "
              f"{k / s:.2f}")


if __name__ == "__main__":
    main()
