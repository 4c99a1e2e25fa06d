"""The one table of parameter leaves (`models.params.LEAVES`): shapes, sharding axes, HF names
and init all derive from it, for configs with and without qkv biases and tied embeddings."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.llama import init_params, param_shapes
from ouroboros_jax.models.loading import load_params, save_hf_checkpoint
from ouroboros_jax.models.params import LEAVES, leaves_of
from ouroboros_jax.sharding import LOGICAL_AXES


def _config(bias, tie):
    return ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3,
                       num_heads=4, num_kv_heads=2, qkv_bias=bias, tie_word_embeddings=tie,
                       model_type="qwen2" if bias else "llama")


def _names(tree):
    return {k: sorted(v) if isinstance(v, dict) else None for k, v in tree.items()}


CASES = [(False, False), (False, True), (True, False), (True, True)]


@pytest.mark.parametrize("bias,tie", CASES)
def test_everything_derives_from_the_table(bias, tie):
    c = _config(bias, tie)
    shapes = param_shapes(c)
    params = init_params(c, jax.random.key(0))
    leaves = leaves_of(c)
    assert {leaf.name for leaf in leaves if leaf.per_layer} == set(shapes["layers"])
    assert {leaf.name for leaf in leaves if not leaf.per_layer} == set(shapes) - {"layers"}
    assert ("bq" in shapes["layers"]) == bias and ("lm_head" in shapes) == (not tie)
    assert _names(shapes) == _names(params)
    for leaf in leaves:
        shape = shapes["layers"][leaf.name] if leaf.per_layer else shapes[leaf.name]
        arr = params["layers"][leaf.name] if leaf.per_layer else params[leaf.name]
        assert arr.shape == shape == leaf.shape(c)
        assert len(LOGICAL_AXES[leaf.name]) == len(shape)
        if leaf.init == "ones":
            assert np.all(np.asarray(arr) == 1)
        elif leaf.init == "zeros":
            assert np.all(np.asarray(arr) == 0)
    # every parameter leaf has sharding axes; only the cache is added outside the table
    assert set(LOGICAL_AXES) == {leaf.name for leaf in LEAVES} | {"cache"}


@pytest.mark.parametrize("bias,tie", CASES)
def test_export_load_round_trip(tmp_path, bias, tie):
    c = _config(bias, tie)
    params = init_params(c, jax.random.key(1))
    save_hf_checkpoint(str(tmp_path), c, params)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    # the file holds exactly the HF names the table implies, in their HF shapes
    want = {leaf.hf_name(i): leaf.hf_shape(c) for leaf in leaves_of(c)
            for i in (range(c.num_layers) if leaf.per_layer else (None,))}
    assert {k: v.shape for k, v in tensors.items()} == want
    assert json.load(open(os.path.join(tmp_path, "config.json")))["tie_word_embeddings"] == tie
    back = load_params(str(tmp_path), c)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, back)
