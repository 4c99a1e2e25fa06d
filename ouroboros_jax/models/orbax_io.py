"""Orbax save/restore of a model's params, with its config stored beside them as JSON.

Layout of a directory: `config.json` (Hugging Face form, so the same reader validates it) and
`params/` (an Orbax PyTree checkpoint of the stacked params). Tokenizer files, when the model
has a tokenizer, are saved too so the directory is self-contained.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .llama import init_params
from .loading import Model, load_tokenizer


def save_orbax(out_dir: str, model: Model) -> None:
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = str(model.params["embed"].dtype)  # what the restore target expects
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with ocp.StandardCheckpointer() as ckpt:
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
        raw = json.load(f)
    config = ModelConfig.from_hf_dict(raw, source=cfg_path)
    pdir = os.path.join(path, "params")
    if not os.path.isdir(pdir):
        raise FileNotFoundError(f"{pdir} not found (orbax params missing)")
    stored = jnp.dtype(raw.get("torch_dtype") or "float32")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        jax.eval_shape(lambda k: init_params(config, k, stored), jax.random.key(0)))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore(pdir, abstract)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{pdir}: parameters do not match {cfg_path} ({e})") from None
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    return Model(config=config, params=params, tokenizer=load_tokenizer(path), path=path)
