"""Weights kept quantized: `QuantArray`, a linear layer's integer codes with their scales, and
`linear`, the one matmul every linear layer of the forward goes through (plain or quantized).

A linear weight in our layout is [in dims..., out dims...] (`params.Leaf`: wq [E,H,D], wo
[H,D,E], w_down [F,E], lm_head [E,V]), stacked on a leading L (and Y for experts) axis. Its
quantized form groups the flattened input side I = prod(in dims) into `ng` groups of G
consecutive inputs (per-channel: one group, G = I) and keeps

    codes  [lead..., ng, G, out dims...]  int8 (8-bit and GGUF Q6_K's 6-bit codes),
                                           int4 (4-bit) or uint4 (GGUF Q4_K's 0..15)
    scale  [lead..., ng, out dims...]     float32
    offset [lead..., ng, out dims...]     float32 or None (GGUF Q4_K's per-group minimum)

standing for w[..., g*G + j, o] = codes[..., g, j, o] * scale[..., g, o] - offset[..., g, o],
computed in float32. That is exactly how `gguf` dequantizes Q8_0, Q4_0, Q4_K and Q6_K blocks
(`d * q`, `(d * sc) * q - dmin * m`, scales formed in float32 from the file's f16 d and integer
sub-scales), so a GGUF block's codes and scales are kept as they are and dequantize bit for bit
(tests/test_quant.py). Groups run along the input (contraction) side, as GGUF's blocks do.

The matmul (`linear`): x [..., I] viewed as [N, ng, G] against the codes converted to x's
dtype (exact: |code| <= 127 fits bf16's mantissa), one `dot_general` with the groups as a batch
axis and float32 accumulation (`preferred_element_type`), then the scales (and offsets) applied
per group in float32 and the groups summed: [ng, N, O] -> [N, O]. On GPU and TPU XLA fuses the
convert into the dot, so the weights are read from memory as codes; XLA:CPU does not (a
1536x8960 int8 matvec: 44 ms against 3.0 ms in fp32, issue 56), so on a CPU the default stays
dequantized float and `quantize=` is for memory only.

Why our own container and not qwix's `QArray` (0.1.8, the same design: codes, generic-broadcast
scales, `dot_general(x, w_int, preferred_element_type=f32)` with tiles as a batch axis): qwix
represents w as `(q - zero_point) * scale`, which cannot hold Q4_K's `scale * q - min` bit for
bit (a zero point of min / scale rounds), its QArray is a flax struct whose static shape does not
follow a `lax.scan` slice of the stacked layers axis the way a params leaf must, and this
module is the ~350 lines we need with no runtime dependency. Measured side by side on a
1536x8960 layer (experiments/quant_matmul.py, docs/quantization.md): on this CPU both pay the
unfused convert (44-72x float32 at T = 1), qwix's dequantize-first order 10-25% less than our
grouped product; `set_matmul("dequantize")` gives that order here too, and the device script
times both on a GPU, where the choice is made.

What stays float: the embedding table (a lookup reads B*T rows, not the table, so its bytes cost
memory but no bandwidth per token; a tied model's LM head reads it too), the MoE router (small,
and its top-k is where rounding would move a route), norms and biases.
Letters as in the package glossary.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from . import few_rows

# the quantize= choices: code width in bits
BITS = {"int8": 8, "int4": 4}
# a draft's extra choice: int8 weights, and on a CPU with AVX512-VNNI the activations quantized
# to int8 too (`k4_codes`, `few_rows.q8_matmul`): close to the model, not equal to it, so for
# drafts only (a draft's rounding moves acceptance, never an output)
W8A8 = "w8a8"
# int4's default group along the input side (128: 4.25 bits per weight with f32 scales); a
# leaf whose input side it does not divide is quantized per channel. int8 is per channel.
INT4_GROUP = 128
_CODE_DTYPE = {8: jnp.int8, 4: jnp.int4}
# how `linear` multiplies a QuantArray (read at trace time): "grouped" (the codes into one
# dot_general, groups as a batch axis, scales on the product) or "dequantize" (the weight
# dequantized to x's dtype, then a plain matmul: qwix's choice for a float activation, left
# to XLA to fuse). The device script times both (experiments/device/quantized.py).
MATMULS = ("grouped", "dequantize")
_matmul = ["grouped"]


def set_matmul(mode: str) -> None:
    """Chooses `linear`'s product for quantized weights in later traces (A/B benchmarks)."""
    if mode not in MATMULS:
        raise ValueError(f"set_matmul: mode must be one of {MATMULS}, got {mode!r}")
    _matmul[0] = mode


@jax.tree_util.register_pytree_node_class
class QuantArray:
    """A quantized linear weight standing for a float array of `shape` and `dtype` (see the
    module docstring for the layout). Children (codes, scale, offset) carry the lead axes, so
    `lax.scan` over the stacked layers slices them as it slices any params leaf; the static
    part is the input side's shape, how many trailing dims are the output side, the code width
    and the float dtype the weight stands for (its matmul's output dtype)."""

    def __init__(self, codes, scale, offset, in_shape: tuple, out_ndim: int, bits: int, dtype,
                 k4: bool = False):
        self.codes, self.scale, self.offset = codes, scale, offset
        self.in_shape, self.out_ndim, self.bits = tuple(in_shape), int(out_ndim), int(bits)
        self.dtype = jnp.dtype(dtype)
        # the draft's form (`k4_codes`): uint8 codes + 128, four inputs side by side per column
        self.k4 = bool(k4)

    def tree_flatten(self):
        return ((self.codes, self.scale, self.offset),
                (self.in_shape, self.out_ndim, self.bits, self.dtype.name, self.k4))

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    # ------------------------------------------------------------------ array-like
    @property
    def lead_ndim(self) -> int:
        return len(self.codes.shape) - 2 - self.out_ndim

    @property
    def out_shape(self) -> tuple:
        return tuple(self.codes.shape[len(self.codes.shape) - self.out_ndim:])

    @property
    def shape(self) -> tuple:
        """The float array's shape: lead dims, input dims, output dims."""
        return tuple(self.codes.shape[:self.lead_ndim]) + self.in_shape + self.out_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def group_size(self) -> int:
        return int(self.codes.shape[self.lead_ndim + 1])

    @property
    def nbytes(self) -> int:
        """Bytes on an accelerator: codes at `bits` per value packed (4-bit codes two to a
        byte, as XLA stores int4 on GPU and TPU; 6-bit codes in int8), plus scales, offsets."""
        code_bits = 4 if self.bits == 4 else 8
        extra = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                    for a in (self.scale, self.offset) if a is not None)
        return math.prod(self.codes.shape) * code_bits // 8 + extra

    def __getitem__(self, i) -> "QuantArray":
        """Row i of the first lead axis (a layer of a stacked leaf)."""
        assert self.lead_ndim >= 1, "index a stacked (lead-axis) QuantArray only"
        return _map(lambda a: a[i], self)

    def reshape(self, *shape) -> "QuantArray":
        """A new view of the input and output dims (no lead axis): the first dims whose
        product is I become the input side, the rest the output side (wo [H,D,E] ->
        [H*D, E], wq [E,H,D] -> [E, H*D])."""
        assert self.lead_ndim == 0, "reshape a per-layer QuantArray only"
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        total = self.size
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(total // known if s == -1 else s for s in shape)
        I = math.prod(self.in_shape)
        for k in range(1, len(shape) + 1):
            if math.prod(shape[:k]) == I:
                break
        else:
            raise ValueError(f"QuantArray.reshape: {shape} keeps no input side of {I}")
        out = shape[k:]
        if math.prod(out) != total // I:
            raise ValueError(f"QuantArray.reshape: {shape} does not match {self.shape}")
        ng, G = self.codes.shape[:2]
        return QuantArray(self.codes.reshape(ng, G, *out), self.scale.reshape(ng, *out),
                          None if self.offset is None else self.offset.reshape(ng, *out),
                          shape[:k], len(out), self.bits, self.dtype, self.k4)

    def __repr__(self):
        return (f"QuantArray(shape={self.shape}, bits={self.bits}, group={self.group_size}, "
                f"dtype={self.dtype.name}{', offset' if self.offset is not None else ''}"
                f"{', k4' if self.k4 else ''})")


def _map(fn, q: QuantArray) -> QuantArray:
    """fn applied to codes, scale and offset (each with the lead axes first)."""
    return QuantArray(fn(q.codes), fn(q.scale), None if q.offset is None else fn(q.offset),
                      q.in_shape, q.out_ndim, q.bits, q.dtype, q.k4)


def is_quantized(w) -> bool:
    return isinstance(w, QuantArray)


# ------------------------------------------------------------------------------ quantizing
def group_for(in_size: int, bits: int, group_size: Optional[int] = None) -> int:
    """The group length G along an input side of in_size: group_size (or int4's INT4_GROUP)
    when it divides in_size, else in_size (per channel); int8 is per channel unless asked."""
    g = group_size if group_size is not None else (INT4_GROUP if bits == 4 else None)
    return g if g is not None and in_size % g == 0 else in_size


def quantize(w, in_dims: int, bits: int, lead: int = 0,
             group_size: Optional[int] = None) -> QuantArray:
    """Symmetric absmax quantization of a float weight w [lead..., in..., out...] (lead dims,
    then `in_dims` input dims): per group of G inputs and output channel, scale = max|w| /
    (2^(bits-1) - 1), codes = round(w / scale). Jittable; scales in float32."""
    if bits not in _CODE_DTYPE:
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits!r}")
    shape = tuple(w.shape)
    lead_shape, in_shape = shape[:lead], shape[lead:lead + in_dims]
    out_shape = shape[lead + in_dims:]
    I = math.prod(in_shape)
    G = group_for(I, bits, group_size)
    wf = jnp.asarray(w, jnp.float32).reshape(*lead_shape, I // G, G, *out_shape)
    qmax = 2 ** (bits - 1) - 1
    amax = jnp.max(jnp.abs(wf), axis=lead + 1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    codes = jnp.clip(jnp.round(wf / jnp.expand_dims(scale, lead + 1)), -qmax - 1, qmax)
    return QuantArray(codes.astype(_CODE_DTYPE[bits]), scale, None, in_shape, len(out_shape),
                      bits, w.dtype)


def dequantize(w) -> jax.Array:
    """A QuantArray -> the float array it stands for (codes * scale - offset in float32, cast
    to its dtype); a plain array as it is."""
    if not is_quantized(w):
        return w
    g = w.lead_ndim + 1  # the group-length axis of the codes
    codes = plain_codes(w) if w.k4 else w.codes
    v = codes.astype(jnp.float32) * jnp.expand_dims(w.scale, g)
    if w.offset is not None:
        v = v - jnp.expand_dims(w.offset, g)
    return v.reshape(w.shape).astype(w.dtype)


def dense(w) -> jax.Array:
    """The float weight for an op that has no quantized form (the experts' ragged dot, the
    one-hot MoE reference): `dequantize`, inside the jitted program."""
    return dequantize(w)


def take(w, idx, axis: int = 0):
    """jnp.take(w, idx, axis, mode="fill", fill_value=0) on a plain array or on a QuantArray's
    lead axis (gathering routed experts' codes and scales before they are dequantized)."""
    fn = lambda a: jnp.take(a, idx, axis=axis, mode="fill", fill_value=0)  # noqa: E731
    return _map(fn, w) if is_quantized(w) else fn(w)


def concat_out(ws: Sequence) -> jax.Array:
    """Per-layer weights [I, O_k] with one input side joined along their output side -> [I,
    sum O_k] (the packed layout's fused q/k/v and gate/up). Quantized ones must share their
    grouping and codes dtype (as they do when quantized alike, or kept from GGUF blocks of one
    form: Q8_0 beside Q5_0)."""
    if not any(is_quantized(w) for w in ws):
        return jnp.concatenate(ws, -1)
    if not all(is_quantized(w) and w.out_ndim == 1 and w.lead_ndim == 0 and not w.k4
               for w in ws) or \
            len({(w.codes.shape[:2], w.codes.dtype, w.offset is None) for w in ws}) != 1:
        raise ValueError("concat_out: quantized weights of one grouping and code width only")
    q0 = ws[0]
    cat = lambda name: jnp.concatenate([getattr(w, name) for w in ws], -1)  # noqa: E731
    return QuantArray(jnp.concatenate([w.codes.astype(q0.codes.dtype) for w in ws], -1),
                      cat("scale"), None if q0.offset is None else cat("offset"),
                      q0.in_shape, 1, max(w.bits for w in ws), q0.dtype)


# ------------------------------------------------------------------------------ the matmul
def linear(x: jax.Array, w, in_dims: int = 1, out_dtype=None) -> jax.Array:
    """x [..., I] times a weight [in dims..., out dims...] (prod(in dims) = I) -> [..., out
    dims...] in out_dtype (default x's dtype). A plain w is one matmul over its [I, O] view
    (with float32 accumulation when out_dtype is given, the LM head); a QuantArray is the
    grouped integer product of the module docstring."""
    if isinstance(w, few_rows.LayerOf):  # a layer of a stack, read in place (a scanned forward)
        y = few_rows.matmul_at(x, w).astype(out_dtype or x.dtype)
        return y.reshape(*x.shape[:-1], *w.shape[in_dims:])
    if not is_quantized(w):
        in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
        w2 = w.reshape(math.prod(in_shape), math.prod(out_shape))
        if few_rows.applies(x, w2):  # a verification-sized product on a CPU (few_rows.py)
            y = few_rows.matmul(x, w2).astype(out_dtype or x.dtype)
        elif out_dtype is None:
            y = x @ w2
        else:
            y = jnp.einsum("...i,io->...o", x, w2, preferred_element_type=out_dtype)
        return y.reshape(*x.shape[:-1], *out_shape)
    assert w.lead_ndim == 0, "linear takes one layer's weight"
    if w.k4 and few_rows.q8_applies(x, w):  # the draft's form (`k4_codes`)
        y = few_rows.q8_matmul(x, w).astype(out_dtype or x.dtype)
        return y.reshape(*x.shape[:-1], *w.out_shape)
    if few_rows.quant_applies(x, w):  # a CPU's decode or verification product
        y = few_rows.quant_matmul(x, w).astype(out_dtype or x.dtype)
        return y.reshape(*x.shape[:-1], *w.out_shape)
    # a CPU's product of more rows than the kernel takes (a long prefill): dequantized, then
    # XLA's float product (32 rows of a 1536 x 8960 stack: 150 ms against the grouped
    # product's 200 ms; 150 rows: 233 ms, the kernel's 8-row blocks 278, float32 147)
    if _matmul[0] == "dequantize" or few_rows.enabled() or w.k4:
        wd = QuantArray(w.codes, w.scale, w.offset, w.in_shape, w.out_ndim, w.bits, x.dtype,
                        w.k4)
        return linear(x, dequantize(wd), len(w.in_shape), out_dtype)
    lead, out_shape = x.shape[:-1], w.out_shape
    ng, G = w.codes.shape[:2]
    O = math.prod(out_shape)
    N = math.prod(lead)
    xg = x.reshape(N, ng, G)
    codes = w.codes.reshape(ng, G, O).astype(x.dtype)  # fused into the dot on GPU/TPU
    y = jax.lax.dot_general(xg, codes, (((2,), (1,)), ((1,), (0,))),
                            preferred_element_type=jnp.float32)  # [ng, N, O]
    y = jnp.sum(y * w.scale.reshape(ng, 1, O), axis=0)
    if w.offset is not None:  # sum_j x_j (s q_j - m) = s (x . q) - m sum_j x_j, per group
        xs = jnp.sum(xg.astype(jnp.float32), axis=-1)  # [N, ng]
        y = y - xs @ w.offset.reshape(ng, O)
    return y.astype(out_dtype or x.dtype).reshape(*lead, *out_shape)


# ------------------------------------------------------------------------------ params
def quantizable(leaf) -> bool:
    """Which params leaves are quantized (`params.Leaf`): every linear weight but the MoE
    router; the embedding, norms and biases stay float (see the module docstring)."""
    return leaf.hf_layout == "linear" and leaf.name != "router"


def quantize_params(params: dict, config, scheme: str,
                    group_size: Optional[int] = None, one_leaf=None) -> dict:
    """Canonical (stacked) params with every `quantizable` leaf quantized to `quantize`
    ("int8" or "int4"); leaves already quantized (kept from a GGUF's blocks) stay as they
    are. Jittable (abstract params give abstract QuantArrays, `jax.eval_shape`). one_leaf:
    None (`quantize`), or (w, in_dims, lead) -> the quantized leaf (`_draft_form_leaf`)."""
    from .params import LEAF_BY_NAME

    bits = bits_of(scheme)

    def one(name, w):
        leaf = LEAF_BY_NAME[name]
        if is_quantized(w) or not quantizable(leaf):
            return w
        lead = leaf.per_layer + leaf.per_expert
        if one_leaf is not None:
            return one_leaf(w, leaf.hf_in_dims, lead)
        return quantize(w, leaf.hf_in_dims, bits, lead, group_size)

    out = {k: one(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = {k: one(k, v) for k, v in params["layers"].items()}
    return out


def quantize_loaded(params: dict, config, scheme: str) -> dict:
    """`quantize_params` for `load_model(quantize=)`. On a CPU where the few-row kernel runs
    (`few_rows.enabled`), every codes array becomes int8 (4-bit codes included: the kernel
    reads a byte per code, as XLA:CPU stores int4 anyway), so decode and verification products
    read the codes directly; elsewhere on a CPU it says once that quantized weights run slower
    there (XLA:CPU does not fuse the convert into the dot: for memory, not speed)."""
    from ..notices import say_once

    if scheme == W8A8 and jax.default_backend() == "cpu" and few_rows.q8_enabled():
        params = quantize_params(params, config, scheme, one_leaf=_draft_form_leaf)
        return k4_codes(int8_codes(params))  # the leaves kept from the file's blocks
    params = quantize_params(params, config, scheme)
    if jax.default_backend() == "cpu":
        if few_rows.enabled():
            return int8_codes(params)
        say_once("quantize-cpu", f"quantize={scheme!r} on cpu keeps the weights' memory small "
                 "but runs slower than float32 here (XLA:CPU does not fuse the int8 convert "
                 "into the dot, and this CPU or process runs no few-row kernel); leave "
                 "quantize=None for speed")
    return params


def int8_codes(params):
    """A params pytree with every QuantArray's codes as int8 (values unchanged: 4-bit codes
    fit), the form `few_rows.quant_matmul` reads."""
    def one(w):
        if not is_quantized(w) or w.codes.dtype == jnp.int8 or w.k4:
            return w
        codes = jnp.asarray(w.codes).astype(jnp.int8)
        return QuantArray(codes, w.scale, w.offset, w.in_shape, w.out_ndim, w.bits, w.dtype)

    return jax.tree.map(one, params, is_leaf=is_quantized)


def plain_codes(w: QuantArray) -> jax.Array:
    """A k4 QuantArray's codes in the plain layout [lead..., ng, G, out...] as int8 (the
    inverse of `k4_codes`); jittable."""
    lead, (ng, G) = w.codes.shape[:w.lead_ndim], w.codes.shape[w.lead_ndim:w.lead_ndim + 2]
    O = math.prod(w.out_shape)
    c = w.codes.reshape(*lead, ng, G // 4, O, 4)
    c = jnp.swapaxes(c, -1, -2).reshape(w.codes.shape)
    return (c.astype(jnp.int16) - 128).astype(jnp.int8)


def k4_codes(params):
    """A params pytree with every int8-coded QuantArray whose group length is a multiple of 4
    in the draft's form (`k4`, read by `few_rows.q8_matmul`: the activations quantized to
    int8 per row and block of 32 inputs, integer dot products): its codes as uint8 code + 128,
    in the memory order [lead..., ng, G / 4, O, 4] (four consecutive inputs of a column side by
    side, as AVX512-VNNI's dot product of four byte pairs reads them), kept in the plain
    shape [lead..., ng, G, out...] so that lead slices and output reshapes keep their meaning
    (`_k4_of`, one program per leaf)."""
    def one(w):
        if not is_quantized(w) or w.k4 or w.codes.dtype != jnp.int8 or w.group_size % 4:
            return w
        return _k4_of(w)

    return jax.tree.map(one, params, is_leaf=is_quantized)


@jax.jit
def _k4_of(w: QuantArray) -> QuantArray:
    """An int8-coded QuantArray (group length a multiple of 4) in the k4 form (`k4_codes`)."""
    c = w.codes
    lead, (ng, G) = c.shape[:w.lead_ndim], c.shape[w.lead_ndim:w.lead_ndim + 2]
    O = math.prod(w.out_shape)
    u = jax.lax.bitcast_convert_type(c, jnp.uint8) ^ jnp.uint8(0x80)  # code + 128
    u = jnp.swapaxes(u.reshape(*lead, ng, G // 4, 4, O), -1, -2).reshape(c.shape)
    return QuantArray(u, w.scale, w.offset, w.in_shape, w.out_ndim, w.bits, w.dtype, k4=True)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draft_form_leaf(w: jax.Array, in_dims: int, lead: int) -> QuantArray:
    """`quantize(w, in_dims, 8, lead)` in the draft's form (`k4_codes`, where the group length
    is a multiple of 4; int8 codes otherwise) as one program per leaf: the real 0.5B draft's
    eager quantize, int8 and k4 passes (a fresh buffer each) took 1.9 s over its float load,
    most of it the first touch of their pages (issue 53's second process). The same codes."""
    q = quantize(w, in_dims, 8, lead)
    return q if q.group_size % 4 else _k4_of(q)


def quantize_model(model, scheme: Optional[str]):
    """A `Model` with its params quantized (`quantize_loaded`); the model itself for None."""
    if scheme is None:
        return model
    import dataclasses

    return dataclasses.replace(model, params=quantize_loaded(model.params, model.config,
                                                              scheme))


DRAFT_CHOICES = ("auto", "off", "int8", "int4", W8A8)
# a draft whose weights take less than this (the demo pair's 3M-parameter draft) sits in a
# CPU's caches, where its float products are not bound by memory and a custom call's fixed
# cost would be all that changed: "auto" leaves it float
SMALL_DRAFT_BYTES = 64 << 20


def draft_scheme(choice: str, quantize: Optional[str], dtype, model=None) -> Optional[str]:
    """How a draft model is loaded (the CLI's --draft-quantize): "off" as the target
    (`quantize`), "int8"/"int4"/"w8a8" so, "auto" where the few-row kernel runs (a CPU,
    float32: `few_rows.enabled`) "w8a8" on a CPU with AVX512-VNNI (`few_rows.q8_enabled`)
    else "int8", and `quantize` otherwise. Why a draft may differ from its target: the draft
    only proposes, so its rounding changes acceptance, never an output (greedy tokens stay the
    target's, sampling stays lossless for any draft distribution). The real pair's 0.5B
    draft, one-token forward (`models.timing.forward_timer`, AMD Zen 5): float32 45 ms, int8
    weights read by the kernel 36 ms, w8a8 (activations quantized too, integer dot products)
    22 ms, with the same acceptance on the real pair's chat prompts; it holds 0.6 GB of layer
    weights instead of 2.0. model: the loaded draft where it is known before quantizing (the
    demo pair): one under SMALL_DRAFT_BYTES stays float under "auto"."""
    if choice not in DRAFT_CHOICES:
        raise ValueError(f"draft quantize must be one of {DRAFT_CHOICES}, got {choice!r}")
    if choice == "off":
        return quantize
    if choice != "auto":
        return choice
    small = model is not None and params_nbytes(model.params) < SMALL_DRAFT_BYTES
    if quantize is None and jnp.dtype(dtype) == jnp.float32 and not small and \
            few_rows.enabled():
        return W8A8 if few_rows.q8_enabled() else "int8"
    return quantize


def bits_of(quantize: str) -> int:
    """"int8" -> 8, "int4" -> 4, "w8a8" (drafts) -> 8; ValueError naming the parameter
    otherwise."""
    if quantize == W8A8:
        return 8
    if quantize not in BITS:
        raise ValueError(f"quantize must be one of {sorted(BITS)} (or {W8A8!r} for a draft) "
                         f"or None, got {quantize!r}")
    return BITS[quantize]


def params_nbytes(params) -> int:
    """Bytes of a params pytree on an accelerator: quantized leaves by `QuantArray.nbytes`
    (4-bit codes two to a byte), the rest by their dtype."""
    return int(sum(x.nbytes if is_quantized(x) else x.size * x.dtype.itemsize
                   for x in jax.tree.leaves(params, is_leaf=is_quantized)))


def is_quantized_params(params: dict) -> bool:
    """Whether any leaf of a params pytree (either layout) is quantized."""
    return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def storage_axes(w: QuantArray, axes: tuple) -> tuple:
    """Logical axes of (codes, scale) for a weight whose float form has logical `axes`
    (`params.Leaf.axes`): the group axis takes the first input axis's name (groups split
    where the input side does: groups never straddle a split of a divisible input side), the
    group-length axis the same name, so that it splits where the groups cannot (one group per
    channel: int8's) and the input side stays split (`sharding.spec_for` gives a mesh axis to
    the first dimension it divides, once)."""
    lead = tuple(axes[:w.lead_ndim])
    first_in = axes[w.lead_ndim]
    out = tuple(axes[w.lead_ndim + len(w.in_shape):])
    return lead + (first_in, first_in) + out, lead + (first_in,) + out

