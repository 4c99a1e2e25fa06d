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

import json
import os
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .llama import Params
from .families import family_of
from .model import Model
from .params import LEAVES, Leaf, fused_parts, leaves_of, nest

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(path):  # e.g. <dir>/config.json itself: say so, not "does not exist"
        raise ValueError(f"{path!r} is a file; pass the model directory that holds config.json "
                         f"and the weights ({os.path.dirname(os.path.abspath(path))!r})")
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


def _split_fused(items, config: ModelConfig):
    """(file, key, array) items with each key renamed as the family's `hf_renames` say
    (Mixtral's w1/w2/w3 into our expert names), each fused tensor (`params.fused_parts`,
    Phi-3's qkv_proj and gate_up_proj) replaced by its parts under their own names and each
    stacked expert tensor (`stacked_expert_parts`) by its experts' own; a fused tensor of the
    wrong shape raises naming it (its columns are checked as each part's)."""
    fused = fused_parts(config)
    renames = family_of(config.model_type).hf_renames
    stacked = stacked_expert_parts(config)
    for fn, key, w in items:
        key = rename_hf(key, renames)
        if key in stacked:
            yield from ((fn, name, part) for name, part in _split_stacked(fn, key, w,
                                                                          stacked[key], config))
            continue
        if key not in fused:
            yield fn, key, w
            continue
        rows = fused[key][-1][2]
        if w.ndim != 2 or w.shape[0] != rows:
            raise ValueError(f"{fn}: tensor {key} has shape {tuple(w.shape)}, config implies "
                             f"{rows} rows ({', '.join(p for p, _, _ in fused[key])} fused)")
        for name, a, b in fused[key]:
            yield fn, name, w[a:b]


def rename_hf(key: str, renames) -> str:
    """A checkpoint's tensor name in our spelling: each (theirs, ours) substring of the
    family's `hf_renames` replaced."""
    for theirs, ours in renames:
        key = key.replace(theirs, ours)
    return key


def name_hf(key: str, renames) -> str:
    """Our tensor name in the family's spelling (the inverse of `rename_hf`)."""
    for theirs, ours in reversed(renames):
        key = key.replace(ours, theirs)
    return key


# transformers' in-memory layout of a layer's experts (what its loader builds from the
# per-expert tensors, and what a checkpoint saved without its conversion holds): gate and up of
# every expert in one [Y, 2F, E] tensor, down in one [Y, E, F]
_STACKED_EXPERTS = {"model.layers.{i}.mlp.experts.gate_up_proj": ("we_gate", "we_up"),
                    "model.layers.{i}.mlp.experts.down_proj": ("we_down",)}


def stacked_expert_parts(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each stacked expert tensor name of an MoE config (`_STACKED_EXPERTS`, layer filled in)
    -> the expert leaves it holds, in row order; {} for a dense config."""
    if not config.is_moe:
        return {}
    return {name.format(i=i): leaves for name, leaves in _STACKED_EXPERTS.items()
            for i in range(config.num_layers)}


def _split_stacked(fn: str, key: str, w: np.ndarray, leaves: tuple, config: ModelConfig):
    """A stacked expert tensor [Y, rows, cols] -> [(expert j's tensor name of each leaf, its
    HF array)]; ValueError naming the tensor for a wrong shape."""
    from .params import LEAF_BY_NAME

    i = int(key.split(".")[2])
    parts = [LEAF_BY_NAME[n] for n in leaves]
    rows = [leaf.hf_shape(config)[0] for leaf in parts]
    want = (config.num_experts, sum(rows), parts[0].hf_shape(config)[1])
    if tuple(w.shape) != want:
        raise ValueError(f"{fn}: tensor {key} has shape {tuple(w.shape)}, config implies {want} "
                         f"({' and '.join(leaves)} of {config.num_experts} experts)")
    bounds = np.cumsum([0] + rows)
    for j in range(config.num_experts):
        for leaf, a, b in zip(parts, bounds, bounds[1:]):
            yield leaf.hf_name(i, j), w[j, a:b]


def _hf_names(config: ModelConfig) -> dict[str, Leaf]:
    """HF tensor name -> its leaf, for every tensor the config implies (table order)."""
    return {leaf.hf_name(i, j): leaf for leaf in leaves_of(config)
            for i, j in leaf.hf_keys(config)}


def load_params(path: str, config: ModelConfig, dtype=jnp.float32) -> Params:
    """Reads every tensor of the checkpoint into our stacked layout, strictly: the tensors are
    exactly those the config implies (`params.LEAVES`), each once, each of its HF shape."""
    names = _hf_names(config)
    skipped = {leaf.hf for leaf in LEAVES
               if leaf.ignored_when_absent and not leaf.present(config)}
    got: dict[str, Optional[np.ndarray]] = dict.fromkeys(names)
    np_dtype = jnp.dtype(dtype)

    for fn, key, w in _split_fused(_read_tensors(_weight_files(path)), config):
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"{fn}: tensor {key} has dtype {w.dtype}; only floating-point "
                             "checkpoints are supported (quantized or integer weights would be "
                             "cast into wrong values)")
        if key in skipped:
            continue  # e.g. some tied checkpoints store the shared matrix twice
        if key not in names:
            raise ValueError(f"{fn}: unexpected tensor {key!r} (not part of a "
                             f"{config.model_type} model with {config.num_layers} layers "
                             "as configured)")
        leaf = names[key]
        want = leaf.hf_shape(config)
        if tuple(w.shape) != want:
            raise ValueError(f"{fn}: tensor {key} has shape {tuple(w.shape)}, config "
                             f"implies {want}")
        if got[key] is not None:
            raise ValueError(f"{fn}: tensor {key} appears more than once")
        got[key] = leaf.from_hf(w, config).astype(np_dtype)

    missing = [k for k, v in got.items() if v is None]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{path}: checkpoint lacks tensor(s) {missing[:5]}{more}")
    return nest(config, lambda leaf: jnp.asarray(leaf.stack(
        config, [got[leaf.hf_name(i, j)] for i, j in leaf.hf_keys(config)])))


# ------------------------------------------------------------------ slice-wise reading
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _tensor_table(files: list[str], config: ModelConfig) -> dict[str, tuple[str, str, int]]:
    """HF tensor name (ours) -> (the file holding it, its name there, its first row there: a
    part of a fused tensor starts below row 0), for every tensor the config implies, checked as
    strictly as `load_params` checks (dtype, shape, once each, nothing missing or unexpected)
    from the files' headers alone: no tensor data is read."""
    from safetensors import SafetensorError, safe_open

    names = _hf_names(config)
    skipped = {leaf.hf for leaf in LEAVES
               if leaf.ignored_when_absent and not leaf.present(config)}
    fused = fused_parts(config)
    renames = family_of(config.model_type).hf_renames
    stacked = stacked_expert_parts(config)
    where: dict[str, str] = {}
    for fn in files:
        try:
            with safe_open(fn, framework="np") as f:
                for stored in f.keys():
                    if stored.endswith(_IGNORED_SUFFIXES):
                        continue
                    key = rename_hf(stored, renames)
                    if key in stacked:
                        raise ValueError(f"{fn}: tensor {stored} holds every expert of a layer "
                                         "in one tensor; slice-wise reading needs one tensor "
                                         "per expert (as save_pretrained writes): load it "
                                         "whole with load_model and place it with "
                                         "sharding.shard_model")
                    sl = f.get_slice(stored)
                    dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
                    if dtype not in _FLOAT_DTYPES:
                        raise ValueError(f"{fn}: tensor {key} has dtype {dtype}; only "
                                         "floating-point checkpoints are supported (quantized "
                                         "or integer weights would be cast into wrong values)")
                    if key in skipped:
                        continue
                    parts = fused.get(key)
                    if parts is not None:  # Phi-3's q/k/v or gate/up in one tensor
                        want = (parts[-1][2], names[parts[0][0]].hf_shape(config)[1])
                        if shape != want:
                            raise ValueError(f"{fn}: tensor {key} has shape {shape}, config "
                                             f"implies {want}")
                        for part, row0, _ in parts:
                            if part in where:
                                raise ValueError(f"{fn}: tensor {part} appears more than once")
                            where[part] = (fn, stored, row0)
                        continue
                    if key not in names:
                        raise ValueError(f"{fn}: unexpected tensor {key!r} (not part of a "
                                         f"{config.model_type} model with {config.num_layers} "
                                         "layers as configured)")
                    want = names[key].hf_shape(config)
                    if shape != want:
                        raise ValueError(f"{fn}: tensor {key} has shape {shape}, config "
                                         f"implies {want}")
                    if key in where:
                        raise ValueError(f"{fn}: tensor {key} appears more than once")
                    where[key] = (fn, stored, 0)
        except SafetensorError as e:
            raise ValueError(f"{fn}: corrupt or truncated safetensors file ({e})") from None
    missing = [k for k in names if k not in where]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{os.path.dirname(files[0])}: checkpoint lacks tensor(s) "
                         f"{missing[:5]}{more}")
    return where


def _flat_range(sizes: tuple, block: list) -> Optional[tuple[int, int]]:
    """A block [(start, stop) per dim] of an array of these dims, as the [start, stop) range of
    its row-major flattening; None when the block is not one contiguous range there."""
    partial = [d for d, (a, b) in enumerate(block) if (a, b) != (0, sizes[d])]
    j = partial[-1] if partial else 0
    if any(block[d][1] - block[d][0] != 1 for d in range(j)):
        return None
    stride = [int(np.prod(sizes[d + 1:])) for d in range(len(sizes))]
    start = sum(block[d][0] * stride[d] for d in range(j + 1))
    return start, start + (block[j][1] - block[j][0]) * stride[j]


def _read_block(f, key: str, leaf: Leaf, config: ModelConfig, block: list,
                row0: int = 0) -> np.ndarray:
    """The block [(start, stop) per dim of one layer's slice in our layout] of tensor `key`,
    reading only that block's bytes where the HF layout keeps it contiguous (a head or FFN
    range of a Linear weight is a range of its rows or columns), else the whole tensor.
    row0: where the leaf's rows start in `key` (a part of a fused tensor, Phi-3)."""
    ours = leaf.slice_shape(config)
    sl = f.get_slice(key)
    out_shape = tuple(b - a for a, b in block)
    if leaf.hf_layout == "same":
        return sl[tuple(slice(a, b) for a, b in block)]
    if leaf.hf_layout == "flat":
        r = _flat_range(ours, block)
        if r is not None:
            return sl[r[0]:r[1]].reshape(out_shape)
    else:  # "linear": HF [prod(out dims), prod(in dims)]
        k = leaf.hf_in_dims
        cols, rows = _flat_range(ours[:k], block[:k]), _flat_range(ours[k:], block[k:])
        if cols is not None and rows is not None:
            return sl[row0 + rows[0]:row0 + rows[1], cols[0]:cols[1]].T.reshape(out_shape)
    whole = leaf.from_hf(f.get_tensor(key)[row0:row0 + leaf.hf_shape(config)[0]], config)
    return whole[tuple(slice(a, b) for a, b in block)]


def _read_tensor(handles, where, leaf: Leaf, config: ModelConfig, block: list,
                 i: Optional[int] = None, j: Optional[int] = None) -> np.ndarray:
    """`_read_block` of the leaf's HF tensor of layer i (and expert j), from its own tensor or
    its rows of a fused one."""
    fn, key, row0 = where[leaf.hf_name(i, j)]
    return _read_block(handles[fn], key, leaf, config, block, row0)


def _read_leaf_block(handles, where, leaf: Leaf, config: ModelConfig,
                     block: list) -> np.ndarray:
    """The block [(start, stop) per dim of our layout] of a whole leaf, one HF tensor at a
    time: over its layers (and experts) when it is stored per layer (per expert)."""
    if not leaf.per_layer:
        return _read_tensor(handles, where, leaf, config, block)
    (l0, l1), rest = block[0], block[1:]
    if not leaf.per_expert:
        return np.stack([_read_tensor(handles, where, leaf, config, rest, i)
                         for i in range(l0, l1)])
    (e0, e1), rest = rest[0], rest[1:]
    return np.stack([np.stack([_read_tensor(handles, where, leaf, config, rest, i, j)
                               for j in range(e0, e1)]) for i in range(l0, l1)])


def load_params_sliced(path: str, config: ModelConfig, dtype, shardings) -> Params:
    """The checkpoint's params placed with `shardings` (a params-shaped pytree of
    `jax.sharding.Sharding`), each process reading only the blocks its own devices hold
    (`jax.make_array_from_callback`): checked as strictly as `load_params`, from the headers,
    before any data is read. A block asked for by several local devices is read once."""
    import contextlib

    import jax
    from safetensors import safe_open

    where = _tensor_table(_weight_files(path), config)
    np_dtype = jnp.dtype(dtype)
    shard_tree = nest(config, lambda leaf: leaf)  # leaf descriptions, params-shaped

    with contextlib.ExitStack() as stack:
        handles = {fn: stack.enter_context(safe_open(fn, framework="np"))
                   for fn in sorted({fn for fn, _, _ in where.values()})}

        def place(leaf: Leaf, sharding):
            shape = leaf.shape(config)
            seen: dict = {}

            def block_of(index) -> np.ndarray:
                block = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
                key = tuple(block)
                if key not in seen:
                    seen[key] = _read_leaf_block(handles, where, leaf, config,
                                                 block).astype(np_dtype)
                return seen[key]

            return jax.make_array_from_callback(shape, sharding, block_of)

        return jax.tree_util.tree_map(place, shard_tree, shardings,
                                      is_leaf=lambda x: isinstance(x, Leaf))


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


def resolve_dtype(dtype, backend: Optional[str] = None):
    """"auto" -> bfloat16 on GPU/TPU, float32 on CPU (XLA:CPU runs bf16 5-9x slower than fp32
    on the demo pair), said once per backend on stderr; any other value is returned as is."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return dtype
    import jax

    from ..notices import say_once

    backend = backend or jax.default_backend()
    chosen = "float32" if backend == "cpu" else "bfloat16"
    say_once(f"dtype-auto-{backend}",
             f"load_model(dtype='auto') loads {chosen} on {backend} (bfloat16 on gpu/tpu, "
             "float32 on cpu); pass dtype= to choose")
    return chosen


def load_model(path: str, dtype: str | jnp.dtype = "auto", shardings=None,
               quantize: Optional[str] = None, weights_cache: Optional[str] = None) -> Model:
    """Loads a local Hugging Face Llama/Mistral/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3 directory, or
    a mixture of experts' (Qwen3-MoE, Mixtral, OLMoE), or a GGUF file (`.gguf`: llama, qwen2,
    qwen3, phi3, gemma2, gemma3, qwen3moe or olmoe architecture, any tensor type the `gguf`
    package dequantizes; config,
    tokenizer and chat template all come from the file, see `gguf.py`).

    dtype: "auto" (bfloat16 on GPU/TPU, float32 on CPU), "float32" or "bfloat16" (params are
    cast; RoPE and softmax always run in fp32). A model whose tokenizer has a chat template
    also stops at its end-of-turn token by default (`chat.end_of_turn_id`). shardings (HF
    directories): None, or config -> a params-shaped pytree of `jax.sharding.Sharding` to read
    the params straight into, each process reading only its devices' slices
    (`load_params_sliced`; `sharding.load_sharded` builds it for a mesh). quantize: None
    (float weights), "int8" or "int4": every linear weight kept as integer codes with scales
    (`quant.py`; a GGUF's Q8_0 / Q4_0 / Q4_K / Q6_K blocks as they are stored where they fit,
    `gguf_quant.py`); dtype is then the activations' and the float leaves'. On a CPU that runs
    slower than float (XLA:CPU does not fuse the int8 convert into the dot): it is for memory.
    weights_cache (GGUF files, float weights): None, or a directory where a GGUF's dequantized
    weights are kept after the first load and mapped by later ones (`weights_cache.py`; the
    CLI's `--weights-cache`). The library writes nothing unless given one.
    """
    if quantize is not None:
        from .quant import bits_of

        bits_of(quantize)  # ValueError naming the parameter
        if shardings is not None:
            raise ValueError("quantize: slice-wise reading (shardings) loads float weights; "
                             "load the model quantized and place it with sharding.shard_model")
    dtype = resolve_dtype(dtype)
    try:
        name = str(jnp.dtype(dtype))
    except (TypeError, ValueError):  # numpy's TypeError for "garbage" names no parameter
        name = None
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'auto', float32, bfloat16 or float16, got {dtype!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a directory or .gguf file path, got "
                         f"{type(path).__name__}")
    path = os.fspath(path)
    from .gguf import is_gguf_path

    if is_gguf_path(path):
        if shardings is not None:
            raise ValueError("shardings: slice-wise reading is for safetensors directories; "
                             f"load {path!r} whole and place it with sharding.shard_model, or "
                             "convert it with checkpoints_tools/gguf_to_hf.py first")
        return _load_gguf_model(path, jnp.dtype(dtype), quantize, weights_cache)
    if os.path.isfile(path):
        raise ValueError(f"{path!r} is a file but not a GGUF file; give a Hugging Face model "
                         "directory or a .gguf file (here, perhaps the directory "
                         f"{os.path.dirname(os.path.abspath(path))!r})")
    config = read_config(path)
    gen = read_generation_config(path)
    params = (load_params(path, config, jnp.dtype(dtype)) if shardings is None
              else load_params_sliced(path, config, jnp.dtype(dtype), shardings(config)))
    if quantize is not None:
        from .quant import quantize_loaded

        params = quantize_loaded(params, config, quantize)
    tokenizer = load_tokenizer(path)
    return Model(config=config, params=params, tokenizer=tokenizer, path=path,
                 generation_config=_with_end_of_turn(gen, config, tokenizer))


def load_both(load_target: Callable[[], Model], load_draft: Optional[Callable[[], Model]] = None
              ) -> tuple[Model, Optional[Model]]:
    """(target, draft): both loads run at once, the draft's on a thread while the target's runs
    here; load_draft None -> (target, None). A load is dequantization (C++ or numpy, both
    outside the GIL) and the first touch of fresh pages, and neither load keeps two cores busy
    alone: the real pair's GGUFs (Qwen2.5-Coder 1.5B fp32 + 0.5B w8a8, 2 cores) loaded in 10.5 s
    at once against 13.4 s one after the other with numpy's kernels, 5.1-5.4 s against ~7.4 s
    with `gguf_dequant`'s. An error of either load is raised here as it was raised (the
    target's first); the other load is waited for first, so no thread outlives the call."""
    if load_draft is None:
        return load_target(), None
    import threading

    box: dict = {}

    def side():
        try:
            box["draft"] = load_draft()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=side, name="load-draft", daemon=True)
    thread.start()
    try:
        target = load_target()
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    return target, box["draft"]


def _load_gguf_model(path: str, dtype, quantize: Optional[str] = None,
                     weights_cache: Optional[str] = None) -> Model:
    from ..heap import gc_paused

    with gc_paused():
        return _load_gguf(path, dtype, quantize, weights_cache)


def _load_gguf(path: str, dtype, quantize: Optional[str], weights_cache: Optional[str]) -> Model:
    from .config import normalize_eos
    from .gguf import (config_from_gguf, end_of_generation_ids, load_gguf_params,
                       load_gguf_tokenizer, open_gguf)

    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    from .gguf_quant import keeper
    from .quant import quantize_loaded
    from .weights_cache import read as weights_cache_read
    from .weights_cache import write_behind as weights_cache_write_behind

    caching = weights_cache is not None and quantize is None
    keep = keeper(config, quantize, dtype)
    mapped = weights_cache_read(weights_cache, path, config, dtype) if caching else {}
    if mapped:  # the entry's whole leaves, mapped; the others dequantized
        keep = lambda leaf, tensors, rows: mapped.get(leaf.name)  # noqa: E731
    params = load_gguf_params(reader, config, path, dtype, keep=keep)
    if caching:  # the leaves the entry lacks, written on a thread while the caller goes on
        weights_cache_write_behind(weights_cache, path, config, params, dtype, have=mapped)
    if quantize is not None:  # the leaves not kept as the file's blocks
        params = quantize_loaded(params, config, quantize)
    tokenizer = load_gguf_tokenizer(reader, path)
    gen = {}
    extra = [i for i in end_of_generation_ids(reader, path) if i < config.vocab_size]
    if extra:  # the file's own end-of-turn ids stop generation, as in llama.cpp
        base = config.eos_token_id
        ids = [] if base is None else ([base] if isinstance(base, int) else list(base))
        gen["eos_token_id"] = normalize_eos(ids + extra, f"{path}: end-of-turn ids")
    return Model(config=config, params=params, tokenizer=tokenizer, path=path,
                 generation_config=_with_end_of_turn(gen, config, tokenizer))


def _with_end_of_turn(gen: dict, config: ModelConfig, tokenizer) -> dict:
    """generation_config with the chat template's end-of-turn token added to the default EOS
    ids (as transformers' instruct checkpoints list it in generation_config.json), so that an
    instruct model's reply stops where its turn ends. Unchanged without a chat template."""
    from ..chat import end_of_turn_id
    from .config import normalize_eos

    eot = end_of_turn_id(tokenizer)
    if eot is None or eot >= config.vocab_size:
        return gen
    base = gen.get("eos_token_id", config.eos_token_id)
    if base is None and tokenizer is not None and tokenizer.eos_token_id is not None:
        base = int(tokenizer.eos_token_id)
    ids = [] if base is None else ([base] if isinstance(base, int) else list(base))
    if eot in ids:
        return gen
    return {**gen, "eos_token_id": normalize_eos(ids + [eot], "eos_token_id")}


def save_hf_checkpoint(out_dir: str, config: ModelConfig, params: Params,
                       dtype: str | jnp.dtype | None = None, tokenizer=None) -> None:
    """Writes config.json + model.safetensors that transformers (and load_model) load."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    cast = (lambda x: np.asarray(x).astype(jnp.dtype(dtype))) if dtype else np.asarray
    tensors = {}
    for leaf in leaves_of(config):
        arr = cast(params["layers"][leaf.name] if leaf.per_layer else params[leaf.name])
        for i, j in leaf.hf_keys(config):
            one = arr if i is None else (arr[i] if j is None else arr[i, j])
            tensors[leaf.hf_name(i, j)] = np.ascontiguousarray(leaf.to_hf(one))
    for fused, parts in fused_parts(config).items():  # Phi-3: as transformers stores them
        tensors[fused] = np.concatenate([tensors.pop(p) for p, _, _ in parts])
    renames = family_of(config.model_type).hf_renames  # Mixtral's names
    tensors = {name_hf(k, renames): v for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    d = config.to_hf_dict()
    d["torch_dtype"] = str(jnp.dtype(dtype)) if dtype else str(params["embed"].dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
