"""GGUF blocks kept quantized: Q8_0, Q5_0, Q4_0, Q4_K and Q6_K tensors read into `quant.QuantArray`
codes and scales as they are stored, instead of dequantized (`load_model(..., quantize=)`).

Each block type's values are `codes * scale (- offset)` over groups of consecutive values along
a row (the input side of a linear weight, which is where our groups run, `quant.py`):

    Q8_0  blocks of 32: f16 d, 32 int8 q                  -> int8 codes, scale d           (G 32)
    Q5_0  blocks of 32: f16 d, 32 high bits, 32 nibbles   -> int8 codes q - 16, scale d    (G 32)
    Q4_0  blocks of 32: f16 d, 32 nibbles n               -> int4 codes n - 8, scale d     (G 32)
    Q4_K  super-blocks of 256: f16 d, dmin, 8 six-bit (sc, m) pairs, 256 nibbles q
                                                          -> uint4 codes q, scale d * sc,
                                                             offset dmin * m               (G 32)
    Q6_K  super-blocks of 256: 16 int8 sc, f16 d, 256 six-bit q (-32)
                                                          -> int8 codes q - 32, scale d * sc (G 16)

The scales are formed in float32 exactly as `gguf.quants` forms them (f16 -> f32, then the
sub-block product), so `quant.dequantize` gives `gguf.dequantize`'s bits (tests/test_quant.py).
Q4_K's super-block structure is represented faithfully (per-32 scale and min, each the f32
product the file implies), not requantized; the cost is f32 scale and offset per 32 values
(2 bits per weight over the file's 0.5), traded for bit-exactness.

Which blocks are kept: a leaf (all its layers) whose tensors are all of one kept form (code
dtype, group length, offset or not) whose code width fits the asked width (Q4_0/Q4_K under
"int4" or "int8"; Q8_0/Q5_0/Q6_K under "int8"). Q8_0 and Q5_0 share a form (int8 codes, one
f32 scale per 32), so a leaf mixing them across layers, as llama.cpp's Q4_0 files of Qwen2.5
0.5B do for attn_v, is kept too. Any other leaf (another type, a mix of forms across layers as
llama.cpp's Q4_K_M mixes Q4_K and Q6_K, a fused Phi-3 tensor) is dequantized as usual and
quantized by `quant.quantize`.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .quant import QuantArray, bits_of, quantizable

# kept type -> (code width in bits, group length)
KEPT = {"Q8_0": (8, 32), "Q5_0": (5, 32), "Q4_0": (4, 32), "Q4_K": (4, 32), "Q6_K": (6, 16)}
# kept type -> its form: (codes dtype name, group length, offset or not); one form per leaf
FORM = {"Q8_0": ("int8", 32, False), "Q5_0": ("int8", 32, False), "Q4_0": ("int4", 32, False),
        "Q4_K": ("uint4", 32, True), "Q6_K": ("int8", 16, False)}


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32 (little-endian f16 bytes, as gguf reads them)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[n, bytes] uint8 -> [n, 2 * bytes] uint8 values: each run of `run` bytes gives its low
    nibbles, then its high nibbles (gguf's Q4_0 / Q4_K order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q4k_scale_min(scales: np.ndarray):
    """Q4_K's 12 packed bytes -> (sc, m) uint8 [n, 8] each, as `gguf.quants.Q4_K`."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def decode_blocks(blocks: np.ndarray, kind: str):
    """blocks uint8 [n, type size] of one kept type -> (codes [n, g, G] (int8, or uint8 values
    0..15 for Q4_K), scale float32 [n, g], offset float32 [n, g] or None), g groups of G per
    block: value = codes * scale - offset, in float32."""
    n = blocks.shape[0]
    if kind == "Q8_0":
        return blocks[:, 2:].view(np.int8).reshape(n, 1, 32), _f16(blocks[:, :2]), None
    if kind == "Q5_0":
        high = blocks[:, 2:6].copy().view(np.uint32)  # bit i: the fifth bit of value i
        high = (high >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
        q = (_nibbles(blocks[:, 6:], 16) | (high.astype(np.uint8) << np.uint8(4)))
        return (q.astype(np.int8) - np.int8(16)).reshape(n, 1, 32), _f16(blocks[:, :2]), None
    if kind == "Q4_0":
        q = _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)
        return q.reshape(n, 1, 32), _f16(blocks[:, :2]), None
    if kind == "Q4_K":
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = _q4k_scale_min(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)
        return q, d * sc.astype(np.float32), dmin * m.astype(np.float32)
    if kind == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        lo = _nibbles(ql, 64).reshape(n, -1, 32)
        hi = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        hi = (hi & np.uint8(0x03)).reshape(n, -1, 32)
        q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
        return q.reshape(n, 16, 16), d * sc, None
    raise ValueError(f"decode_blocks: {kind} blocks are not kept quantized (kept: "
                     f"{sorted(KEPT)})")


def decode_tensor(data: np.ndarray, kind: str):
    """A tensor's raw data uint8 [..., rows, row bytes] -> (codes [..., rows, ng, G], scale
    [..., rows, ng], offset or None) over its whole rows (ng groups of G per row)."""
    from gguf import GGML_QUANT_SIZES

    from gguf import GGMLQuantizationType as T

    _, size = GGML_QUANT_SIZES[T[kind]]
    lead = data.shape[:-1]
    codes, scale, offset = decode_blocks(np.ascontiguousarray(data).reshape(-1, size), kind)
    G = codes.shape[-1]
    codes = codes.reshape(*lead, -1, G)
    scale = scale.reshape(*lead, -1)
    return codes, scale, None if offset is None else offset.reshape(*lead, -1)


def keepable(leaf, tensors: list, bits: int) -> Optional[str]:
    """A kept type of a leaf's tensors (all of one form) when they may be kept under `bits`
    (see the module docstring), else None."""
    if not quantizable(leaf) or any(isinstance(t, np.ndarray) for t in tensors):
        return None  # not a linear weight, or a part split off a fused tensor (dequantized)
    kinds = {t.tensor_type.name for t in tensors}
    if not kinds <= set(KEPT) or len({FORM[k] for k in kinds}) != 1:
        return None
    if max(KEPT[k][0] for k in kinds) > bits:
        return None
    return min(kinds)  # the forms agree: any of them names the leaf's codes


def kept_leaf(leaf, config, tensors: dict, scheme: str, dtype,
              rows_fn: Callable[[str], Optional[Callable]]) -> Optional[QuantArray]:
    """The leaf as a QuantArray of its tensors' own codes and scales, or None when they are
    not kept (`keepable`). tensors: {layer or None: reader tensor}; rows_fn(name): the row
    transform undoing the converter's q/k permutation for that tensor (or None), applied to
    codes and scales alike (a permutation of output rows)."""
    import jax.numpy as jnp

    kind = keepable(leaf, list(tensors.values()), bits_of(scheme))
    if kind is None:
        return None
    shape = leaf.slice_shape(config)
    in_shape, out_shape = shape[:leaf.hf_in_dims], shape[leaf.hf_in_dims:]
    codes, scales, offsets = [], [], []
    for t in tensors.values():
        c, s, o = decode_tensor(t.data, t.tensor_type.name)  # [(Y,) O, ng, G], [(Y,) O, ng]
        fn = rows_fn(t.name)
        if fn is not None:  # output rows permuted: the same permutation of every part
            c, s = fn(c), fn(s)
            o = None if o is None else fn(o)
        # [(Y,) O, ng, G] -> [(Y,) ng, G, out...]: groups first, output dims last
        codes.append(np.moveaxis(c, -3, -1).reshape(*c.shape[:-3], *c.shape[-2:], *out_shape))
        scales.append(np.moveaxis(s, -2, -1).reshape(*s.shape[:-2], s.shape[-1], *out_shape))
        if o is not None:
            offsets.append(np.moveaxis(o, -2, -1).reshape(*o.shape[:-2], o.shape[-1],
                                                          *out_shape))
    stack = (lambda xs: np.stack(xs)) if leaf.per_layer else (lambda xs: xs[0])
    code_dtype = jnp.dtype(FORM[kind][0])
    return QuantArray(jnp.asarray(stack(codes).astype(code_dtype)),
                      jnp.asarray(stack(scales)),
                      jnp.asarray(stack(offsets)) if offsets else None,
                      in_shape, len(out_shape), KEPT[kind][0], dtype)


def keeper(config, scheme: Optional[str], dtype):
    """`gguf.load_gguf_params`'s keep hook for `load_model(quantize=scheme)`: each leaf as its
    kept blocks or None (None: no hook, for float loading)."""
    if scheme is None:
        return None

    def keep(leaf, tensors, rows_fn):
        return kept_leaf(leaf, config, tensors, scheme, dtype, rows_fn)

    return keep
