"""Engine-level choices: the dtype load_model picks by backend."""

import logging

import jax.numpy as jnp

from ouroboros_jax.models import loading


def test_auto_dtype_by_backend(caplog, tiny_pair):
    loading._auto_said.clear()
    with caplog.at_level(logging.INFO, logger=loading.__name__):
        assert loading.resolve_dtype("auto", "cpu") == "float32"
        assert loading.resolve_dtype("auto", "cpu") == "float32"
        assert loading.resolve_dtype("auto", "gpu") == "bfloat16"
        assert loading.resolve_dtype("auto", "tpu") == "bfloat16"
    said = [r.getMessage() for r in caplog.records if "dtype='auto'" in r.getMessage()]
    assert len(said) == 3 and "float32 on cpu" in said[0]  # once per backend
    assert loading.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    target = tiny_pair[0]
    m = loading.load_model(target.path)  # the default is "auto": fp32 on this CPU
    assert m.dtype == jnp.float32
