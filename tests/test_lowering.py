"""Every decoding loop, the engine's device calls and load_sharded's placement lower for TPU and
CUDA (`jax.export` on this CPU-only jaxlib): on one device, on an abstract 2x4 mesh with the
real sharding rules, and at Llama-3.1-8B / Llama-3.2-1B shapes in bf16, nothing allocated
(ouroboros_jax/lowering.py). Each lowered module must hold no host callback, and the bf16
programs no f32 copy of a weight.

Time: tracing + lowering only (no compile). The cross product is cut to fit the suite: every
method greedy and sampled on one device (tiny shapes), every method greedy on the mesh (plus
speculative sampled: the vocabulary is split over "model" there), the engine's insert and step
for speculative on one device and Ouroboros on the mesh, and the 8B shapes for vanilla on one
device and Ouroboros on the mesh (about 30 s of CPU: 27 s user measured here). One export
serves both platforms (a module lowered for ("tpu", "cuda"), each platform's lowering rules
applied)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from ouroboros_jax import lowering as lw
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.presets import PRESETS

PLATFORMS = ("tpu", "cuda")
METHOD_NAMES = ("vanilla", "speculative", "lookahead", "prompt_lookup", "ouroboros")
# GQA (K < H) and a head count the mesh's "model" axis (4) divides, as the 8B shapes have
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=8, num_kv_heads=4, max_position_embeddings=1024)
TINY_DRAFT = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=4, max_position_embeddings=1024)
BIG, BIG_DRAFT = PRESETS["llama-3.1-8b"], PRESETS["llama-3.2-1b"]


def mesh():
    return AbstractMesh((2, 4), ("data", "model"))


def lowered(call: lw.Call) -> jax.export.Exported:
    """The call exported for both platforms; its module checked for host callbacks."""
    exp = call.export(PLATFORMS)
    assert tuple(exp.platforms) == PLATFORMS
    callbacks = lw.host_callbacks(exp.mlir_module())
    assert not callbacks, f"{call.name}: host callbacks in the lowered module: {callbacks}"
    return exp


def arg_sharding(text: str, name: str) -> str:
    """The sharding a lowered module gives its argument `name` (Shardy's dims list)."""
    pattern = r"sdy\.sharding<@mesh, (\[[^>]*\])>\} loc\(\"" + re.escape(name) + r"\"\)"
    m = re.search(pattern, text)
    assert m, f"argument {name} has no sharding in the module"
    return m.group(1)


def test_host_callbacks_and_f32_copies_are_seen():
    """The two readers find what they look for (else the tests below could not fail)."""
    def with_callback(x):
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    text = jax.jit(with_callback).lower(x).as_text()
    assert lw.host_callbacks(text)
    assert not lw.host_callbacks(jax.jit(lambda v: v * 2).lower(x).as_text())

    w = jax.ShapeDtypeStruct((BIG.hidden_size, BIG.intermediate_size), jnp.bfloat16)
    h = jax.ShapeDtypeStruct((1, BIG.hidden_size), jnp.bfloat16)
    upcast = jax.jit(lambda w, h: h.astype(jnp.float32) @ w.astype(jnp.float32)).lower(w, h)
    assert lw.f32_weight_copies(upcast.as_text(), BIG)
    mixed = jax.jit(lambda w, h: jnp.dot(h, w, preferred_element_type=jnp.float32)).lower(w, h)
    assert not lw.f32_weight_copies(mixed.as_text(), BIG)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_loop_lowers_on_one_device(method, greedy):
    pair = lw.abstract_pair(TINY, TINY_DRAFT if METHODS[method].needs_draft else None)
    exp = lowered(lw.loop_call(method, pair, batch=2, prompt_width=16, max_new_tokens=32,
                               greedy=greedy))
    assert exp.nr_devices == 1


@pytest.mark.parametrize("method,greedy", [(m, True) for m in METHOD_NAMES]
                         + [("speculative", False)])
def test_loop_lowers_on_abstract_mesh(method, greedy):
    pair = lw.abstract_pair(TINY, TINY_DRAFT if METHODS[method].needs_draft else None,
                            mesh=mesh())
    exp = lowered(lw.loop_call(method, pair, batch=4, prompt_width=16, max_new_tokens=32,
                               greedy=greedy))
    assert exp.nr_devices == 8
    # the arguments arrive as the sharding rules place them: the MLP's ffn axis and the
    # vocabulary over "model", the prompt's rows over "data"
    text = exp.mlir_module()
    assert arg_sharding(text, "pair.tparams['layers']['w_gate']") == '[{}, {}, {"model"}]'
    assert arg_sharding(text, "pair.tparams['embed']") == '[{"model"}, {}]'
    assert arg_sharding(text, "prompt") == '[{"data"}, {}]'


@pytest.mark.parametrize("method,on_mesh", [("speculative", False), ("ouroboros", True)])
def test_engine_insert_and_step_lower(method, on_mesh):
    pair = lw.abstract_pair(TINY, TINY_DRAFT, mesh=mesh() if on_mesh else None)
    calls = lw.engine_calls(method, pair, slots=4, cache_slots=128, prompt_width=16)
    assert [c.name for c in calls] == ["engine insert", "engine step, greedy"]
    for call in calls:
        assert lowered(call).nr_devices == (8 if on_mesh else 1)


@pytest.mark.parametrize("config", [TINY, BIG], ids=["tiny", "llama-3.1-8b"])
def test_load_sharded_placement_lowers(config):
    exp = lowered(lw.placement_call(config, mesh()))
    assert exp.nr_devices == 8
    assert not lw.f32_weight_copies(exp.mlir_module(), config)


@pytest.mark.parametrize("method,on_mesh", [("vanilla", False), ("ouroboros", True)])
def test_8b_bf16_loop_lowers_without_f32_weights(method, on_mesh):
    draft = BIG_DRAFT if METHODS[method].needs_draft else None
    pair = lw.abstract_pair(BIG, draft, dtype="bfloat16", mesh=mesh() if on_mesh else None)
    exp = lowered(lw.loop_call(method, pair, batch=2 if on_mesh else 1, prompt_width=128,
                               max_new_tokens=256))
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(pair.tparams))
    copies = lw.f32_weight_copies(exp.mlir_module(), BIG, *([draft] if draft else []))
    assert not copies, f"f32 copies of weights in the bf16 {method} loop: {copies}"


@pytest.fixture
def gpu_kernel():
    """The attention kernel a GPU runs by default, set for tracing; the traces it leaves are
    cleared after (the kernel is read at trace time)."""
    from ouroboros_jax.models import attention

    attention.set_kernel(attention.BY_BACKEND["gpu"])
    jax.clear_caches()
    lw._RUNNERS.clear()
    yield
    attention.set_kernel(None)
    jax.clear_caches()
    lw._RUNNERS.clear()


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_the_gpu_default_program_lowers_for_cuda(method, gpu_kernel):
    """Packed layers and dense attention, what one GPU runs (measured 2.5x faster on an H200
    than the scan and the blockwise loop): it lowers for CUDA with no host callback, and its
    forward holds no while loop (each iteration of one is a trip to the host on a GPU):
    vanilla's module has one, its decoding loop."""
    pair = lw.abstract_pair(TINY, TINY_DRAFT if METHODS[method].needs_draft else None)
    exp = lw.loop_call(method, lw.packed_pair(pair), batch=1, prompt_width=16,
                       max_new_tokens=32).export(("cuda",))
    text = exp.mlir_module()
    assert not lw.host_callbacks(text)
    if method == "vanilla":
        assert lw.while_loops(text) == 1
    if method == "ouroboros":
        stacked = lw.loop_call(method, pair, batch=1, prompt_width=16, max_new_tokens=32)
        assert lw.while_loops(text) < lw.while_loops(stacked.export(("cuda",)).mlir_module())


def test_a_sharded_pair_is_not_packed():
    with pytest.raises(ValueError, match="never packed"):
        lw.packed_pair(lw.abstract_pair(TINY, mesh=mesh()))
