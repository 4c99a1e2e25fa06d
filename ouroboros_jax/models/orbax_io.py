"""Orbax save/restore of a model's params, with its config stored beside them as JSON.

Layout of a directory: `config.json` (Hugging Face form, so the same reader validates it) and
`params/` (an Orbax PyTree checkpoint of the stacked params). Tokenizer files, when the model
has a tokenizer, are saved too so the directory is self-contained.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from .config import ModelConfig
from .loading import Model, load_tokenizer


def save_orbax(out_dir: str, model: Model) -> None:
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    ckpt = ocp.PyTreeCheckpointer()
    ckpt.save(os.path.join(out_dir, "params"), model.params, force=True)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(out_dir)


def load_orbax(path: str, dtype=None) -> Model:
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found (not an ouroboros-jax orbax checkpoint)")
    with open(cfg_path) as f:
        config = ModelConfig.from_hf_dict(json.load(f), source=cfg_path)
    pdir = os.path.join(path, "params")
    if not os.path.isdir(pdir):
        raise FileNotFoundError(f"{pdir} not found (orbax params missing)")
    params = ocp.PyTreeCheckpointer().restore(pdir)
    params = jax.tree.map(lambda x: jax.numpy.asarray(x, dtype) if dtype else
                          jax.numpy.asarray(x), params)
    from .llama import param_shapes

    want = param_shapes(config)
    got = jax.tree.map(lambda x: tuple(np.shape(x)), params)
    want_t = jax.tree.map(tuple, want, is_leaf=lambda x: isinstance(x, tuple))
    if got != want_t:
        raise ValueError(f"{pdir}: parameter shapes {got} do not match config {want_t}")
    return Model(config=config, params=params, tokenizer=load_tokenizer(path), path=path)
