"""Strict loading and saving of Hugging Face Llama-family checkpoints, all local.

A directory holds `config.json`, `model.safetensors` or a sharded `model.safetensors.index.json`
(when both are present, `model.safetensors` is read, as transformers does), optionally
`generation_config.json` (its `eos_token_id` is `generate`'s default, as in transformers) and
tokenizer files. Loading is strict: every parameter is filled exactly once, every shape is
checked against the config, only floating-point tensors are accepted (an int8/bool tensor
belongs to a quantized or foreign checkpoint that a plain cast would turn into wrong weights),
and any problem raises a `ValueError` (or `FileNotFoundError`) naming the file, key or field,
because a half-loaded model still produces fluent-looking wrong text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .llama import Params, param_shapes

# HF name inside a layer -> (our leaf, transform from the HF [out, in] layout to ours)
_LAYER_KEYS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class Model:
    """A loaded model: static config, params pytree, optional tokenizer, where it came from."""

    config: ModelConfig
    params: Params
    tokenizer: Any = None
    path: Optional[str] = None
    # generation_config.json's fields (eos_token_id, ...), {} when the directory has none
    generation_config: dict = dataclasses.field(default_factory=dict)
    # mesh -> this model placed on it (sharding.shard_model); lives and dies with the model
    _sharded: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                       compare=False)

    @property
    def dtype(self):
        return self.params["embed"].dtype


def _hf_to_ours(leaf: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    if leaf == "wq":
        return w.T.reshape(E, H, D)
    if leaf in ("wk", "wv"):
        return w.T.reshape(E, K, D)
    if leaf == "wo":
        return w.T.reshape(H, D, E)
    if leaf == "bq":
        return w.reshape(H, D)
    if leaf in ("bk", "bv"):
        return w.reshape(K, D)
    if leaf in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def _ours_to_hf(leaf: str, w: np.ndarray) -> np.ndarray:
    if leaf in ("wq", "wk", "wv"):
        return w.reshape(w.shape[0], -1).T
    if leaf == "wo":
        return w.reshape(-1, w.shape[-1]).T
    if leaf in ("bq", "bk", "bv"):
        return w.reshape(-1)
    if leaf in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def _hf_shape(leaf: str, ours: tuple) -> tuple:
    """The HF tensor shape corresponding to one layer's slice of our leaf."""
    return _ours_to_hf(leaf, np.empty(ours, np.int8)).shape


def read_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found (a Hugging Face model directory needs "
                                "config.json)")
    try:
        with open(cfg_path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    return ModelConfig.from_hf_dict(d, source=cfg_path)


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    # transformers' precedence: model.safetensors wins over an index next to it
    if not os.path.isfile(single) and os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index} is malformed: {e!r}") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v and os.path.basename(v) == v
                for k, v in weight_map.items()):
            raise ValueError(f"{index}: field 'weight_map' must be an object mapping tensor "
                             "names to shard file names in the same directory")
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(path, fn)):
                raise FileNotFoundError(f"{index} names shard {fn!r}, which is missing")
        return [os.path.join(path, fn) for fn in files]
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json "
                            "found (only safetensors checkpoints are supported)")


def _read_tensors(files: list[str]):
    """Yields (file, key, np.ndarray) for every tensor; corrupt files raise naming the file."""
    from safetensors import SafetensorError, safe_open

    for fn in files:
        try:
            with safe_open(fn, framework="np") as f:
                for key in f.keys():
                    yield fn, key, f.get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f"{fn}: corrupt or truncated safetensors file ({e})") from None


def load_params(path: str, config: ModelConfig, dtype=jnp.float32) -> Params:
    """Reads every tensor of the checkpoint into our stacked layout, strictly."""
    shapes = param_shapes(config)
    L = config.num_layers
    layer_slices: dict[str, list] = {k: [None] * L for k in shapes["layers"]}
    top: dict[str, Optional[np.ndarray]] = {k: None for k in shapes if k != "layers"}
    top_names = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
                 "lm_head.weight": "lm_head"}
    np_dtype = jnp.dtype(dtype)

    for fn, key, w in _read_tensors(_weight_files(path)):
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"{fn}: tensor {key} has dtype {w.dtype}; only floating-point "
                             "checkpoints are supported (quantized or integer weights would be "
                             "cast into wrong values)")
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        if key in top_names:
            leaf = top_names[key]
            want = shapes[leaf]
            got = w.T if leaf == "lm_head" else w
            if tuple(got.shape) != tuple(want):
                raise ValueError(f"{fn}: tensor {key} has shape {tuple(w.shape)}, config "
                                 f"implies {tuple(want[::-1]) if leaf == 'lm_head' else want}")
            if top[leaf] is not None:
                raise ValueError(f"{fn}: tensor {key} appears more than once")
            top[leaf] = got.astype(np_dtype)
            continue
        parts = key.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
            try:
                i = int(parts[2])
            except ValueError:
                i = -1
            sub = ".".join(parts[3:])
            if 0 <= i < L and sub in _LAYER_KEYS and _LAYER_KEYS[sub] in layer_slices:
                leaf = _LAYER_KEYS[sub]
                want = _hf_shape(leaf, shapes["layers"][leaf][1:])
                if tuple(w.shape) != tuple(want):
                    raise ValueError(f"{fn}: tensor {key} has shape {tuple(w.shape)}, config "
                                     f"implies {tuple(want)}")
                if layer_slices[leaf][i] is not None:
                    raise ValueError(f"{fn}: tensor {key} appears more than once")
                layer_slices[leaf][i] = _hf_to_ours(leaf, w, config).astype(np_dtype)
                continue
        raise ValueError(f"{fn}: unexpected tensor {key!r} (not part of a {config.model_type} "
                         f"model with {L} layers as configured)")

    missing = [n for n, leaf in top_names.items() if leaf in top and top[leaf] is None]
    for leaf, slices in layer_slices.items():
        hf = next(k for k, v in _LAYER_KEYS.items() if v == leaf)
        missing += [f"model.layers.{i}.{hf}" for i, s in enumerate(slices) if s is None]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{path}: checkpoint lacks tensor(s) {missing[:5]}{more}")
    params = {k: jnp.asarray(v) for k, v in top.items()}
    params["layers"] = {k: jnp.asarray(np.stack(v)) for k, v in layer_slices.items()}
    return params


def load_tokenizer(path: str):
    """transformers' tokenizer from the directory, or None when it has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    for n in ("tokenizer.json", "tokenizer_config.json"):
        fn = os.path.join(path, n)
        if os.path.isfile(fn):
            try:
                with open(fn, encoding="utf-8") as f:
                    json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{fn} is not valid JSON (truncated?): {e}") from None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers/tokenizers raise many types, none naming the file
        raise ValueError(f"{path}: the tokenizer files could not be loaded "
                         f"({type(e).__name__}: {e})") from None


def read_generation_config(path: str) -> dict:
    """generation_config.json as a dict ({} when absent); its eos_token_id is validated."""
    from .config import normalize_eos

    fn = os.path.join(path, "generation_config.json")
    if not os.path.isfile(fn):
        return {}
    try:
        with open(fn) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{fn} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{fn}: must hold a JSON object, got a {type(d).__name__}")
    if "eos_token_id" in d:
        d["eos_token_id"] = normalize_eos(d["eos_token_id"], f"{fn}: field 'eos_token_id'")
    return d


_auto_said: set = set()


def resolve_dtype(dtype, backend: Optional[str] = None):
    """"auto" -> bfloat16 on GPU/TPU, float32 on CPU (XLA:CPU runs bf16 5-9x slower than fp32
    on the demo pair), said once per backend in a log line; any other value is returned as is."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return dtype
    import jax

    backend = backend or jax.default_backend()
    chosen = "float32" if backend == "cpu" else "bfloat16"
    if backend not in _auto_said:
        _auto_said.add(backend)
        logging.getLogger(__name__).info(
            "load_model(dtype='auto'): %s on %s (bfloat16 on gpu/tpu, float32 on cpu)",
            chosen, backend)
    return chosen


def load_model(path: str, dtype: str | jnp.dtype = "auto") -> Model:
    """Loads a local Hugging Face Llama/Mistral/Qwen2 directory.

    dtype: "auto" (bfloat16 on GPU/TPU, float32 on CPU), "float32" or "bfloat16" (params are
    cast; RoPE and softmax always run in fp32).
    """
    dtype = resolve_dtype(dtype)
    if str(jnp.dtype(dtype)) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a directory path, got {type(path).__name__}")
    path = os.fspath(path)
    config = read_config(path)
    gen = read_generation_config(path)
    params = load_params(path, config, jnp.dtype(dtype))
    return Model(config=config, params=params, tokenizer=load_tokenizer(path), path=path,
                 generation_config=gen)


def save_hf_checkpoint(out_dir: str, config: ModelConfig, params: Params,
                       dtype: str | jnp.dtype | None = None, tokenizer=None) -> None:
    """Writes config.json + model.safetensors that transformers (and load_model) load."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    cast = (lambda x: np.asarray(x).astype(jnp.dtype(dtype))) if dtype else np.asarray
    tensors = {"model.embed_tokens.weight": cast(params["embed"]),
               "model.norm.weight": cast(params["final_norm"])}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = np.ascontiguousarray(cast(params["lm_head"]).T)
    for leaf, stacked in params["layers"].items():
        hf = next(k for k, v in _LAYER_KEYS.items() if v == leaf)
        arr = cast(stacked)
        for i in range(config.num_layers):
            tensors[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(_ours_to_hf(leaf, arr[i]))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    d = config.to_hf_dict()
    d["torch_dtype"] = str(jnp.dtype(dtype)) if dtype else str(params["embed"].dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
