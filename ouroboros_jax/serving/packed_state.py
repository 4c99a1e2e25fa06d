"""The engine's device state with its small leaves packed into one array, so a device call
takes and returns a few arrays instead of dozens.

Why: a jitted call's host cost grows with its argument and output leaves (each is checked,
donated and wrapped as an array), and on a busy host that cost is paid while the device
computes. The engine's state has about 30 leaves, of which two dozen are per-slot vectors and
scalars (lengths, knobs, counters) of a few hundred bytes in all; packed, a step's dispatch
took 0.31 ms of host time instead of 0.49 at 16 busy slots (`experiments/engine_host.py`).

`Packed` is a pytree whose leaves are the large arrays, as they are, and one int32 vector
holding every small leaf (bool, int32, uint32 and float32 leaves of fewer than
`SMALL_ELEMENTS` elements, bit-cast; not empty ones: XLA:CPU aborted compiling a slice of
zero elements out of the packed vector); its static layout (the state's tree and each leaf's
shape and dtype) is kept in a registry and named by an integer, so comparing two calls'
layouts is one integer compare. `pack` and `unpack` are pure and traceable: the device calls
unpack at their start and pack at their end, inside the one compiled program.

Single device only: on a mesh each leaf keeps its own placement, so the state stays unpacked.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

SMALL_ELEMENTS = 4096  # leaves below this size travel packed
_PACKABLE = ("bool", "int32", "uint32", "float32")
_LAYOUTS: list = []  # layout id -> (treedef, ((shape, dtype name, packed?), ...))


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree: the large leaves (`big`, a tuple) and the small ones packed (`small`,
    int32[n]); `layout` names the registry entry that puts them back together."""

    def __init__(self, big: tuple, small: jax.Array, layout: int):
        self.big, self.small, self.layout = big, small, layout

    def tree_flatten(self):
        return (self.big, self.small), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(tuple(children[0]), children[1], layout)


def layout_of(tree: Any) -> int:
    """The registry id of tree's layout (registered on first sight): which leaves pack."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    entry = (treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name,
                             jnp.dtype(x.dtype).name in _PACKABLE
                             and 0 < math.prod(x.shape) < SMALL_ELEMENTS) for x in leaves))
    for i, known in enumerate(_LAYOUTS):
        if known == entry:
            return i
    _LAYOUTS.append(entry)
    return len(_LAYOUTS) - 1


def _bits(x: jax.Array) -> jax.Array:
    """A packable leaf -> int32[size], its values bit for bit (bools as 0/1)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int32)
    if x.dtype != jnp.int32:
        x = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.ravel(x)


def _from_bits(v: jax.Array, shape: tuple, dtype: str) -> jax.Array:
    """_bits inverted: int32[size] -> the leaf of shape and dtype."""
    if dtype == "bool":
        return (v != 0).reshape(shape)
    if dtype != "int32":
        v = jax.lax.bitcast_convert_type(v, jnp.dtype(dtype))
    return v.reshape(shape)


def _pack_small(leaves: list, layout: int) -> jax.Array:
    """The small leaves (in tree order) -> int32[n]."""
    small = [_bits(x) for x in leaves]
    return jnp.concatenate(small) if small else jnp.zeros((0,), jnp.int32)


def _unpack_small(small: jax.Array, layout: int) -> list:
    """_pack_small inverted."""
    out, at = [], 0
    for shape, dtype, packed in _LAYOUTS[layout][1]:
        if packed:
            n = math.prod(shape)
            out.append(_from_bits(small[at:at + n], shape, dtype))
            at += n
    return out


def _split(tree: Any, layout: int) -> tuple[tuple, list]:
    """tree -> (its large leaves, its small ones), each in tree order."""
    meta = _LAYOUTS[layout][1]
    leaves = jax.tree_util.tree_leaves(tree)
    return (tuple(x for x, (_, _, p) in zip(leaves, meta) if not p),
            [x for x, (_, _, p) in zip(leaves, meta) if p])


def _join(big: tuple, small: list, layout: int) -> Any:
    """_split inverted."""
    treedef, meta = _LAYOUTS[layout]
    big, small = iter(big), iter(small)
    return jax.tree_util.tree_unflatten(treedef, [next(small if p else big)
                                                  for _, _, p in meta])


def pack(tree: Any, layout: int) -> Packed:
    """tree (traced) -> Packed under layout (`layout_of(tree)`)."""
    big, small = _split(tree, layout)
    return Packed(big, _pack_small(small, layout), layout)


def unpack(p: Packed) -> Any:
    """Packed (traced) -> the tree it was packed from."""
    return _join(p.big, _unpack_small(p.small, p.layout), p.layout)


_pack_small_call = jax.jit(_pack_small, static_argnums=1)
_unpack_small_call = jax.jit(_unpack_small, static_argnums=1)


def packed(tree: Any) -> Packed:
    """tree (concrete) -> Packed, its small leaves packed by a device call and its large ones
    kept as they are (not copied)."""
    layout = layout_of(tree)
    big, small = _split(tree, layout)
    return Packed(big, _pack_small_call(small, layout), layout)


def unpacked(p: Packed) -> Any:
    """Packed (concrete) -> its tree, the small leaves unpacked by a device call and the
    large ones as they are (not copied)."""
    return _join(p.big, _unpack_small_call(p.small, p.layout), p.layout)
