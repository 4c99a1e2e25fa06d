"""What a model family is: the `Family` record each module of this package exports, and
`HFFields`, the strict reader of a config.json its translation uses.

A family is everything that differs between checkpoints the one forward (`models/llama.py`)
runs: the names its config.json and GGUF files use, the `ModelConfig` features it switches on,
the tensors it stores fused, and its full-size presets. `config.py`, `gguf.py`, `params.py` and
`presets.py` read these records and never branch on a family. Nothing here imports those
modules (they import this package), so a family's hooks see a config as a plain object and a
GGUF file through the view `gguf.py` passes them (`gguf.GGUFKeys`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional


class HFRope(NamedTuple):
    """The RoPE fields every config.json shares, as `ModelConfig.from_hf_dict` read them before
    a family's `from_hf` runs: `scaling` is the rope_scaling object (or transformers 5's
    rope_parameters when it scales), `partial` the partial_rotary_factor as written (1.0 when
    absent), `max_pos` max_position_embeddings (2048 when absent)."""

    scaling: dict
    partial: Any
    max_pos: int


class GGUFShape(NamedTuple):
    """What `gguf.config_from_gguf` read before a family's `from_gguf` runs: E, H, D, L (the
    glossary's letters), max_position_embeddings, the rope scaling of the generic keys (None,
    or ("linear", factor)) and the rope.scaling.type it came from."""

    E: int
    H: int
    D: int
    L: int
    max_pos: int
    scaling: Optional[tuple]
    scaling_type: Any


def _same(d: dict, source: str) -> dict:
    return d


def _nothing(*args) -> dict:
    return {}


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One model family: one config.json `model_type` (a module may export several, as
    llama.py does Mistral).

    Attributes:
        model_type: config.json's model_type, and `ModelConfig.model_type`.
        hf_class: transformers' class, written to config.json's "architectures".
        features: `ModelConfig` fields every model of the family has (Qwen2's q/k/v biases,
            Gemma's GeGLU and (1 + w) norms, ...), whatever file it came from.
        hf_fields: config.json fields only this family reads (its `from_hf` does); in another
            family's config they are refused by name. "hidden_act" here: the family checks the
            activation itself (elsewhere only "silu" is implemented); a field of
            `config.HF_NEUTRAL_VALUES` here: the family implements its other values.
        hf_neutral: fields its checkpoints carry at the values that change nothing -> those
            values; accepted at them in any config.json (checkpoints copy each other's fields).
        hf_ignored: bookkeeping fields its checkpoints carry that change nothing at any value;
            accepted in any config.json.
        tied_by_default: transformers' default of tie_word_embeddings for the family.
        normalize_hf: (dict, source) -> dict, run before anything is read: older spellings of
            the family's fields rewritten into the ones `from_hf` reads.
        from_hf: (HFFields, HFRope) -> the family's own `ModelConfig` fields (a "rope_scaling"
            among them replaces the generic reading); ValueError naming the field.
        to_hf: (ModelConfig) -> the family's own config.json fields, the inverse of `from_hf`.
        hf_fused: fused HF tensor name ({i}: the layer) -> the leaves it holds, in row order;
            the loaders split it and `save_hf_checkpoint` joins it (Phi-3's qkv_proj).
        hf_renames: (theirs, ours) substrings of its checkpoints' tensor names, replaced in
            order on load and back on save, where they spell a leaf (`params.LEAVES`)
            differently (Mixtral's `block_sparse_moe.experts.{j}.w1` for our
            `mlp.experts.{j}.gate_proj`).
        gguf_arch: the GGUF general.architecture of its files (None: not loaded from GGUF).
        gguf_experts_of: a GGUF architecture (another family's `gguf_arch`) whose files that
            carry `<arch>.expert_count` are this family's (Mixtral: llama.cpp writes it as the
            Llama architecture with experts); None: none.
        gguf_keys: `<arch>.` metadata keys only this family's files have (its `from_gguf` reads
            them); refused in other files.
        gguf_tensors: tensors of its files read into the config, not the params.
        from_gguf: (metadata view, GGUFShape) -> the family's own `ModelConfig` fields; the view
            is `gguf.GGUFKeys` (`int`, `float`, `value` of `<arch>.` keys, `tensor`, `error`).
        gguf_fused: as hf_fused, with GGUF tensor names.
        gguf_permuted_qk: llama.cpp's converter permuted the q/k rows for its rotary kernel
            (the "llama" architecture); the loader undoes it (`gguf.unpermute_qk`).
        gguf_norm_shift: what llama.cpp's converter added to every RMSNorm weight (Gemma: 1,
            its norms scale by (1 + w)); the loader subtracts it, as transformers does.
        presets: preset name -> `ModelConfig` fields of a full-size model (the family's
            model_type and features are added), for planning and lowering (`presets.py`).
    """

    model_type: str
    hf_class: str
    features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_fields: frozenset = frozenset()
    hf_neutral: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    hf_ignored: frozenset = frozenset()
    tied_by_default: bool = False
    normalize_hf: Callable[[dict, str], dict] = _same
    from_hf: Callable[["HFFields", HFRope], dict] = _nothing
    to_hf: Callable[[Any], dict] = _nothing
    hf_fused: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    hf_renames: tuple = ()
    gguf_arch: Optional[str] = None
    gguf_experts_of: Optional[str] = None
    gguf_keys: frozenset = frozenset()
    gguf_tensors: tuple = ()
    from_gguf: Callable[[Any, GGUFShape], dict] = _nothing
    gguf_fused: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    gguf_permuted_qk: bool = False
    gguf_norm_shift: float = 0.0
    presets: Mapping[str, dict] = dataclasses.field(default_factory=dict)


def as_int(v, name: str, source: str) -> int:
    """An integer config field; refuses strings, bools and fractional numbers by name."""
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float)
                                                           and v.is_integer())):
        raise ValueError(f"{source}: field {name!r} must be an integer, got {v!r}")
    return int(v)


class HFFields:
    """A config.json's fields, read strictly: each refusal a ValueError naming the source and
    the field. Absent and null read alike (transformers writes null for "unset")."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def __contains__(self, name: str) -> bool:
        return name in self.d

    def get(self, name: str, default=None):
        return self.d.get(name, default)

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def need(self, name: str) -> int:
        """A required integer field."""
        if self.d.get(name) is None:
            raise self.error(f"required field {name!r} is missing")
        return as_int(self.d[name], name, self.source)

    def int(self, name: str, default=None):
        """An optional integer field, `default` when absent or null."""
        v = self.d.get(name)
        return default if v is None else as_int(v, name, self.source)

    def window(self, name: str = "sliding_window") -> Optional[int]:
        """A sliding window: None when absent, null or 0 (transformers' "no window")."""
        v = self.d.get(name)
        return as_int(v, name, self.source) if v else None

    def number(self, name: str, default: float) -> float:
        """An optional number field (absent: `default`; null is refused)."""
        v = self.d.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(f"field {name!r} must be a number, got {v!r}")
        return float(v)

    def positive(self, name: str, required: bool = False, default=None) -> Optional[float]:
        """An optional positive number: absent reads `default` (transformers' default), null
        reads None (none), unless `required`."""
        v = self.d.get(name, default)
        if v is None:
            if required:
                raise self.error(f"required field {name!r} is missing")
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise self.error(f"field {name!r} must be a positive number, got {v!r}")
        return float(v)


def rope_kind(scaling: dict) -> str:
    """A rope_scaling object's type ("default" when it names none)."""
    return scaling.get("rope_type", scaling.get("type", "default"))
