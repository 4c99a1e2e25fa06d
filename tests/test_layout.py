"""The packed layout decoding runs on one CPU or GPU (models/layout.py): the same tokens as the
stacked layout for every method, packed only where it pays, never for sharded params, counted by
the memory planner; the GPU's default program (packed layers, dense attention) run here. (Logits
against transformers in both layouts: test_model.py.)"""

import dataclasses
import shutil

import jax
import pytest

import ouroboros_jax as oj
from ouroboros_jax.bounds import estimate_bytes
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.decoding.common import make_pair
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.prompt_lookup import PromptLookupConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig
from ouroboros_jax.models import few_rows, layout


@pytest.fixture
def packing():
    """set_packing for one test, back to the per-device choice after it."""
    yield layout.set_packing
    layout.set_packing(None)


CALLS = [("vanilla", None), ("speculative", SpeculativeConfig(gamma=3)),
         ("ouroboros", OuroborosConfig(gamma=3, window=2, ngram=3, guesses=2, suffixes=2)),
         ("prompt_lookup", PromptLookupConfig(candidates=2, length=3))]


@pytest.mark.parametrize("method, cfg", CALLS, ids=[m for m, _ in CALLS])
def test_every_method_gives_the_same_tokens_packed(tiny_pair, random_prompts, packing, method,
                                                   cfg):
    target, draft, _ = tiny_pair
    kw = dict(method=method, config=cfg, max_new_tokens=16, eos_token_id=-1,
              draft=draft if METHODS[method].needs_draft else None)
    prompts = random_prompts[:3]
    packing(False)
    ref = oj.generate(target, prompts, **kw).tokens
    packing(True)
    assert oj.generate(target, prompts, **kw).tokens == ref
    sampled = dict(kw, temperature=0.8, top_p=0.9, seed=3)
    packing(False)
    ref = oj.generate(target, prompts, **sampled).tokens
    packing(True)
    assert oj.generate(target, prompts, **sampled).tokens == ref


def test_packing_follows_device_size_and_override(tiny_pair, packing):
    target, draft, _ = tiny_pair
    # a tiny model on a CPU stays stacked (below PACK_MIN_BYTES): nothing copied, nothing counted
    assert layout.weight_bytes(target.params) < layout.PACK_MIN_BYTES
    assert not layout.wants_packing(target.params)
    assert make_pair(target, draft).tparams is target.params
    assert layout.packed_bytes(target) == 0
    packing("fused")
    # the planner counts the copy before it exists: every layer's weights (and a tied
    # model's transposed head)
    model = dataclasses.replace(target)  # a Model of its own: nothing packed yet
    spec = METHODS["vanilla"]
    with_copy = estimate_bytes(spec, None, model, None, 1, 8, 64)
    extra = layout.weight_bytes(model.params["layers"]) + (
        model.params["embed"].nbytes if model.config.tie_word_embeddings else 0)
    assert layout.packed_bytes(model) == extra
    pair = make_pair(model, draft)
    assert layout.is_packed(pair.tparams) and layout.is_packed(pair.dparams)
    assert len(pair.tparams["layers"]) == model.config.num_layers
    assert layout.pack(pair.tparams, model.config) is pair.tparams  # packing is idempotent
    # made once per model: the next pair reuses it, and nothing more is counted
    assert make_pair(model).tparams is pair.tparams and layout.packed_bytes(model) == 0
    assert estimate_bytes(spec, None, model, None, 1, 8, 64) == with_copy - extra
    # new params (the same Model object) are packed anew
    model.params = jax.tree.map(lambda x: x + 0, model.params)
    assert layout.packed_bytes(model) == extra and make_pair(model).tparams is not pair.tparams
    # released, the copy is counted again and the next pair packs anew
    packed_now = make_pair(model).tparams
    layout.release(model)
    assert layout.packed_bytes(model) == extra and make_pair(model).tparams is not packed_now
    with pytest.raises(ValueError, match="set_packing: enabled"):
        layout.set_packing("yes")


def test_a_cpu_packs_views_that_cost_no_bytes(tiny_pair, packing):
    """On a CPU the packed layout is views of the stacked buffers (`view_pack`): every packed
    array lies inside a canonical one, the planner counts nothing for it, and a tied model
    keeps no transposed head."""
    target, draft, _ = tiny_pair
    packing(True)
    model = dataclasses.replace(target)  # a Model of its own: nothing packed yet
    assert layout.packs_by_views(model.params) and layout.packed_bytes(model) == 0
    packed = make_pair(model).tparams
    assert layout.is_packed(packed) and len(packed["layers"]) == model.config.num_layers
    assert layout.shares_buffers(packed, model.params)
    assert packed["embed"] is model.params["embed"]
    assert ("head_t" in packed) == (not model.config.tie_word_embeddings)
    lay = model.params["layers"]
    for i in (0, model.config.num_layers - 1):  # layer i's views hold layer i's values
        for name in lay:
            assert (packed["layers"][i][name] == lay[name][i]).all()
    # the fused copy is a buffer of its own
    packing("fused")
    fused = make_pair(dataclasses.replace(target)).tparams
    assert not layout.shares_buffers(fused, target.params)


def test_sharded_params_are_never_packed(tiny_target, packing):
    from ouroboros_jax.sharding import make_mesh, shard_model

    mesh = make_mesh(data=1, model=2)
    sharded = shard_model(tiny_target, mesh)
    packing(True)
    assert not layout.wants_packing(sharded.params)
    assert make_pair(sharded).tparams is sharded.params
    out = oj.generate(tiny_target, [[5, 6, 7]], max_new_tokens=6, mesh=mesh, eos_token_id=-1)
    packing(None)
    assert out.tokens == oj.generate(tiny_target, [[5, 6, 7]], max_new_tokens=6,
                                     eos_token_id=-1).tokens


class _Device:
    """A device as `gpu_has_room` reads it: its allocator's stats, or none."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_a_gpu_packs_when_the_copy_fits_with_as_much_to_spare():
    gb = 2**30
    dev = _Device({"bytes_limit": 10 * gb, "bytes_in_use": 2 * gb})  # 8 GiB free
    assert layout.gpu_has_room(dev, 4 * gb)  # the copy, and as much again
    assert not layout.gpu_has_room(dev, 4 * gb + 1)
    assert not layout.gpu_has_room(_Device(None), 1)  # no stats: not packed
    assert not layout.gpu_has_room(_Device(RuntimeError("no stats")), 1)


def test_a_gpu_keeps_the_copy_it_made(tiny_pair, packing, monkeypatch):
    """Asked again, a GPU would count its own copy against its room: once made, the copy is
    kept, so the layout (and the compiled program) does not change between calls."""
    target, _, _ = tiny_pair
    model = dataclasses.replace(target)  # a Model of its own: nothing packed yet
    room = {"free": True}
    gpu = _Device(None)
    gpu.platform = "gpu"
    monkeypatch.setattr(layout, "params_devices", lambda params: {gpu})
    monkeypatch.setattr(layout, "gpu_has_room", lambda device, n: room["free"])
    packed = make_pair(model).tparams
    assert layout.is_packed(packed)
    room["free"] = False  # the copy now takes the room it was measured against
    assert make_pair(model).tparams is packed
    assert not layout.wants_packing(model.params)  # a model with no copy would not pack now
    packing(False)
    assert make_pair(model).tparams is model.params


@pytest.mark.parametrize("method, cfg", CALLS[1:], ids=[m for m, _ in CALLS[1:]])
def test_the_gpu_default_program_is_exact(tiny_pair, random_prompts, packing, monkeypatch,
                                          method, cfg):
    """Packed layers and dense attention, what a GPU runs by default, here on the CPU: every
    method's greedy tokens equal vanilla's under the same program, and the stacked blockwise
    program's. The kernel is read at trace time: caches are cleared around the switch, and the
    dense kernel is seen being traced."""
    from ouroboros_jax.models import attention

    target, draft, _ = tiny_pair
    prompts = random_prompts[:3]
    kw = dict(max_new_tokens=16, eos_token_id=-1)
    ref = oj.generate(target, prompts, **kw).tokens
    traced = []
    dense = attention.KERNELS["dense"]
    monkeypatch.setitem(attention.KERNELS, "dense",
                        lambda *a, **k: traced.append(1) or dense(*a, **k))
    packing("fused")  # the GPU's packed copy (a CPU packs views)
    attention.set_kernel("dense")
    jax.clear_caches()
    try:
        assert oj.generate(target, prompts, **kw).tokens == ref
        got = oj.generate(target, prompts, method=method, config=cfg, draft=draft, **kw)
    finally:
        attention.set_kernel(None)
        jax.clear_caches()
    assert traced
    assert got.tokens == ref


def _live_spans() -> list:
    """[start, end) of the buffer under every live one-device jax array (an earlier test's
    sharded arrays have no single buffer)."""
    import gc

    gc.collect()  # what an earlier test dropped goes now, not during the call measured
    return [(a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes)
            for a in jax.live_arrays() if not a.is_deleted() and len(a.devices()) == 1]


def _new_bytes(before: list) -> int:
    """Bytes of the live buffers that lie outside every span of `before` (each counted once):
    what a call added and still holds; a view of a buffer live before adds nothing."""
    new = {lo: hi - lo for lo, hi in _live_spans()
           if not any(b_lo <= lo and hi <= b_hi for b_lo, b_hi in before)}
    return sum(new.values())


@pytest.mark.parametrize("kind", [True, "fused"], ids=["cpu-views", "fused-copy"])
def test_a_model_holds_one_copy_of_its_weights_after_decoding(tiny_target, packing, kind):
    """After a packed call, the buffers it added and still holds are less than the layers'
    weights on a CPU (views), and at least them with the fused copy (so the count sees a
    second copy)."""
    model = dataclasses.replace(tiny_target)  # a Model of its own: nothing packed yet
    packing(kind)
    layers = layout.weight_bytes(model.params["layers"])
    before = _live_spans()
    out = oj.generate(model, [[5, 6, 7]], max_new_tokens=4, eos_token_id=-1)
    assert layout.is_packed(model.derived_copy(layout.PACKED))  # the call packed, and kept it
    grown = _new_bytes(before)
    if kind is True:
        assert grown < layers // 2, (grown, layers)
    else:
        assert grown >= layers, (grown, layers)
    packing(False)
    assert out.tokens == oj.generate(model, [[5, 6, 7]], max_new_tokens=4,
                                     eos_token_id=-1).tokens


@pytest.mark.skipif(not few_rows.cpu_has_avx512() or shutil.which("g++") is None,
                    reason="the few-row kernel needs an AVX-512 CPU and g++")
def test_a_packed_verification_scans_its_layers_in_place(tmp_path, packing, monkeypatch):
    """Packed views on a CPU with the kernel on: a verification-sized forward (2-16 rows)
    scans its layers, each product reading its layer of the stack in place, so its program
    holds one layer's products whatever the depth (a 3-layer Qwen2, biases sliced per layer);
    its logits are the unrolled forward's up to float32 rounding (its small products run
    through the kernel rather than XLA's). One row stays unrolled."""
    import jax.numpy as jnp
    import numpy as np

    from conftest import make_hf_model
    from ouroboros_jax.models import llama
    from ouroboros_jax.models import forward

    assert few_rows._registered() is not None
    monkeypatch.setattr(few_rows, "enabled", lambda: True)
    make_hf_model(tmp_path, model_type="qwen2", layers=3)
    model = oj.load_model(str(tmp_path))
    cfg = model.config
    assert cfg.num_layers == 3 and cfg.qkv_bias
    packing(True)
    params = layout.decode_params(model)
    assert layout.STACKED in params and layout.shares_buffers(params, model.params)
    assert llama.scans_in_place(params, cfg, 9, jnp.float32)
    assert not llama.scans_in_place(params, cfg, 1, jnp.float32)
    tokens = jnp.asarray([[1, 5, 9, 14, 3, 7, 22, 8, 4]], jnp.int32)
    positions = jnp.arange(9, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((9, 9), bool))[None]
    run = jax.jit(lambda p, t: forward(p, cfg, t, positions, mask)[0])
    text = run.lower(params, tokens).as_text()
    assert text.count(few_rows.AT_TARGET) == 7  # q, k, v, o, gate, up, down: once, not 3x
    scanned = np.asarray(run(params, tokens))
    monkeypatch.setattr(llama, "scans_in_place", lambda *a: False)
    unrolled_run = jax.jit(lambda p, t: forward(p, cfg, t, positions, mask)[0])
    assert unrolled_run.lower(params, tokens).as_text().count(few_rows.AT_TARGET) == 0
    unrolled = np.asarray(unrolled_run(params, tokens))
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-4, atol=1e-4)
    assert np.array_equal(scanned.argmax(-1), unrolled.argmax(-1))
