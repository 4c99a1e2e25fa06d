"""Every jitted entry point called with abstract arguments, to lower it for a platform this
machine does not have (`jax.export` lowers for "tpu" and "cuda" on a CPU-only jaxlib).

Nothing here allocates: parameters, caches, prompts and pools are `jax.ShapeDtypeStruct`s (on a
mesh, carrying the `NamedSharding` the real code places them with), so a Llama-3.1-8B-shaped
call on an abstract 2x4 mesh (`jax.sharding.AbstractMesh`) lowers on a laptop. What lowering
catches: an op or a sharding only the CPU backend accepts, a host callback in a loop that must
stay on the device, an f32 copy of bf16 weights.

A `Call` is one jitted function with its abstract arguments:

    loop_call      generate's decoding loop of a method (`common.make_runner` over its seam
                   functions, the loop `MethodSpec.run` runs), greedy or sampled;
    engine_calls   the serving engine's insert and step (`executor.device_insert`,
                   `executor.device_step`) over its pinned device state;
    placement_call `load_sharded`'s placement: the checkpoint's (unplaced) weights onto the
                   mesh's `sharding.param_shardings`, the shardings every loop's params carry.

Params are given in the canonical (stacked) layout: the one decoding runs on a mesh and on a
TPU (`layout.decode_params` packs on one CPU or GPU; the packed forward's ops are the stacked
one's, unrolled). `host_callbacks` and `f32_weight_copies` read a
lowered module's text; `packed_pair` gives the layout one GPU runs on, and `while_loops` counts
what a GPU would return to the host for. Letters as in the package glossary.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .decoding import METHODS
from .decoding.common import Limits, Pair, make_runner
from .models.config import ModelConfig
from .models.layout import pack
from .models.params import nest
from .request import cache_slots
from .sampling import SamplingParams
from .sharding import param_shardings, spec_for


@dataclasses.dataclass(frozen=True)
class Call:
    """One jitted function and the abstract arguments it is lowered with.

    Attributes:
        name: what it is ("speculative loop, greedy", "engine step", ...).
        fn: the jitted function (static arguments in `kwargs`).
        args, kwargs: abstract positional arguments and keyword (static) arguments.
    """

    name: str
    fn: Callable
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def export(self, platforms: tuple = ("tpu", "cuda")) -> jax.export.Exported:
        """The call lowered for `platforms` (one module serving each of them)."""
        return jax.export.export(self.fn, platforms=tuple(platforms))(*self.args, **self.kwargs)


def _sds(shape, dtype, mesh=None, spec: Optional[PartitionSpec] = None):
    sharding = None if mesh is None else NamedSharding(mesh, spec or PartitionSpec())
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _rows(shape, dtype, mesh):
    """An abstract [B, ...] array placed as `sharding.shard_batch` places a batch."""
    spec = None if mesh is None else spec_for(("batch",) + (None,) * (len(shape) - 1), shape,
                                              mesh)
    return _sds(shape, dtype, mesh, spec)


def abstract_params(config: ModelConfig, dtype="bfloat16", mesh=None, quantize=None) -> dict:
    """The params of `config` as ShapeDtypeStructs, placed with `param_shardings` on a mesh;
    quantize "int8" / "int4": their linear weights as `load_model(quantize=)` keeps them
    (abstract `quant.QuantArray`s, split by `sharding.param_specs_of`)."""
    if quantize is not None:
        from .models.quant import quantize_params

        plain = abstract_params(config, dtype)
        q = jax.eval_shape(lambda p: quantize_params(p, config, quantize), plain)
        if mesh is None:
            return q
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            q, param_shardings(config, mesh, q))
    shapes = nest(config, lambda leaf: leaf.shape(config))
    if mesh is None:
        return jax.tree.map(lambda s: _sds(s, dtype), shapes,
                            is_leaf=lambda x: isinstance(x, tuple))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, jnp.dtype(dtype), sharding=sh),
                        shapes, param_shardings(config, mesh),
                        is_leaf=lambda x: isinstance(x, tuple))


def abstract_pair(tconfig: ModelConfig, dconfig: Optional[ModelConfig] = None,
                  dtype="bfloat16", mesh=None, quantize=None) -> Pair:
    """A `Pair` of abstract params (draft None: no draft), carrying the mesh as `make_pair`
    does for placed params; quantize: both models' weights so (`abstract_params`)."""
    return Pair(tparams=abstract_params(tconfig, dtype, mesh, quantize), tconfig=tconfig,
                dparams=None if dconfig is None else abstract_params(dconfig, dtype, mesh,
                                                                     quantize),
                dconfig=dconfig, mesh=mesh)


def packed_pair(pair: Pair) -> Pair:
    """The abstract pair in the packed layout, as `layout.decode_params` gives it on one GPU
    (or a large model on a CPU): the layout a GPU's default program runs on, with the dense
    attention kernel (`attention.BY_BACKEND["gpu"]`, set by the caller before tracing)."""
    if pair.mesh is not None:
        raise ValueError("packed_pair: sharded params are never packed (layout.wants_packing)")

    def packed(params, config):
        return None if params is None else jax.eval_shape(lambda p: pack(p, config), params)

    return dataclasses.replace(pair, tparams=packed(pair.tparams, pair.tconfig),
                               dparams=packed(pair.dparams, pair.dconfig))


def while_loops(text: str) -> int:
    """`stablehlo.while` ops in a lowered module's text: on a GPU each iteration of each sends
    its predicate to the host (docs/bench/device-h200.md)."""
    return len(re.findall(r"stablehlo\.while", text))


def _knobs(rows: int, n_eos: int, mesh, greedy_rows: bool = False):
    """Abstract (Limits, SamplingParams) of `rows` rows, as `request.row_knobs` builds them
    (replicated on a mesh: generate passes them unplaced); greedy_rows: as the engine's, with
    per-row greedy and speculation flags."""
    r = lambda dt: _sds((rows,), dt, mesh)  # noqa: E731
    limits = Limits(max_new_tokens=r(jnp.int32), eos_token_id=_sds((rows, n_eos), jnp.int32,
                                                                    mesh),
                    speculate=r(jnp.bool_) if greedy_rows else None)
    sp = SamplingParams(temperature=r(jnp.float32), top_k=r(jnp.int32), top_p=r(jnp.float32),
                        seed=r(jnp.uint32), stream=r(jnp.int32),
                        greedy_rows=r(jnp.bool_) if greedy_rows else None)
    return limits, sp


def _loop_config(method: str, cfg, vocab: int, mesh):
    """(the config the compiled loop sees, its abstract starting pool or None)."""
    spec = METHODS[method]
    if spec.prepare is None:
        return cfg, None
    seen = {}

    def pool_of():  # traced: the pool's shapes without allocating it
        seen["cfg"], p = spec.prepare(cfg, None, vocab)
        return p

    pool = jax.eval_shape(pool_of)
    return seen["cfg"], jax.tree.map(lambda x: _sds(x.shape, x.dtype, mesh), pool)


_RUNNERS: dict = {}


def runner(method: str) -> Callable:
    """generate's jitted loop of a method: `common.make_runner` over its seam functions (one
    per method, kept, so repeated lowerings reuse its trace)."""
    if method not in _RUNNERS:
        s = METHODS[method]
        _RUNNERS[method] = make_runner(s.init, s.insert, s.round, s.finish)
    return _RUNNERS[method]


def loop_call(method: str, pair: Pair, cfg: Any = None, *, batch: int = 1,
              prompt_width: int = 64, max_new_tokens: int = 128, greedy: bool = True,
              n_eos: int = 2) -> Call:
    """generate's decoding loop of `method` on abstract arguments: B = batch rows of
    P = prompt_width prompt tokens, generate's cache slots for max_new_tokens more
    (`request.cache_slots`).
    cfg None: the paper's recipe."""
    spec = METHODS[method]
    cfg = spec.default_config() if cfg is None else cfg
    loop_cfg, pool = _loop_config(method, cfg, pair.tconfig.vocab_size, pair.mesh)
    limits, sp = _knobs(batch, n_eos, pair.mesh)
    slots = cache_slots(prompt_width, max_new_tokens, spec.margin(cfg))
    args = (pair, _rows((batch, prompt_width), jnp.int32, pair.mesh),
            _rows((batch,), jnp.int32, pair.mesh), limits, sp, pool)
    return Call(f"{method} loop, {'greedy' if greedy else 'sampled'}", runner(method), args,
                dict(cfg=loop_cfg, slots=slots, greedy=greedy))


def engine_calls(method: str, pair: Pair, cfg: Any = None, *, slots: int = 4,
                 cache_slots: int = 256, prompt_width: int = 64, rounds: int = 4,
                 greedy: bool = True) -> list[Call]:
    """The serving engine's two device calls on abstract arguments, as `Engine` makes them:
    insert (one request's prompt into one slot) and step (k = rounds rounds on every slot),
    its state over B = slots slots of S = cache_slots cache slots, pinned on a mesh as the
    engine pins it (`executor.dev_placements`)."""
    from .request import EOS_BUCKET
    from .serving.executor import (INSERT_HEAD, DeviceState, dev_placements, device_insert,
                                   device_step, engine_state)

    spec = METHODS[method]
    cfg = spec.default_config() if cfg is None else cfg
    loop_cfg, pool = _loop_config(method, cfg, pair.tconfig.vocab_size, None)
    # the state's shapes (placed below, as the engine pins it)
    state = jax.eval_shape(lambda p, pl: engine_state(spec.init(p, loop_cfg, slots,
                                                                cache_slots, pl)),
                           pair.replace(mesh=None), pool)
    limits, sp = _knobs(slots, EOS_BUCKET, None, greedy_rows=True)
    dev = DeviceState(state, sp, limits)
    mesh = pair.mesh
    if mesh is not None:
        dev = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                           dev, dev_placements(mesh, dev))
    # one insert's host data in one int32 array (`executor.pack_insert`)
    insert = Call("engine insert", device_insert,
                  (pair, dev, _sds((INSERT_HEAD + prompt_width,), jnp.int32, mesh)),
                  dict(insert_fn=spec.insert, cfg=loop_cfg, vocab=pair.tconfig.vocab_size,
                       shared=True))
    step = Call(f"engine step, {'greedy' if greedy else 'sampled'}", device_step,
                (pair, dev, _sds((slots,), jnp.bool_, mesh)),
                dict(round_fn=spec.round, cfg=loop_cfg, greedy=greedy, rounds=rounds,
                     width=rounds * spec.max_emit(cfg)))
    return [insert, step]


def placement_call(config: ModelConfig, mesh, dtype="bfloat16") -> Call:
    """`load_sharded`'s placement: the checkpoint's weights, unplaced, put where
    `sharding.param_shardings` (the shardings `load_sharded` hands `load_model`) says."""
    shardings = param_shardings(config, mesh)
    return Call("load_sharded placement", jax.jit(lambda p: p, out_shardings=shardings),
                (abstract_params(config, dtype),))


# ------------------------------------------------------------------- reading lowered modules
# custom_call targets of host callbacks (jax.pure_callback / io_callback / debug.callback) on
# every platform, and the ops that move data between host and device
_HOST_TARGET = re.compile(r"callback|host|py_func", re.IGNORECASE)
_HOST_OPS = re.compile(r"stablehlo\.(send|recv|infeed|outfeed)\b")
_CUSTOM_CALL = re.compile(r"custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]+)\"")


def host_callbacks(text: str) -> list[str]:
    """The host callbacks and host transfers in a lowered module's text (empty: none)."""
    found = [a or b for a, b in _CUSTOM_CALL.findall(text) if _HOST_TARGET.search(a or b)]
    return found + [f"stablehlo.{op}" for op in _HOST_OPS.findall(text)]


_TENSOR = re.compile(r"tensor<((?:\d+x)+)f32>")


def weight_shapes(config: ModelConfig) -> set[tuple]:
    """Every shape a weight of `config` has, stacked, per layer and as the 2-D matrix a
    matmul reads (either orientation), with dimensions of 1 dropped."""
    shapes = set()
    for shape in jax.tree.leaves(nest(config, lambda leaf: leaf.shape(config)),
                                 is_leaf=lambda x: isinstance(x, tuple)):
        if len(shape) < 2:
            continue  # norms and biases: vectors, as small as an activation
        for s in (shape, shape[1:] if len(shape) > 2 else shape):
            shapes.add(tuple(d for d in s if d != 1))
        flat = (shape[-2], shape[-1]) if len(shape) == 2 else None
        if flat is None:
            inner = shape[1:]
            for k in range(1, len(inner)):
                a, b = math.prod(inner[:k]), math.prod(inner[k:])
                shapes.update({(a, b), (b, a)})
        else:
            shapes.add(flat[::-1])
    return shapes


def f32_tensor_shapes(text: str) -> list[tuple]:
    """The shapes of the f32 tensor types in a lowered module's text."""
    return [tuple(int(d) for d in dims.rstrip("x").split("x"))
            for dims in set(_TENSOR.findall(text))]


def f32_weight_copies(text: str, *configs: ModelConfig) -> list[str]:
    """The f32 tensor types in a lowered module's text whose shape is a weight's of one of
    `configs` (`weight_shapes`): an f32 copy of the weights in a bf16 program (empty: none)."""
    shapes = set().union(*(weight_shapes(c) for c in configs))
    out = []
    for dims in set(_TENSOR.findall(text)):
        shape = tuple(int(d) for d in dims.rstrip("x").split("x"))
        if tuple(d for d in shape if d != 1) in shapes:
            out.append(f"tensor<{dims}f32>")
    return sorted(out)
