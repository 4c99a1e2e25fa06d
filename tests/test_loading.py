"""Strict checkpoint loading: good checkpoints load exactly, bad ones fail naming the culprit."""

import json
import os

import numpy as np
import jax.numpy as jnp
import pytest
import torch
from safetensors.numpy import load_file, save_file

import ouroboros_jax as oj
from ouroboros_jax.models import causal_mask, forward
from ouroboros_jax.models.orbax_io import load_orbax, save_orbax

from conftest import copy_dir as _copy, edit_config as _edit_config, make_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, layers=2)
    return str(d)


def _logits(model, n=20):
    toks = jnp.asarray(np.arange(n)[None] % model.config.vocab_size)
    out, _ = forward(model.params, model.config, toks, jnp.arange(n)[None], causal_mask(1, n))
    return np.asarray(out)


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        oj.load_model("/nonexistent/model")


def test_missing_weights(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        oj.load_model(d)


def test_unsupported_model_type(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, model_type="gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        oj.load_model(d)


def test_unknown_config_field(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, logit_softcapping=30.0)
    with pytest.raises(ValueError, match="logit_softcapping"):
        oj.load_model(d)


def test_unsupported_rope_scaling(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        oj.load_model(d)


def test_shape_mismatch_names_tensor(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
        oj.load_model(d)


def test_truncated_safetensors(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    p = os.path.join(d, "model.safetensors")
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated"):
        oj.load_model(d)


def test_missing_and_unexpected_tensors(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    p = os.path.join(d, "model.safetensors")
    t = load_file(p)
    w = t.pop("model.layers.1.mlp.up_proj.weight")
    save_file(t, p)
    with pytest.raises(ValueError, match=r"lacks tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        oj.load_model(d)
    t["model.layers.1.mlp.up_proj.weight"] = w
    t["model.layers.2.mlp.up_proj.weight"] = w  # a layer the config does not have
    save_file(t, p)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2"):
        oj.load_model(d)


def test_sharded_checkpoint_and_duplicates(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    t = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    keys = sorted(t)
    a, b = keys[: len(keys) // 2], keys[len(keys) // 2:]
    save_file({k: t[k] for k in a}, os.path.join(d, "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in b}, os.path.join(d, "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm.update({k: "model-00002-of-00002.safetensors" for k in b})
    json.dump({"weight_map": wm}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    np.testing.assert_allclose(_logits(oj.load_model(d)), _logits(oj.load_model(hf_dir)),
                               rtol=1e-6)
    # the same tensor in two shards is refused
    save_file({k: t[k] for k in b + [a[0]]}, os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="more than once"):
        oj.load_model(d)


def test_save_hf_round_trip_loads_in_transformers(tmp_path, hf_dir):
    import transformers

    m = oj.load_model(hf_dir)
    out = str(tmp_path / "saved")
    oj.save_hf_checkpoint(out, m.config, m.params)
    tm = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    toks = np.arange(20)[None] % m.config.vocab_size
    with torch.no_grad():
        ref = tm(torch.tensor(toks)).logits.numpy()
    np.testing.assert_allclose(_logits(m), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_logits(oj.load_model(out)), _logits(m), rtol=1e-6)


def test_orbax_round_trip_and_tools(tmp_path, hf_dir):
    from checkpoints_tools import hf_to_orbax, orbax_to_hf

    m = oj.load_model(hf_dir)
    save_orbax(str(tmp_path / "ob"), m)
    np.testing.assert_allclose(_logits(load_orbax(str(tmp_path / "ob"))), _logits(m), rtol=1e-6)
    hf_to_orbax.main([hf_dir, str(tmp_path / "ob2")])
    orbax_to_hf.main([str(tmp_path / "ob2"), str(tmp_path / "hf2")])
    np.testing.assert_allclose(_logits(oj.load_model(str(tmp_path / "hf2"))), _logits(m),
                               rtol=1e-6)


def test_orbax_refuses_params_that_do_not_match_the_config(tmp_path, hf_dir):
    save_orbax(str(tmp_path / "ob"), oj.load_model(hf_dir))
    _edit_config(str(tmp_path / "ob"), intermediate_size=96)
    with pytest.raises(ValueError, match="parameters do not match"):
        load_orbax(str(tmp_path / "ob"))


def test_load_both_runs_the_target_and_draft_loads_at_once():
    """Each load waits for the other to have started: one after the other, the barrier breaks."""
    import threading

    from ouroboros_jax.models.loading import load_both

    met = threading.Barrier(2, timeout=10)

    def load(name):
        met.wait()
        return name

    assert load_both(lambda: load("t"), lambda: load("d")) == ("t", "d")
    assert load_both(lambda: "t") == ("t", None)


def test_load_both_raises_a_loads_error_once_both_loads_ended():
    import threading
    import time

    from ouroboros_jax.models.loading import load_both

    def bad_draft():
        raise ValueError("draft.gguf: tensor blk.0 is short")

    with pytest.raises(ValueError, match="draft.gguf"):
        load_both(lambda: "t", bad_draft)
    ended = threading.Event()

    def slow_draft():
        time.sleep(0.3)
        ended.set()
        return "d"

    def bad_target():
        raise FileNotFoundError("target.gguf")

    with pytest.raises(FileNotFoundError, match="target.gguf"):
        load_both(bad_target, slow_draft)
    assert ended.is_set()  # the draft's thread was waited for, not left loading


def test_cli_generate_with_a_draft_loads_both_and_keeps_vanillas_text(tmp_path, tiny_chat_pair,
                                                                        capsys):
    """`generate --model T --draft D` (the two loaded at once) prints vanilla's text."""
    from ouroboros_jax.cli import main

    target, draft = tiny_chat_pair
    texts = []
    for extra in (["--method", "vanilla"], ["--draft", draft.path, "--method", "speculative"]):
        main(["generate", "--model", target.path, *extra, "--prompt", "abc",
              "--max-new-tokens", "6", "--dtype", "float32", "--compile-cache", "off"])
        texts.append(capsys.readouterr().out)
    assert texts[0].strip() and texts[1] == texts[0]


def test_loads_at_once_pause_the_collector_until_the_last_one_ends():
    import gc

    from ouroboros_jax.heap import gc_paused

    assert gc.isenabled()
    outer = gc_paused()
    outer.__enter__()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other load still runs
    outer.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:  # a caller who had it off keeps it off
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
