"""GGUF files (llama.cpp's single-file format): metadata -> `ModelConfig`, tensors -> our params.

A GGUF file holds key/value metadata (`general.*`, `<arch>.*`, `tokenizer.*`) and named tensors
(`token_embd.weight`, `blk.{i}.attn_q.weight`, ...), each stored as F32/F16/BF16 or in one of
llama.cpp's block quantizations. Loading is as strict as the safetensors loader (`loading.py`):

- the architecture must be one implemented here (`GGUF_ARCHITECTURES`), and every `<arch>.*`
  key must be one this module understands (`_ARCH_KEYS`): an unknown one (experts, per-layer
  head counts, a rope type) could change the numerics, so it is refused by name;
- every tensor the config implies is present exactly once, with the shape it implies, and no
  other tensor is;
- a tensor type is accepted when the `gguf` package can dequantize it (`dequantizable_types()`),
  integer types are refused (they are no float weights), and a file whose tensor data is cut
  short is refused naming the tensor.

Layouts. GGUF lists dimensions innermost first, so a tensor of GGUF shape [E, V] is the numpy
array [V, E]: Hugging Face's torch layout (`params.Leaf.hf_shape`). One difference: llama.cpp's
converter permutes the rows of q/k projections of the "llama" architecture so that its rotary
kernel can rotate adjacent pairs (`permute` in llama.cpp's convert_hf_to_gguf.py, undone by
transformers' `LlamaTensorProcessor`); `unpermute_qk` undoes it, back to the rotate-half layout
our attention uses. Qwen2 is stored unpermuted (llama.cpp rotates it NeoX-style), and so are
Gemma 2 / Gemma 3, whose converter adds 1 to every RMSNorm weight instead (`gemma_norm_shift`,
taken off again here as transformers does).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from .config import ModelConfig, normalize_eos
from .params import LEAVES, Leaf, leaves_of, nest

GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma2", "gemma3")
GGUF_MAGIC = b"GGUF"

# our leaf -> its GGUF tensor name ({i}: layer index)
GGUF_NAMES: dict[str, str] = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "bq": "blk.{i}.attn_q.bias",
    "bk": "blk.{i}.attn_k.bias",
    "bv": "blk.{i}.attn_v.bias",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
    # Gemma 2 / 3 (gguf's MODEL_TENSOR names ATTN_POST_NORM, FFN_POST_NORM, ATTN_Q/K_NORM;
    # Gemma's pre-MLP norm is FFN_PRE_NORM, "ffn_norm", like mlp_norm above)
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
}
assert set(GGUF_NAMES) == {leaf.name for leaf in LEAVES}

# `<arch>.` keys understood here. Those read into the config are listed in `config_from_gguf`;
# the rest carry no numerics (a YaRN "original context" is only meaningful with YaRN, refused).
_ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "vocab_size",
})
# `<arch>.` keys only some architectures have (read by `_gemma_fields`)
_ARCH_ONLY_KEYS = {
    "gemma2": frozenset({"attention.sliding_window", "attn_logit_softcapping",
                         "final_logit_softcapping"}),
    "gemma3": frozenset({"attention.sliding_window"}),
}
_INT_TYPES = ("I8", "I16", "I32", "I64")


def is_gguf_path(path) -> bool:
    """Whether `path` names a GGUF file: a .gguf name, or an existing file starting with the
    GGUF magic bytes."""
    p = os.fspath(path)
    if p.lower().endswith(".gguf"):
        return True
    if os.path.isfile(p):
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    return False


def dequantizable_types() -> frozenset:
    """Names of the tensor types loadable here: the float types and every type the installed
    `gguf` package can dequantize."""
    from gguf import quants

    return frozenset({"F32", "F16", "F64"} | {t.name for t in quants._type_traits})


def open_gguf(path: str):
    """A `gguf.GGUFReader` of the file; FileNotFoundError when missing, ValueError naming the
    file when it is not a readable GGUF (wrong magic, truncated header, unknown tensor type)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: is not a file (a GGUF checkpoint is a single .gguf file)")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError("loading a GGUF file needs the `gguf` package: pip install gguf") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors, none naming the file
        raise ValueError(f"{path}: unreadable GGUF file, truncated or corrupt "
                         f"({type(e).__name__}: {e})") from None


def _value(reader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    v = field.contents()
    return v


def _int_key(reader, key: str, path: str, default: Any = "required") -> Optional[int]:
    v = _value(reader, key)
    if v is None:
        if default == "required":
            raise ValueError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    if isinstance(v, list) or isinstance(v, (bool, np.bool_)) or not isinstance(
            v, (int, np.integer)):
        raise ValueError(f"{path}: GGUF key {key!r} must be one integer, got {v!r} (per-layer "
                         "values are not implemented)")
    if int(v) <= 0:
        raise ValueError(f"{path}: GGUF key {key!r} must be positive, got {v}")
    return int(v)


def _float_key(reader, key: str, path: str, default: Any = "required") -> Optional[float]:
    v = _value(reader, key)
    if v is None:
        if default == "required":
            raise ValueError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    if isinstance(v, (list, str, bool, np.bool_)) or not np.isfinite(v) or not v > 0:
        raise ValueError(f"{path}: GGUF key {key!r} must be a positive number, got {v!r}")
    return float(v)


def _token_id(reader, key: str, path: str) -> Optional[int]:
    v = _value(reader, key)
    if v is None:
        return None
    if isinstance(v, (list, bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{path}: GGUF key {key!r} must be a token id, got {v!r}")
    return int(v)


def architecture(reader, path: str) -> str:
    """general.architecture, refused unless implemented."""
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata lacks 'general.architecture'")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)})")
    return arch


def config_from_gguf(reader, path: str) -> ModelConfig:
    """The `ModelConfig` the file's metadata describes; ValueError naming the file and key."""
    arch = architecture(reader, path)
    pre = arch + "."
    known = _ARCH_KEYS | _ARCH_ONLY_KEYS.get(arch, frozenset())
    unknown = sorted(k for k in reader.fields if k.startswith(pre) and k[len(pre):] not in known)
    if unknown:
        raise ValueError(f"{path}: unsupported GGUF key(s) {unknown}; refusing to load a model "
                         "whose numerics might differ from what is implemented")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: tensor 'rope_freqs.weight' (per-frequency rope factors, as "
                         "llama.cpp stores Llama 3.1 rope scaling) is not supported")
    E = _int_key(reader, pre + "embedding_length", path)
    H = _int_key(reader, pre + "attention.head_count", path)
    K = _int_key(reader, pre + "attention.head_count_kv", path, H)
    D = _int_key(reader, pre + "attention.key_length", path, None) or E // H
    Dv = _int_key(reader, pre + "attention.value_length", path, None)
    if Dv is not None and Dv != D:
        raise ValueError(f"{path}: attention.value_length {Dv} differs from key_length {D} "
                         "(not implemented)")
    rot = _int_key(reader, pre + "rope.dimension_count", path, None)
    if rot is not None and rot != D:
        raise ValueError(f"{path}: rope.dimension_count {rot} differs from the head dim {D} "
                         "(partial rotary embeddings are not implemented)")
    scaling = None
    kind = _value(reader, pre + "rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"{path}: GGUF rope.scaling.type {kind!r} is not supported "
                             "(supported: none, linear)")
        scaling = ("linear", _float_key(reader, pre + "rope.scaling.factor", path))
    vocab = _value(reader, pre + "vocab_size")
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None and "token_embd.weight" in names:
        vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no {pre}vocab_size, no "
                         "tokenizer tokens, no token_embd.weight)")
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id", path)
    L = _int_key(reader, pre + "block_count", path)
    gemma = _gemma_fields(reader, arch, path, L, E, H, D) if arch in GGUF_GEMMA else {}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=E,
        intermediate_size=_int_key(reader, pre + "feed_forward_length", path),
        num_layers=_int_key(reader, pre + "block_count", path),
        num_heads=H,
        num_kv_heads=K,
        head_dim=D,
        rope_theta=_float_key(reader, pre + "rope.freq_base", path, 10000.0),
        rope_scaling=scaling,
        # the float32 value as stored, as transformers reads it
        rms_norm_eps=_float_key(reader, pre + "attention.layer_norm_rms_epsilon", path),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
        max_position_embeddings=_int_key(reader, pre + "context_length", path, 2048),
        model_type=GGUF_MODEL_TYPES.get(arch, arch),
        bos_token_id=_token_id(reader, "tokenizer.ggml.bos_token_id", path),
        eos_token_id=normalize_eos(eos, f"{path}: tokenizer.ggml.eos_token_id"),
        pad_token_id=_token_id(reader, "tokenizer.ggml.padding_token_id", path),
        **gemma,
    )


# GGUF architecture -> our model_type, where they differ
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}
GGUF_GEMMA = ("gemma2", "gemma3")


def _gemma_fields(reader, arch: str, path: str, L: int, E: int, H: int, D: int) -> dict:
    """The Gemma feature fields of a gemma2 / gemma3 GGUF, as llama.cpp reads the file
    (llama-model.cpp): sliding window 4096 by default for gemma2 (required for gemma3); every
    2nd layer global (gemma2), every 6th (gemma3); local RoPE base 10000, unscaled (gemma3);
    soft caps 50 / 30 by default (gemma2; gemma3 has none); and no key for the score scale:
    1/sqrt(E/H) for the 27B models (46 layers for gemma2, 62 for gemma3), 1/sqrt(D) else."""
    pre = arch + "."
    gemma2 = arch == "gemma2"
    window = _int_key(reader, pre + "attention.sliding_window", path,
                      4096 if gemma2 else "required")
    pattern = 2 if gemma2 else 6
    big = L == (46 if gemma2 else 62)
    out = dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, embed_scale=True,
               sandwich_norms=True, qk_norm=not gemma2,
               query_pre_attn_scalar=float(E // H if big else D), sliding_window=window,
               sliding_layers=tuple(bool((i + 1) % pattern) for i in range(L)))
    if gemma2:
        out["attn_softcap"] = _float_key(reader, pre + "attn_logit_softcapping", path, 50.0)
        out["final_softcap"] = _float_key(reader, pre + "final_logit_softcapping", path, 30.0)
    else:
        out["rope_local_theta"] = 10000.0
    return out


def gemma_norm_shift(arch: str, name: str) -> float:
    """What llama.cpp's converter added to a tensor of a Gemma GGUF: 1 to every RMSNorm weight
    ("...norm.weight"), since Gemma's norms scale by (1 + w); transformers' GGUF loader
    subtracts it again (Gemma2TensorProcessor), and so do we."""
    return 1.0 if arch in GGUF_GEMMA and name.endswith("norm.weight") else 0.0


def end_of_generation_ids(reader, path: str) -> list[int]:
    """The end-of-turn / end-of-message ids the metadata names (tokenizer.ggml.eot_token_id,
    eom_token_id): llama.cpp stops at them as at EOS."""
    ids = []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _token_id(reader, key, path)
        if v is not None:
            ids.append(v)
    return ids


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: w[heads*D, E] with each head's rows ordered
    (D/2 pairs, 2) -> ordered (2, D/2), the rotate-half layout. The inverse of
    `permute_qk`."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a q/k projection (HF layout [heads*D, E]) when it writes a
    "llama" GGUF: each head's rows (2, D/2) -> (D/2, 2)."""
    d = w.shape[0] // heads // 2
    return w.reshape(heads, 2, d, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_names(config: ModelConfig) -> dict[str, tuple[Leaf, Optional[int]]]:
    """GGUF tensor name -> (leaf, layer), for every tensor the config implies."""
    return {GGUF_NAMES[leaf.name].format(i=i): (leaf, i) for leaf in leaves_of(config)
            for i in (range(config.num_layers) if leaf.per_layer else (None,))}


def check_tensor_type(t, path: str) -> None:
    """ValueError naming the tensor when its type is an integer one or one the gguf package
    cannot dequantize."""
    kind = t.tensor_type.name
    if kind in _INT_TYPES:
        raise ValueError(f"{path}: tensor {t.name} has type {kind}; only float and quantized "
                         "float tensors are supported")
    if kind not in dequantizable_types():
        raise ValueError(f"{path}: tensor {t.name} has quantization type {kind}, which the gguf "
                         f"package cannot dequantize (supported: "
                         f"{', '.join(sorted(dequantizable_types()))})")


def dequantize_tensor(t, path: str) -> np.ndarray:
    """One reader tensor -> float32 numpy array in HF layout (GGUF dims reversed); ValueError
    naming the tensor for an integer or non-dequantizable type or a short data block."""
    from gguf import dequantize

    check_tensor_type(t, path)
    kind = t.tensor_type.name
    if int(t.data.nbytes) != int(t.n_bytes):
        raise ValueError(f"{path}: tensor {t.name} has {t.data.nbytes} of its {t.n_bytes} bytes "
                         "(truncated file)")
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if kind == "F64":
        w = np.asarray(t.data, np.float64).astype(np.float32)
    else:
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
    return w.reshape(shape)


def load_gguf_params(reader, config: ModelConfig, path: str, dtype) -> dict:
    """Every tensor of the file into our stacked params layout, strictly (as
    `loading.load_params`): exactly the tensors the config implies, each once, each of its
    shape. dtype: the params' numpy/jax dtype."""
    import jax.numpy as jnp

    names = _gguf_names(config)
    arch = architecture(reader, path)
    got: dict[str, Optional[np.ndarray]] = dict.fromkeys(names)
    np_dtype = jnp.dtype(dtype)
    for t in reader.tensors:
        if t.name not in names:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} (not part of a {arch} model "
                             f"with {config.num_layers} layers as its metadata says)")
        leaf, _ = names[t.name]
        check_tensor_type(t, path)
        want = leaf.hf_shape(config)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if shape != want:
            raise ValueError(f"{path}: tensor {t.name} has shape {shape} (numpy order), the "
                             f"metadata implies {want}")
        if got[t.name] is not None:
            raise ValueError(f"{path}: tensor {t.name} appears more than once")
        w = dequantize_tensor(t, path)
        if arch == "llama" and leaf.name in ("wq", "wk"):
            w = unpermute_qk(w, config.num_heads if leaf.name == "wq" else config.num_kv_heads)
        shift = gemma_norm_shift(arch, t.name)
        if shift:
            w = w - np.float32(shift)
        got[t.name] = leaf.from_hf(w, config).astype(np_dtype)
    missing = [n for n, v in got.items() if v is None]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{path}: GGUF file lacks tensor(s) {missing[:5]}{more}")
    by_leaf = {}
    for n, (leaf, i) in names.items():
        by_leaf.setdefault(leaf.name, {})[i] = got[n]
    return nest(config, lambda leaf: jnp.asarray(
        np.stack([by_leaf[leaf.name][i] for i in range(config.num_layers)]) if leaf.per_layer
        else by_leaf[leaf.name][None]))


def load_gguf_tokenizer(reader, path: str):
    """transformers' tokenizer built from the file's tokenizer.* metadata (chat template
    included), or None when the file carries no tokenizer."""
    if reader.get_field("tokenizer.ggml.model") is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path),
                                             local_files_only=True)
    except Exception as e:  # transformers raises many types, none naming the file
        raise ValueError(f"{path}: the GGUF tokenizer could not be built "
                         f"({type(e).__name__}: {e})") from None
