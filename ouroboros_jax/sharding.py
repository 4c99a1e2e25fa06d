"""Sharding over `jax.sharding` meshes: one table of logical axes per leaf, one table of rules.

Mesh axes are named "data" (batch rows) and "model" (tensor parallel over heads and FFN).
Each parameter and cache leaf names its dimensions logically (`LOGICAL_AXES`); `RULES` maps a
logical name to a mesh axis. A dimension that the mesh axis does not divide is replicated
instead (e.g. the single KV head of an MQA model on 8 devices), so every config runs on every
mesh; `plan_report` shows which dimensions ended up split.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .models.config import ModelConfig
from .models.loading import Model
from .models.params import LEAVES, nest
from .models.quant import QuantArray, is_quantized, storage_axes

# logical names per dimension of each leaf ("layers" is the stacked scan axis): the parameters'
# come from their one description (`models.params.LEAVES`), the KV cache's are added here
LOGICAL_AXES = {leaf.name: leaf.axes for leaf in LEAVES}
LOGICAL_AXES["cache"] = ("layers", "batch", "cache_slots", "kv_heads", "head_dim")  # [L,B,S,K,D]

RULES = {
    "batch": "data",
    "q_heads": "model",
    "kv_heads": "model",
    "ffn": "model",
    # mixtures of experts: expert parallel, each device holding whole experts; where the
    # "model" axis does not divide the experts, their intermediate dim splits instead
    "experts": "model",
    "moe_ffn": "model",
    "vocab": "model",
    "embed": None,
    "layers": None,
    "head_dim": None,
    "cache_slots": None,
}


def _check_mesh(mesh: Mesh):
    unknown = [a for a in mesh.axis_names if a not in ("data", "model")]
    if unknown:
        raise ValueError(f"mesh axes must be named 'data' and/or 'model', got {mesh.axis_names}")


def spec_for(logical: tuple, shape: tuple, mesh: Mesh) -> P:
    """PartitionSpec for a leaf; a mesh axis that does not divide its dimension is dropped, and
    a mesh axis is used at most once per leaf."""
    used, out = set(), []
    for name, size in zip(logical, shape):
        axis = RULES.get(name)
        if axis is None or axis not in mesh.axis_names or axis in used \
                or size % mesh.shape[axis] != 0:
            out.append(None)
        else:
            used.add(axis)
            out.append(axis)
    return P(*out)


def param_specs(config: ModelConfig, mesh: Mesh) -> dict:
    return nest(config, lambda leaf: spec_for(leaf.axes, leaf.shape(config), mesh))


def param_specs_of(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """`param_specs` for params whose leaves may be quantized (`models/quant.py`): a
    QuantArray's codes and scales are split as its float form would be, by their storage
    axes (`quant.storage_axes`: groups split with the input side, output dims as theirs)."""
    def one(leaf):
        w = params["layers"][leaf.name] if leaf.per_layer else params[leaf.name]
        if not is_quantized(w):
            return spec_for(leaf.axes, leaf.shape(config), mesh)
        if w.k4:  # its memory interleaves inputs across the output side: no split keeps it
            raise ValueError(f"{leaf.name}: a w8a8 draft (k4 codes) runs on one CPU device "
                             "only; load the draft with quantize='int8' to place it on a mesh")
        code_axes, scale_axes = storage_axes(w, leaf.axes)
        ss = spec_for(scale_axes, w.scale.shape, mesh)
        return QuantArray(spec_for(code_axes, w.codes.shape, mesh), ss,
                          None if w.offset is None else ss, w.in_shape, w.out_ndim, w.bits,
                          w.dtype)

    return nest(config, one)


def param_shardings(config: ModelConfig, mesh: Mesh, params: dict = None) -> dict:
    """NamedShardings of the config's params; of `params` as they are (quantized leaves
    too, `param_specs_of`) when given."""
    _check_mesh(mesh)
    specs = param_specs(config, mesh) if params is None else param_specs_of(params, config, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def cache_spec(config: ModelConfig, batch: int, slots: int, mesh: Mesh) -> P:
    shape = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)
    return spec_for(LOGICAL_AXES["cache"], shape, mesh)


def shard_model(model: Model, mesh: Mesh) -> Model:
    """The same model with params placed on the mesh.

    The placed copy is kept on the model itself (`Model.derived_copy(("mesh", mesh))`), so
    repeated calls reuse it and it is freed with the model: no module-level cache outlives a
    model.
    """
    _check_mesh(mesh)
    hit = model.derived_copy(("mesh", mesh))
    if hit is not None:
        return hit
    params = jax.device_put(model.params, param_shardings(model.config, mesh, model.params))
    return model.keep_derived(("mesh", mesh), dataclasses.replace(model, params=params))


def check_heads(model: Model, mesh: Mesh, who: str = "target") -> None:
    """Refuses a mesh whose "model" axis does not divide the model's query heads: its attention
    weights would then be replicated whole on every device (`spec_for`), which on a mesh that
    spans hosts means every host holding the whole model, what a multi-host mesh is for avoiding.
    (KV heads may stay replicated: MQA's single KV head is small.)"""
    m = dict(mesh.shape).get("model", 1)
    H = model.config.num_heads
    if H % m != 0:
        raise ValueError(f"mesh: the 'model' axis ({m} devices) does not divide the {who}'s "
                         f"{H} query heads, so its attention weights would be replicated on "
                         f"every host; choose a 'model' axis size that divides {H}")


def load_sharded(path: str, mesh: Mesh, dtype="auto") -> Model:
    """`load_model` straight onto a mesh: each process reads from the safetensors files only the
    slices its own devices hold (`jax.make_array_from_callback` over safetensors' `get_slice`),
    so a checkpoint never has to fit in one host's memory. The result is the placed model
    (`shard_model(model, mesh)` returns it as is)."""
    from .models.loading import load_model

    _check_mesh(mesh)

    def shardings(config):
        return param_shardings(config, mesh)

    model = load_model(path, dtype=dtype, shardings=shardings)
    model.keep_derived(("mesh", mesh), model)
    return model


def shard_batch(x: jax.Array, mesh: Mesh) -> jax.Array:
    """Splits the leading (batch) axis over "data" when it divides, else replicates."""
    spec = spec_for(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)
    return jax.device_put(x, NamedSharding(mesh, spec))


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data*model devices."""
    devices = jax.devices() if devices is None else devices
    for name, v in (("data", data), ("model", model)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"mesh {name} axis size must be an integer >= 1, got {v!r}")
    if data * model > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, "
                         f"{len(devices)} available")
    return Mesh(np.array(devices[:data * model]).reshape(data, model), ("data", "model"))


def _bytes_per_device(shape, dtype, spec: P, axis_sizes: dict) -> int:
    # Python ints: np.prod wraps around int64 for huge batch x cache sizes (negative GiB);
    # 4-bit codes two to a byte, as GPU and TPU store them
    bits = 4 if jnp.dtype(dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else \
        8 * jnp.dtype(dtype).itemsize
    n = math.prod(int(d) for d in shape) * bits // 8
    for a in spec:
        if a is not None:
            n //= axis_sizes[a]
    return n


def memory_plan(config: ModelConfig, data: int, model: int, batch: int, cache_len: int,
                dtype="bfloat16", hosts: int = 1, quantize=None) -> dict:
    """Per-device bytes of params and KV cache for a (data, model) mesh, from shapes alone,
    and per-host bytes when the mesh spans `hosts` hosts of equal device counts (a host holds
    its devices' shares: with `load_sharded` that is also what it reads from the checkpoint).

    Uses `jax.eval_shape` of init (no memory is allocated), so full-size 70B configs can be
    planned on a laptop. quantize: None, "int8" or "int4": the linear weights as
    `load_model(quantize=)` keeps them (codes and scales, `models/quant.py`), dtype then the
    float leaves' and the cache's.
    """
    if isinstance(hosts, bool) or not isinstance(hosts, (int, np.integer)) or hosts < 1 \
            or (data * model) % hosts != 0:
        raise ValueError(f"memory_plan: hosts must be an integer >= 1 dividing the mesh's "
                         f"{data * model} devices, got {hosts!r}")
    from .models.llama import init_params

    for name, v in (("data", data), ("model", model), ("batch", batch),
                    ("cache_len", cache_len)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"memory_plan: {name} must be an integer >= 1, got {v!r}")
    from .models.quant import quantize_params

    def init(k):
        p = init_params(config, k, jnp.dtype(dtype))
        return p if quantize is None else quantize_params(p, config, quantize)

    abstract = jax.eval_shape(init, jax.random.key(0))
    axis_sizes = {"data": data, "model": model}

    class _FakeMesh:  # spec_for needs only axis names and sizes
        axis_names = ("data", "model")
        shape = axis_sizes

    specs = param_specs_of(abstract, config, _FakeMesh)
    leaves = jax.tree.leaves(abstract)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(spec_leaves)
    params_total = sum(_bytes_per_device(a.shape, a.dtype, P(), axis_sizes) for a in leaves)
    params_dev = sum(_bytes_per_device(a.shape, a.dtype, s, axis_sizes)
                     for a, s in zip(leaves, spec_leaves))
    cshape = (config.num_layers, batch, cache_len, config.num_kv_heads, config.head_dim)
    cspec = spec_for(LOGICAL_AXES["cache"], cshape, _FakeMesh)
    cache_dev = 2 * _bytes_per_device(cshape, dtype, cspec, axis_sizes)
    per_host = data * model // hosts
    return {"params_total_bytes": params_total, "params_per_device_bytes": params_dev,
            "kv_cache_per_device_bytes": cache_dev,
            "total_per_device_bytes": params_dev + cache_dev,
            "devices_per_host": per_host, "params_per_host_bytes": params_dev * per_host,
            "total_per_host_bytes": (params_dev + cache_dev) * per_host,
            "num_params": config.num_params(), "cache_spec": str(cspec),
            # a mixture of experts: its routed experts' bytes (all of them held) and the
            # parameters one token multiplies (0 and num_params for a dense model)
            "expert_bytes": config.expert_params() * jnp.dtype(dtype).itemsize,
            "active_params": config.active_params(),
            "active_bytes": config.active_params() * jnp.dtype(dtype).itemsize}
