"""Attention kernels of the forward, and the one seam where a backend picks its kernel.

Letters as in the package glossary (`ouroboros_jax/__init__.py`): B rows, T new tokens, S cache
slots, L layers, H query heads, K kv heads, J = H / K query heads per kv head, D head dim, Z slots
of one cache block (einsums write the new tokens as keys `o`).

Every kernel computes the same thing: grouped-query attention of T new tokens over the committed
cache slots `s < cache_len[b]` (everyone's ancestor) and over each other through `mask[B,T,T]`,
with an optional sliding window, scores and softmax in fp32. Kernels take the whole stacked cache
`[L,B,S,K,D]` and a layer index, so a layer reads only what it needs instead of the layer scan
slicing (copying) all S slots of every layer.

- `blockwise` (the default): an online softmax (fp32 running max, sum and output) over cache
  blocks of Z slots, visiting only blocks below the longest live row (a `fori_loop` whose trip
  count is a traced value), then over the new tokens. Its cost follows the live length, not the
  padded cache size, so a large `max_new_tokens` that is never reached costs nothing.
- `dense`: softmax over all S slots at once (the reference; reads every padded slot). The GPU
  default: there a `while` loop's every iteration is a round trip to the host (`BY_BACKEND`).

`kernel_for_backend` is the seam: an accelerator kernel (`jax.nn.dot_product_attention` with a
cuDNN backend, a Pallas flash/paged kernel) registers in `KERNELS` under a name and is returned
there for "gpu" / "tpu". `set_kernel` overrides the choice; it is read when a forward is traced,
so it must be set before the first call is compiled.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

BLOCK = 128  # cache slots per block (measured on the demo pair, see experiments/engine_speed.py)

_F32 = jnp.float32
_NEG = float(jnp.finfo(jnp.float32).min)


def _scores(qg, k, scale, softcap=None):
    """qg [B,T,K,J,D], k [B,Z,K,D] -> fp32 scores [B,K,J,T,Z], soft-capped to
    softcap * tanh(s / softcap) when softcap is set (Gemma 2)."""
    s = jnp.einsum("btkjd,bzkd->bkjtz", qg, k.astype(qg.dtype),
                   preferred_element_type=_F32) * scale
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def first_window_block(positions, window, block: int):
    """int32[]: the first cache block any new token can see through a sliding window (0
    without one): blocks wholly below every token's window hold nothing visible, and an
    online-softmax step over a block with nothing visible changes nothing, so skipping them
    is exact. window: None, an int or a traced int32[]."""
    if window is None:
        return jnp.int32(0)
    lowest = jnp.min(positions).astype(jnp.int32) - jnp.asarray(window, jnp.int32) + 1
    return jnp.maximum(lowest, 0) // block


def _new_token_visibility(positions, mask, window):
    """bool[B,T,T]: new token i sees new token j."""
    if window is None:
        return mask
    return mask & (positions[:, :, None] - positions[:, None, :] < window)


def _cache_visibility(positions, cache_len, slot, window):
    """slot int[Z] -> bool[B,T or 1,Z]: the slot is committed (and inside the window)."""
    vis = slot[None, None, :] < cache_len[:, None, None]
    if window is not None:
        vis = vis & (positions[:, :, None] - slot[None, None, :] < window)
    return vis


def dense_attention(q, k_new, v_new, positions, mask, cache_k, cache_v, cache_len, layer,
                    window, live_blocks=None, scale=None, softcap=None):
    """Reference kernel: one softmax over every cache slot and the new tokens.

    q [B,T,H,D]; k_new, v_new [B,T,K,D]; positions int[B,T]; mask bool[B,T,T]; cache_k, cache_v
    [L,B,S,K,D] or None; cache_len int[B]; layer int[]; window int, traced int32[] or None;
    scale: the score scale (None: D**-0.5); softcap: None or the scores' soft cap
    -> [B,T,H,D].
    """
    B, T, H, D = q.shape
    K = k_new.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s_new = _scores(qg, k_new, scale, softcap)
    s_new = jnp.where(_new_token_visibility(positions, mask, window)[:, None, None], s_new, _NEG)
    if cache_k is None:
        p = jax.nn.softmax(s_new, axis=-1)
        out = jnp.einsum("bkjto,bokd->btkjd", p.astype(v_new.dtype), v_new)
        return out.reshape(B, T, H, D)
    # rows [0, B): the cache may hold more (a `kv_cache.head_rows` view)
    ck = jax.lax.dynamic_index_in_dim(cache_k, layer, 0, keepdims=False)[:B]
    cv = jax.lax.dynamic_index_in_dim(cache_v, layer, 0, keepdims=False)[:B]
    S = ck.shape[1]
    vis = _cache_visibility(positions, cache_len, jnp.arange(S), window)
    s_cache = jnp.where(vis[:, None, None], _scores(qg, ck, scale, softcap), _NEG)
    p = jax.nn.softmax(jnp.concatenate([s_cache, s_new], axis=-1), axis=-1)
    p_cache, p_new = p[..., :S].astype(v_new.dtype), p[..., S:].astype(v_new.dtype)
    out = (jnp.einsum("bkjts,bskd->btkjd", p_cache, cv.astype(v_new.dtype))
           + jnp.einsum("bkjto,bokd->btkjd", p_new, v_new))
    return out.reshape(B, T, H, D)


def online_update(carry, s, vis, v):
    """One online-softmax step. carry (m [B,K,J,T], l [B,K,J,T], acc [B,K,J,T,D]) fp32;
    s fp32 [B,K,J,T,Z]; vis bool broadcastable to s; v [B,Z,K,D]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, _NEG), axis=-1))
    # masked scores contribute exactly 0, also while nothing is visible yet (m_new = _NEG)
    p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("bkjtz,bzkd->bkjtd", p.astype(v.dtype), v,
                                             preferred_element_type=_F32)
    return m_new, l, acc


def live_block_count(cache_len, num_slots: int, block: int = BLOCK):
    """int32[]: cache blocks holding any committed slot of any row (the loop's trip count)."""
    Z = min(block, num_slots)
    return (jnp.max(cache_len).astype(jnp.int32) + Z - 1) // Z


def blockwise_attention(q, k_new, v_new, positions, mask, cache_k, cache_v, cache_len, layer,
                        window, live_blocks=None, block: int = BLOCK, scale=None, softcap=None):
    """Online softmax over the live cache blocks, then the new tokens (same I/O as dense).

    live_blocks: int32[] trip count (computed once per forward by the caller; recomputed from
    cache_len when None). Blocks past it are never read, nor, with a sliding window, blocks
    wholly below every new token's window (`first_window_block`).
    """
    if cache_k is None:
        return dense_attention(q, k_new, v_new, positions, mask, None, None, cache_len, layer,
                               window, scale=scale, softcap=softcap)
    B, T, H, D = q.shape
    K = k_new.shape[2]
    J = H // K
    S = cache_k.shape[2]
    Z = min(block, S)
    assert S % Z == 0, f"cache slots ({S}) must be a multiple of the block ({Z})"
    qg = q.reshape(B, T, K, J, D)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if live_blocks is None:
        live_blocks = live_block_count(cache_len, S, block)
    live_blocks = jnp.minimum(live_blocks, S // Z)

    def body(i, carry):
        start = i * Z
        idx = (layer, 0, start, 0, 0)  # rows [0, B) of a cache that may hold more
        kb = jax.lax.dynamic_slice(cache_k, idx, (1, B, Z, K, D))[0]
        vb = jax.lax.dynamic_slice(cache_v, idx, (1, B, Z, K, D))[0]
        vis = _cache_visibility(positions, cache_len, start + jnp.arange(Z), window)
        return online_update(carry, _scores(qg, kb, scale, softcap), vis[:, None, None], vb)

    init = (jnp.full((B, K, J, T), _NEG, _F32), jnp.zeros((B, K, J, T), _F32),
            jnp.zeros((B, K, J, T, D), _F32))
    first = jnp.minimum(first_window_block(positions, window, Z), live_blocks)
    carry = jax.lax.fori_loop(first, live_blocks, body, init)
    vis_new = _new_token_visibility(positions, mask, window)[:, None, None]
    _, l, acc = online_update(carry, _scores(qg, k_new, scale, softcap), vis_new, v_new)
    out = acc / l[..., None]  # l > 0: every new token sees itself
    return jnp.einsum("bkjtd->btkjd", out).reshape(B, T, H, D).astype(q.dtype)


KERNELS: dict[str, Callable] = {"blockwise": blockwise_attention, "dense": dense_attention}
# backend -> kernel name; a backend not listed gets "blockwise". An accelerator kernel goes here
# (e.g. "gpu": "cudnn") once it is registered in KERNELS and tested against "dense".
# GPU: "dense". A `while` loop on a GPU sends its predicate to the host every iteration, so the
# blockwise loop costs a round trip per cache block per layer. Measured on an H200 (bf16, random
# weights, 512 cached tokens, experiments/device/variants.py, docs/bench/device-h200): one
# forward of a Llama-3.1-8B / 3.2-1B / Qwen2.5-0.5B shape, stacked layers, 16.5 / 4.3 / 4.6 ms
# blockwise, 12.5 / 2.5 / 2.0 ms dense; packed layers 8.4 / 3.3 / 3.7 ms blockwise, 5.5 / 1.6 /
# 1.3 dense.
# Dense reads every padded slot, which the GPU's bandwidth makes cheap next to a round trip.
BY_BACKEND: dict[str, str] = {"gpu": "dense"}
_override: Optional[str] = None


def set_kernel(name: Optional[str]) -> None:
    """Forces a kernel by name (None: back to the per-backend choice). Read at trace time."""
    global _override
    if name is not None and name not in KERNELS:
        raise ValueError(f"attention kernel must be one of {sorted(KERNELS)}, got {name!r}")
    _override = name


def kernel_for_backend(backend: Optional[str] = None) -> Callable:
    """The attention kernel for a backend ("cpu", "gpu", "tpu"; default: jax's default).

    A GPU gets `dense`, every other backend `blockwise` (`BY_BACKEND`)."""
    if _override is not None:
        return KERNELS[_override]
    return KERNELS[BY_BACKEND.get(backend or jax.default_backend(), "blockwise")]
