"""The packed layout: how the forward's weights are laid out for decoding on one CPU or GPU.

The canonical params (`params.LEAVES`) stack every layer's weights on a leading L axis, so the
forward scans over layers and compile time does not grow with depth; sharding, loading,
training and export all use that layout. On XLA:CPU it has a price at decoding's small T:
each layer step slices its weights out of the stack into a fresh buffer before the matmuls
read them (measured on SmolLM2-135M: 30 layers' slices, 425 MB written and read again per
token), and the tied LM head reads the embedding transposed.

The packed layout (`pack`) is what decoding runs on there instead:

    {"embed": [V,E], "final_norm": [E], "head_t": [E,V] (the LM head, contiguous),
     "layers": (L per-layer dicts: attn_norm [E], wqkv [E, (H+2K)*D], (bqkv [(H+2K)*D]),
                wo [H*D, E], mlp_norm [E], w_gate_up [E, 2F], w_down [F, E]), ...}

one buffer per layer (the forward unrolls its layers over them, `llama.forward`), q/k/v and
gate/up fused into one matmul each (fewer, larger matrix-vector products), the head stored as
it is read. The same numbers in the same order of operations per output element: greedy
decoding on either layout gives the same tokens (tested).

`decode_params` packs when it pays, for params on one device (sharded params keep the
canonical layout the mesh's shardings describe): on a CPU for weights of at least
PACK_MIN_BYTES; on a GPU whenever the copy fits with as much again to spare (`gpu_has_room`).
On a GPU the scan's per-layer slice costs too, and the scan is a `while` loop whose predicate
goes to the host every layer: measured on an H200 (bf16, experiments/device/variants.py,
docs/bench/device-h200), a Llama-3.1-8B-shaped forward took 12.5 ms stacked and 5.5 ms packed
(dense attention; 3.3 ms is its weights over the HBM bandwidth), and vanilla decoding 13.1 ->
5.7 ms per token.

One copy of the weights. On a GPU the packed layout is a copy (`pack`, made once per model by
one jitted call, about 0.15 s for SmolLM2-135M), kept on the `Model` beside its canonical
params: the weights' memory doubles there, and the memory planner (`packed_bytes`,
`ouroboros-jax memory`) counts the copy before it is made. On a CPU the device's memory is the
host's, and a jax array's buffer can be read as numpy and adopted again without a copy: there
the packed layout is made of views (`view_pack`), each layer's weights a zero-copy slice of the
stacked buffers, the canonical leaves unchanged (no q/k/v or gate/up fusion, which would need
new buffers), a tied head read from the embedding (no transposed copy). It costs no bytes, so
the weights are held once whichever layout reads them (measured on the real pair,
docs/real-models.md "Memory"). Letters as in the package glossary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .quant import concat_out

Params = dict


# per-layer norms some families add (params.LEAVES), copied into the packed layer unchanged
UNFUSED_NORMS = ("post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "q_norm_all",
                 "k_norm_all")
# a mixture of experts' leaves, copied unchanged too (its router and experts are not fused)
MOE_LEAVES = ("router", "we_gate", "we_up", "we_down")
# the key of a Model's packed copy among its derived copies (`Model.derived_copy`)
PACKED = "packed"
# the key, in a packed layout made of views, of the stacked leaves they view: the same buffers,
# which a forward whose every product reads a layer in place scans over (`llama.forward`)
STACKED = "stacked_layers"


def is_packed(params: Params) -> bool:
    """Whether params are in the packed layout (per-layer tuple) rather than stacked."""
    return isinstance(params.get("layers"), (tuple, list))


def pack(params: Params, config: ModelConfig) -> Params:
    """Canonical params -> the packed layout (see the module docstring). Pure and jittable;
    packed params pass through."""
    if is_packed(params):
        return params
    lay = params["layers"]
    E = config.hidden_size

    def flat(name, i):  # layer i of a [L, E, N, D] leaf -> [E, N*D]
        return lay[name][i].reshape(E, -1)

    layers = []
    for i in range(config.num_layers):  # one fused copy per output buffer, no stacked temporary
        layer = {"attn_norm": lay["attn_norm"][i],
                 "wqkv": concat_out([flat("wq", i), flat("wk", i), flat("wv", i)]),
                 "wo": lay["wo"][i].reshape(-1, E), "mlp_norm": lay["mlp_norm"][i]}
        if config.is_moe:
            layer.update({name: lay[name][i] for name in MOE_LEAVES})
        else:
            layer.update({"w_gate_up": concat_out([lay["w_gate"][i], lay["w_up"][i]]),
                          "w_down": lay["w_down"][i]})
        if config.qkv_bias:
            layer["bqkv"] = jnp.concatenate([lay[b][i].reshape(-1) for b in ("bq", "bk", "bv")])
        for name in UNFUSED_NORMS:  # Gemma's extra norms and the q/k norms, as they are
            if name in lay:
                layer[name] = lay[name][i]
        layers.append(layer)
    head_t = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return {"embed": params["embed"], "final_norm": params["final_norm"],
            "head_t": head_t, "layers": tuple(layers)}


_pack_jit = jax.jit(pack, static_argnums=1)


def view_pack(params: Params, config: ModelConfig) -> Params:
    """Canonical params on one CPU -> the packed layout as views of their buffers: layer i's
    dict holds every stacked leaf's slice [i] (the canonical leaf shapes: wq [E,H,D], w_gate
    [E,F], ..., read by the forward's unfused path), each a jax array adopting a contiguous
    piece of the stacked buffer without a copy; embed, final_norm and an untied head
    ("head_t" = lm_head [E,V]) are the canonical arrays themselves, and a tied model has no
    "head_t" (the forward reads the embedding). The views keep their stacked buffers alive.
    jax adopts a slice that starts 64-byte aligned; another is copied (a per-layer norm of a
    width whose bytes are no multiple of 64, in a toy config: a few bytes). Not jittable
    (host views); packed params pass through."""
    if is_packed(params):
        return params
    device = next(iter(params_devices(params)))
    # np.asarray of a CPU jax array is a read-only view of its buffer (no copy)
    # (a quantized leaf's codes, scales and offsets each, as the pytree's children)
    stacked = jax.tree.map(np.asarray, params["layers"])
    layers = tuple(jax.tree.map(lambda h: jax.device_put(h[i], device, may_alias=True), stacked)
                   for i in range(config.num_layers))
    out = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": layers,
           STACKED: params["layers"]}
    if not config.tie_word_embeddings:
        out["head_t"] = params["lm_head"]
    return out


def shares_buffers(packed: Params, params: Params) -> bool:
    """Whether every array of `packed` lies inside one of `params`' buffers (the views of
    `view_pack`, adopted without a copy); False where any is a buffer of its own."""
    spans = [(x.unsafe_buffer_pointer(), x.unsafe_buffer_pointer() + x.nbytes)
             for x in jax.tree.leaves(params)]
    return all(any(lo <= x.unsafe_buffer_pointer() and x.unsafe_buffer_pointer() + x.nbytes <= hi
                   for lo, hi in spans) for x in jax.tree.leaves(packed))


# Weights below this size stay stacked on a CPU: measured on this project's 2-core x86 machine
# (32 MB L3), packing made SmolLM2-135M's (538 MB) vanilla steps 1.3-2x faster and its
# 9-token forward 1.3x, while for the demo pair (76 MB target, 13 MB draft: largely
# cache-resident, where a stacked layer's slice costs little) it sped up vanilla but slowed
# the draft's multi-token forwards and the speculative methods (experiments/cpu_forward.py, the
# `set_packing` A/B in README's "Where the CPU path stands").
PACK_MIN_BYTES = 256 * 2**20

_override: list = [None]


def set_packing(enabled) -> None:
    """Forces packing on (True: in the device's kind, views on a CPU) or off (False) for
    every later call, or to the fused copy on any device ("fused": a GPU's program, run on a
    CPU in tests and A/B benchmarks), or back to the per-device choice (None). Read when a
    call builds its model pair, outside any trace."""
    if enabled is not None and not isinstance(enabled, bool) and enabled != "fused":
        raise ValueError("set_packing: enabled must be True, False, 'fused' or None, got "
                         f"{enabled!r}")
    _override[0] = enabled


def weight_bytes(params: Params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def params_devices(params: Params) -> set:
    """The devices params lie on (their embedding's sharding; the default device when
    unplaced)."""
    devices = getattr(getattr(params["embed"], "sharding", None), "device_set", None)
    return set(devices) if devices else {jax.devices()[0]}


def wants_packing(params: Params, held: bool = False) -> bool:
    """The packed layout pays: params on one device, which is a CPU and the weights at least
    PACK_MIN_BYTES, or a GPU with room for the copy (`set_packing` forces either way; sharded
    params are never packed). held: a copy of these params is made already (a GPU keeps it:
    counted against the room, it would switch layouts, and recompile, between calls)."""
    devices = params_devices(params)
    if len(devices) != 1 or _override[0] is False:
        return False
    if _override[0] is not None:  # True or "fused"
        return True
    device = next(iter(devices))
    if device.platform == "gpu":
        return held or gpu_has_room(device, weight_bytes(params))
    return device.platform == "cpu" and weight_bytes(params) >= PACK_MIN_BYTES


def packs_by_views(params: Params) -> bool:
    """Whether a packed layout of these (one-device) params is made of views (`view_pack`):
    on a CPU, unless `set_packing("fused")` asks for the copy."""
    return _override[0] != "fused" and next(iter(params_devices(params))).platform == "cpu"


def gpu_has_room(device, nbytes: int) -> bool:
    """Whether a GPU can hold a packed copy of `nbytes` of weights and keep as much again free
    (for caches and activations): its allocator's limit minus what is in use. A device that
    keeps no stats is not packed on."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    if "bytes_limit" not in stats:
        return False
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return 2 * nbytes <= free


def decode_params(model) -> Params:
    """The params decoding should run on for a `Model`: its packed layout where
    `wants_packing` (made once, kept on the model while its params stay the same object:
    views of the params on a CPU, `view_pack`, else a copy made by one jitted call), else its
    params as they are."""
    params = model.params
    if is_packed(params):
        return params
    packed = model.derived_copy(PACKED)
    if not wants_packing(params, held=packed is not None):
        return params
    if packed is None:
        make = view_pack if packs_by_views(params) else _pack_jit
        packed = model.keep_derived(PACKED, make(params, model.config))
    return packed


def release(model) -> None:
    """Drops a `Model`'s packed layout (the next call that wants it packs again): frees a
    second copy of the weights where it is one (a GPU's), when something else needs the
    memory, e.g. a benchmark that loads transformers' own copies of the same checkpoints."""
    model.drop_derived(PACKED)


def packed_bytes(model) -> int:
    """Bytes a call would add for the packed copy of a `Model`'s weights (0 where nothing is
    packed, the copy already exists, or the layout is made of views, `packs_by_views`):
    every layer's weights, and the transposed head of a tied model."""
    params = model.params
    if (is_packed(params) or not wants_packing(params) or model.derived_copy(PACKED) is not None
            or packs_by_views(params)):
        return 0
    return copy_bytes(model)


def copy_bytes(model) -> int:
    """Bytes of a fused packed copy of a `Model`'s weights (`pack`), made or not: every
    layer's weights, and the transposed head of a tied model."""
    params = model.params
    head = params["embed"].size * params["embed"].dtype.itemsize
    return weight_bytes(params["layers"]) + (head if model.config.tie_word_embeddings else 0)
