"""Quantized weights lower for TPU and CUDA at the 70B plan's shapes (issue 56): every method's
decoding loop with a Llama-3.1-70B-shaped target and a Llama-3.2-1B-shaped draft, int8 and int4
weights on an abstract 2x4 mesh (`jax.export`, nothing allocated, ouroboros_jax/lowering.py),
with no host callback, no f32 copy of a weight or of its codes, and the codes split over the
mesh as the float weights would be; and the one-GPU program (packed layers, `layout.pack` of
the codes) at the 1B draft's shapes. Tracing and lowering only: about 25 s of CPU here."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from ouroboros_jax import lowering as lw
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.models import quant
from ouroboros_jax.models.presets import PRESETS

PLATFORMS = ("tpu", "cuda")
TARGET, DRAFT = PRESETS["llama-3.1-70b"], PRESETS["llama-3.2-1b"]


def mesh():
    return AbstractMesh((2, 4), ("data", "model"))


def _squeezed(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def _code_shapes(params) -> set:
    """Every quantized leaf's codes shape, stacked and per layer, dims of 1 dropped."""
    out = set()
    for w in jax.tree.leaves(params, is_leaf=quant.is_quantized):
        if quant.is_quantized(w):
            s = tuple(w.codes.shape)
            out |= {tuple(d for d in s if d != 1), tuple(d for d in s[1:] if d != 1)}
    return out


@pytest.fixture(scope="module", params=["int8", "int4"])
def pair(request):
    return request.param, lw.abstract_pair(TARGET, DRAFT, dtype="bfloat16", mesh=mesh(),
                                           quantize=request.param)


def test_quantized_codes_split_as_the_float_weights(pair):
    """wq's codes split their heads over "model"; w_down's (input side F split) its groups or,
    with one group per channel, its group length; scales follow."""
    scheme, p = pair
    layers = p.tparams["layers"]
    wq, w_down = layers["wq"], layers["w_down"]
    assert wq.codes.dtype == (jnp.int8 if scheme == "int8" else jnp.int4)
    assert wq.codes.sharding.spec == P(None, None, None, "model", None)
    down = w_down.codes.sharding.spec
    assert "model" in tuple(down)[1:3] and w_down.scale.sharding.spec[-1] is None
    assert not quant.is_quantized(p.tparams["embed"])


@pytest.mark.parametrize("method", ["vanilla", "speculative", "lookahead", "prompt_lookup",
                                    "ouroboros"])
def test_70b_quantized_loop_lowers_for_every_method(pair, method):
    scheme, p = pair
    assert set(METHODS) == {"vanilla", "speculative", "lookahead", "prompt_lookup", "ouroboros"}
    if not METHODS[method].needs_draft:
        p = p.replace(dparams=None, dconfig=None)
    exp = lw.loop_call(method, p, batch=2, prompt_width=128, max_new_tokens=256).export(
        PLATFORMS)
    assert tuple(exp.platforms) == PLATFORMS and exp.nr_devices == 8
    text = exp.mlir_module()
    assert not lw.host_callbacks(text)
    configs = [TARGET] + ([DRAFT] if p.dconfig is not None else [])
    # the scales are f32 by design, stacked or one layer's (as `quant.linear` views them
    # [ng, 1, O]); they may share a stacked norm's shape ([L, 1, E] or [ng, E] ~ [L, E])
    scales = {_squeezed(s) for params in (p.tparams, p.dparams) if params is not None
              for w in jax.tree.leaves(params, is_leaf=quant.is_quantized)
              if quant.is_quantized(w) for s in (w.scale.shape, w.scale.shape[1:])}
    copies = {c for c in lw.f32_weight_copies(text, *configs)
              if _squeezed(int(d) for d in c[len("tensor<"):-len("xf32>")].split("x"))
              not in scales}
    assert not copies, f"{scheme} {method}: f32 weight copies {copies}"
    shapes = _code_shapes(p.tparams) | _code_shapes(p.dparams)
    f32 = [t for t in lw.f32_tensor_shapes(text) if tuple(d for d in t if d != 1) in shapes]
    assert not f32, f"{scheme} {method}: f32 copies of codes {f32}"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_packed_gpu_program_lowers_on_quantized_weights(scheme):
    """One GPU's layout: q/k/v and gate/up codes fused per layer (`quant.concat_out`), the
    program lowered for CUDA with no host callback."""
    p = lw.packed_pair(lw.abstract_pair(DRAFT, DRAFT, dtype="bfloat16", quantize=scheme))
    layer = p.tparams["layers"][0]
    assert quant.is_quantized(layer["wqkv"]) and quant.is_quantized(layer["w_gate_up"])
    H, K, D = DRAFT.num_heads, DRAFT.num_kv_heads, DRAFT.head_dim
    assert layer["wqkv"].shape == (DRAFT.hidden_size, (H + 2 * K) * D)
    exp = lw.loop_call("speculative", p, batch=1, prompt_width=64,
                       max_new_tokens=64).export(("cuda",))
    assert not lw.host_callbacks(exp.mlir_module())
