"""GGUF files (llama.cpp's single-file format): metadata -> `ModelConfig`, tensors -> our params.

A GGUF file holds key/value metadata (`general.*`, `<arch>.*`, `tokenizer.*`) and named tensors
(`token_embd.weight`, `blk.{i}.attn_q.weight`, ...), each stored as F32/F16/BF16 or in one of
llama.cpp's block quantizations. Loading is as strict as the safetensors loader (`loading.py`):

- the architecture must be one a family implements (`Family.gguf_arch`, models/families/),
  and every `<arch>.*` key must be one this module (`_ARCH_KEYS`) or the family
  (`Family.gguf_keys`) understands: an unknown one (per-layer head counts, a rope type,
  experts in an architecture whose family has none) could change the numerics, so it is
  refused by name;
- every tensor the config implies is present exactly once, with the shape it implies, and no
  other tensor is;
- a tensor type is accepted when the `gguf` package can dequantize it (`dequantizable_types()`),
  integer types are refused (they are no float weights), and a file whose tensor data is cut
  short is refused naming the tensor.

Layouts. GGUF lists dimensions innermost first, so a tensor of GGUF shape [E, V] is the numpy
array [V, E]: Hugging Face's torch layout (`params.Leaf.hf_shape`). What llama.cpp's converter
did to a family's tensors is undone as its `Family` record says: q/k rows permuted so that its
rotary kernel can rotate adjacent pairs (`gguf_permuted_qk`, the "llama" architecture: `permute`
in llama.cpp's convert_hf_to_gguf.py, undone by transformers' `LlamaTensorProcessor` and by
`unpermute_qk` here, back to the rotate-half layout our attention uses), 1 added to every
RMSNorm weight (`gguf_norm_shift`, Gemma), tensors stored fused (`gguf_fused`, Phi-3). A
mixture of experts stores each expert leaf as one tensor per layer holding every expert
(`ffn_gate_exps` [Y, F, E] in numpy order, `gguf_shape`).

Llama 3.1/3.2/3.3 files carry their llama3 rope scaling as a `rope_freqs.weight` tensor (one
divisor per rotary frequency, no rope-scaling metadata): it is read into the config
(`rope_factors`, `ModelConfig.rope_scaling = ("factors", ...)`) and divides the frequencies as
llama.cpp does, which gives transformers' llama3 frequencies (`families.llama.llama3_factors`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

from .config import ModelConfig, normalize_eos
from .families import BY_GGUF_ARCH, BY_GGUF_EXPERTS_OF, GGUF_ARCHITECTURES, Family, family_of
from .families.base import GGUFShape
from .params import LEAF_BY_NAME, LEAVES, Leaf, leaves_of, nest

GGUF_MAGIC = b"GGUF"
# llama3 rope scaling as llama.cpp's converter stores it (Llama 3.1/3.2/3.3): one divisor per
# rotary frequency, read into the config (`rope_factors`), not into the params
ROPE_FREQS = "rope_freqs.weight"

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
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
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
    # OLMoE's q/k norms over all heads; a mixture of experts' router and experts, each expert
    # leaf one tensor per layer holding every expert ([Y, F, E] in numpy order for gate / up)
    "q_norm_all": "blk.{i}.attn_q_norm.weight",
    "k_norm_all": "blk.{i}.attn_k_norm.weight",
    "router": "blk.{i}.ffn_gate_inp.weight",
    "we_gate": "blk.{i}.ffn_gate_exps.weight",
    "we_up": "blk.{i}.ffn_up_exps.weight",
    "we_down": "blk.{i}.ffn_down_exps.weight",
}
assert set(GGUF_NAMES) == {leaf.name for leaf in LEAVES}

# `<arch>.` keys understood in every family's files (a family's own: `Family.gguf_keys`).
# Those read into the config are listed in `config_from_gguf`; the rest carry no numerics (a
# YaRN "original context" is only meaningful with YaRN, refused; rope.scaling.attn_factor is
# read with Phi-3's LongRoPE tensors).
_ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "vocab_size",
    "rope.scaling.attn_factor",
})
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
    """The file's metadata and tensor table (`gguf_read.GGUFFile`, which reads as a
    `gguf.GGUFReader` does, without its per-element cost); FileNotFoundError when missing,
    ValueError naming the file when it is not a readable GGUF (wrong magic, truncated header or
    data, unknown tensor type)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: is not a file (a GGUF checkpoint is a single .gguf file)")
    try:
        import gguf  # noqa: F401  (the tensor types and dequantization kernels)
    except ImportError:
        raise ImportError("loading a GGUF file needs the `gguf` package: pip install gguf") from None
    from .gguf_read import GGUFFile

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        return GGUFFile(path)
    except Exception as e:  # ValueError/IndexError/struct errors, none naming the file
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
    """general.architecture, refused unless a family implements it."""
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata lacks 'general.architecture'")
    if arch not in BY_GGUF_ARCH:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)})")
    return arch


def family_of_file(reader, path: str) -> Family:
    """The family whose files have this general.architecture (`architecture`); for a file with
    `<arch>.expert_count`, the family that reads that architecture's mixtures of experts
    (`Family.gguf_experts_of`: Mixtral's "llama" files) where there is one."""
    arch = architecture(reader, path)
    if arch in BY_GGUF_EXPERTS_OF and _value(reader, arch + ".expert_count") is not None:
        return BY_GGUF_EXPERTS_OF[arch]
    return BY_GGUF_ARCH[arch]


class GGUFKeys:
    """A family's view of a file (`Family.from_gguf`): its `<arch>.` keys, typed and checked
    as this module's own (ValueError naming the file and the key), and its small tensors."""

    def __init__(self, reader, path: str, arch: str):
        self.reader, self.path, self.prefix = reader, path, arch + "."

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def value(self, key: str, default: Any = None) -> Any:
        return _value(self.reader, self.prefix + key, default)

    def int(self, key: str, default: Any = "required") -> Optional[int]:
        return _int_key(self.reader, self.prefix + key, self.path, default)

    def float(self, key: str, default: Any = "required") -> Optional[float]:
        return _float_key(self.reader, self.prefix + key, self.path, default)

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.reader.tensors)

    def tensor(self, name: str) -> Optional[np.ndarray]:
        """The tensor's values, dequantized and flat (float32); None when the file lacks it."""
        t = next((t for t in self.reader.tensors if t.name == name), None)
        return None if t is None else dequantize_tensor(t, self.path).reshape(-1)


def config_from_gguf(reader, path: str) -> ModelConfig:
    """The `ModelConfig` the file's metadata describes; ValueError naming the file and key.
    The keys every family shares are read here, the family's own by its `Family.from_gguf`."""
    family = family_of_file(reader, path)
    arch = architecture(reader, path)
    pre = arch + "."
    known = _ARCH_KEYS | family.gguf_keys
    unknown = sorted(k for k in reader.fields if k.startswith(pre) and k[len(pre):] not in known)
    if unknown:
        raise ValueError(f"{path}: unsupported GGUF key(s) {unknown}; refusing to load a model "
                         "whose numerics might differ from what is implemented")
    names = {t.name for t in reader.tensors}
    E = _int_key(reader, pre + "embedding_length", path)
    H = _int_key(reader, pre + "attention.head_count", path)
    K = _int_key(reader, pre + "attention.head_count_kv", path, H)
    D = _int_key(reader, pre + "attention.key_length", path, None) or E // H
    Dv = _int_key(reader, pre + "attention.value_length", path, None)
    if Dv is not None and Dv != D:
        raise ValueError(f"{path}: attention.value_length {Dv} differs from key_length {D} "
                         "(not implemented)")
    scaling = None
    kind = _value(reader, pre + "rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"{path}: GGUF rope.scaling.type {kind!r} is not supported "
                             "(supported: none, linear)")
        scaling = ("linear", _float_key(reader, pre + "rope.scaling.factor", path))
    max_pos = _int_key(reader, pre + "context_length", path, 2048)
    L = _int_key(reader, pre + "block_count", path)
    own = dict(family.from_gguf(GGUFKeys(reader, path, arch),
                                GGUFShape(E, H, D, L, max_pos, scaling, kind)))
    rot = _int_key(reader, pre + "rope.dimension_count", path, None)
    if rot is not None and rot != int(D * own.get("partial_rotary_factor", 1.0)):
        raise ValueError(f"{path}: rope.dimension_count {rot} differs from the head dim {D} "
                         "(partial rotary embeddings are not implemented)")
    if ROPE_FREQS in names:
        if own.get("rope_scaling", scaling) is not None:
            raise ValueError(f"{path}: tensor {ROPE_FREQS!r} together with rope.scaling.type "
                             f"{kind!r} is not supported")
        own["rope_scaling"] = ("factors", rope_factors(reader, path, D))
    kw = dict(
        vocab_size=_vocab_size(reader, path, pre, names),
        hidden_size=E,
        intermediate_size=_int_key(reader, pre + "feed_forward_length", path),
        num_layers=L,
        num_heads=H,
        num_kv_heads=K,
        head_dim=D,
        rope_theta=_float_key(reader, pre + "rope.freq_base", path, 10000.0),
        rope_scaling=scaling,
        # the float32 value as stored, as transformers reads it
        rms_norm_eps=_float_key(reader, pre + "attention.layer_norm_rms_epsilon", path),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=max_pos,
        model_type=family.model_type,
        bos_token_id=_token_id(reader, "tokenizer.ggml.bos_token_id", path),
        eos_token_id=normalize_eos(_token_id(reader, "tokenizer.ggml.eos_token_id", path),
                                   f"{path}: tokenizer.ggml.eos_token_id"),
        pad_token_id=_token_id(reader, "tokenizer.ggml.padding_token_id", path),
    )
    return ModelConfig(**{**kw, **family.features, **own})


def _vocab_size(reader, path: str, pre: str, names: set) -> int:
    """<arch>.vocab_size, else the tokenizer's token count, else token_embd's rows."""
    vocab = _value(reader, pre + "vocab_size")
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None and "token_embd.weight" in names:
        vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no {pre}vocab_size, no "
                         "tokenizer tokens, no token_embd.weight)")
    return int(vocab)


def rope_factors(reader, path: str, head_dim: int) -> tuple:
    """The `rope_freqs.weight` tensor: D/2 positive divisors of the rotary inverse frequencies,
    the llama3 scaling factors transformers computes from a config.json's `rope_scaling`
    (`families.llama.llama3_factors`); llama.cpp divides each frequency by its factor, and so
    does `llama.rope_inv_freq`. ValueError naming the tensor for a wrong length or value."""
    t = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    w = dequantize_tensor(t, path).reshape(-1)
    if w.shape[0] != head_dim // 2:
        raise ValueError(f"{path}: tensor {ROPE_FREQS} has {w.shape[0]} values, the head dim "
                         f"{head_dim} implies {head_dim // 2}")
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError(f"{path}: tensor {ROPE_FREQS} must hold positive finite factors")
    return tuple(float(x) for x in w)


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
    """GGUF tensor name -> (leaf, layer), for every tensor the config implies (a part of a
    fused tensor, `Family.gguf_fused`, as "<fused name>:<leaf>")."""
    part = {leaf: f"{fused}:{leaf}" for fused, leaves in
            family_of(config.model_type).gguf_fused.items() for leaf in leaves}
    return {part.get(leaf.name, GGUF_NAMES[leaf.name]).format(i=i): (leaf, i)
            for leaf in leaves_of(config)
            for i in (range(config.num_layers) if leaf.per_layer else (None,))}


def gguf_shape(leaf: Leaf, config: ModelConfig) -> tuple[int, ...]:
    """The shape (numpy order) of one of the leaf's GGUF tensors: its HF tensor's, with every
    expert of the layer stacked in front for an expert leaf (llama.cpp's `*_exps`)."""
    if leaf.per_expert:
        return (config.num_experts, *leaf.hf_shape(config))
    return leaf.hf_shape(config)


def _split_fused_gguf(t, config: ModelConfig, path: str):
    """A fused tensor of the file (`Family.gguf_fused`) -> [(its parts' names in
    `_gguf_names`, HF layout array)], its shape checked as a whole; [] when `t` is not one."""
    for fused, leaves in family_of(config.model_type).gguf_fused.items():
        for i in range(config.num_layers):
            if t.name != fused.format(i=i):
                continue
            rows = [LEAF_BY_NAME[n].hf_shape(config)[0] for n in leaves]
            want = (sum(rows), config.hidden_size)
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            if shape != want:
                raise ValueError(f"{path}: tensor {t.name} has shape {shape} (numpy order), "
                                 f"the metadata implies {want}")
            w = dequantize_tensor(t, path)
            bounds = np.cumsum([0] + rows)
            return [(f"{t.name}:{n}", w[a:b]) for n, a, b in zip(leaves, bounds, bounds[1:])]
    return []


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


def _tensors_by_leaf(reader, config: ModelConfig, path: str, family: Family) -> dict:
    """leaf name -> {layer (None when not per-layer): reader tensor}, after checking, before
    reading any data, that the file holds exactly the tensors the config implies, each once,
    each of its shape and of a loadable type."""
    names = _gguf_names(config)
    got: dict[str, Any] = dict.fromkeys(names)
    for t in reader.tensors:
        if t.name == ROPE_FREQS or t.name in family.gguf_tensors:
            continue  # read into the config
        parts = _split_fused_gguf(t, config, path)
        for name, w in parts:  # Phi-3's fused q/k/v and gate/up: HF-layout arrays
            if got[name] is not None:
                raise ValueError(f"{path}: tensor {t.name} appears more than once")
            got[name] = w
        if parts:
            continue
        if t.name not in names:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} (not part of a "
                             f"{architecture(reader, path)} model with {config.num_layers} "
                             "layers as its "
                             "metadata says)")
        leaf, _ = names[t.name]
        check_tensor_type(t, path)
        want = gguf_shape(leaf, config)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if shape != want:
            raise ValueError(f"{path}: tensor {t.name} has shape {shape} (numpy order), the "
                             f"metadata implies {want}")
        if got[t.name] is not None:
            raise ValueError(f"{path}: tensor {t.name} appears more than once")
        got[t.name] = t
    missing = [n for n, v in got.items() if v is None]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{path}: GGUF file lacks tensor(s) {missing[:5]}{more}")
    by_leaf: dict[str, dict] = {}
    for n, (leaf, i) in names.items():
        by_leaf.setdefault(leaf.name, {})[i] = got[n]
    return by_leaf


def _row_transform(family: Family, leaf: Leaf, config: ModelConfig, name: str = ""):
    """(rows per unit, fn) undoing what llama.cpp's converter did to the stored tensor `name`,
    or (1, None): q/k rows permuted within each head (`Family.gguf_permuted_qk`, undone by
    `unpermute_qk`); a norm weight shifted (`Family.gguf_norm_shift`, Gemma's + 1)."""
    if family.gguf_permuted_qk and leaf.name in ("wq", "wk"):
        D = config.head_dim
        return D, lambda w: unpermute_qk(w, w.shape[0] // D)
    shift = np.float32(family.gguf_norm_shift if name.endswith("norm.weight") else 0.0)
    if shift:
        return 1, lambda w: w - shift
    return 1, None


def _nbytes(t) -> int:
    """Bytes a job reads: a reader tensor's data, or an array split off a fused tensor."""
    return int(t.nbytes) if isinstance(t, np.ndarray) else int(t.n_bytes)


def load_gguf_params(reader, config: ModelConfig, path: str, dtype, progress: bool = True,
                     keep=None) -> dict:
    """Every tensor of the file into our stacked params layout, strictly (as
    `loading.load_params`): exactly the tensors the config implies, each once, each of its
    shape. dtype: the params' numpy/jax dtype. progress: a bar on stderr once the load has
    taken over 2 s.

    Each leaf is one preallocated array that its tensors are dequantized into, chunk by chunk
    (`gguf_read.fill_tensor`), then handed to jax (without a copy on the CPU backend), so host
    memory peaks near the weights themselves. The values are those of `dequantize_tensor` +
    `Leaf.from_hf` + a cast: bit-identical. keep: None, or (leaf, {layer: tensor}, rows_fn)
    -> the leaf as kept quantized blocks or None (`gguf_quant.kept_leaf`, `quantize=`)."""
    from .gguf_read import aligned_empty, fill_tensor, pieces, row_count, to_device

    import jax.numpy as jnp

    family = family_of_file(reader, path)
    by_leaf = _tensors_by_leaf(reader, config, path, family)
    np_dtype = jnp.dtype(dtype)
    bar = _progress_bar(sum(_nbytes(t) for ts in by_leaf.values() for t in ts.values()), path,
                        progress)
    bar_lock = threading.Lock()
    release = getattr(reader, "release", None)

    def leaf_array(pool, leaf: Leaf):
        if keep is not None:
            kept = keep(leaf, by_leaf[leaf.name],
                        lambda name: _row_transform(family, leaf, config, name)[1])
            if kept is not None:
                if bar is not None:
                    bar.update(sum(_nbytes(t) for t in by_leaf[leaf.name].values()))
                if release is not None:  # the blocks are copied: their file pages not needed
                    for t in by_leaf[leaf.name].values():
                        if not isinstance(t, np.ndarray):
                            release(t)
                return kept
        out = aligned_empty(leaf.shape(config), np_dtype)

        def fill(job):  # one piece of one tensor: disjoint from every other job's destination
            t, view, transposed, rows, align, rows_fn = job
            if isinstance(t, np.ndarray):  # a part of a fused tensor, already dequantized
                view[...] = t.T if transposed else t
                done = t.nbytes
            else:
                fill_tensor(t, view, transposed, align, rows_fn, rows)
                done = t.n_bytes * (rows[1] - rows[0]) // row_count(t)
            if bar is not None:
                with bar_lock:  # tqdm's counter is not thread-safe
                    bar.update(done)

        jobs = []
        if leaf.per_expert:  # each layer's tensor holds all its experts: read whole
            for i, t in by_leaf[leaf.name].items():
                w = dequantize_tensor(t, path)
                out[i] = np.stack([leaf.from_hf(e, config) for e in w]).astype(np_dtype)
                if bar is not None:
                    bar.update(t.n_bytes)
            return to_device(out)
        for i, t in by_leaf[leaf.name].items():
            view, transposed = leaf.hf_rows_view(out if i is None else out[i])
            if isinstance(t, np.ndarray):
                jobs.append((t, view, transposed, (0, 1), 1, None))
                continue
            align, rows_fn = _row_transform(family, leaf, config, t.name)
            jobs += [(t, view, transposed, rows, align, rows_fn) for rows in pieces(t, align)]
        list(pool.map(fill, jobs))  # (list: re-raises a worker's exception here)
        if release is not None:
            for t in by_leaf[leaf.name].values():
                if not isinstance(t, np.ndarray):
                    release(t)
        return to_device(out)

    # numpy's kernels release the GIL: the pieces dequantize in parallel
    workers = max(1, min(4, os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(workers) as pool:
            return nest(config, lambda leaf: leaf_array(pool, leaf))
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int, path: str, enabled: bool):
    """A bar over the tensor bytes on stderr, shown only once 2 s have passed (a small file
    loads silently); None when disabled or tqdm is missing (`gguf_read.byte_bar`)."""
    from .gguf_read import byte_bar

    return byte_bar(total, f"loading {os.path.basename(path)}") if enabled else None


# the tokenizer.* metadata is read into a tokenizer by gguf_tokenizer.py (no torch needed)
from .gguf_tokenizer import load_gguf_tokenizer  # noqa: E402,F401
