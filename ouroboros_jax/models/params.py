"""Every parameter leaf of the decoder, described once.

`LEAVES` is the one table: each `Leaf` names its logical axes (from which its shape follows, and
which `sharding.RULES` map onto a mesh), its Hugging Face tensor name and layout, its
initializer and whether a config has it at all. Everything else derives from it:
`llama.param_shapes` and `llama.init_params`, `sharding.LOGICAL_AXES` (the parameter part),
the strict loader and `save_hf_checkpoint` (`loading.py`).

Per-layer leaves carry the stacked "layers" axis first (the forward scans over it); their HF
name has an `{i}` for the layer index and their HF layout describes one layer's slice. Expert
leaves (mixtures of experts) carry the "experts" axis second: checkpoints store one tensor per
layer and expert, so their HF name has a `{j}` for the expert too and their layout describes
one expert's slice.

HF layouts (what transformers stores, from ours):
    "same"     the same array (embeddings, norms);
    "flat"     one vector (q/k/v biases: [H,D] -> [H*D]);
    "linear"   a torch Linear weight [out, in]: ours is [in dims..., out dims...], its first
               `hf_in_dims` dimensions (after "layers") being the input side, so HF holds
               `ours.reshape(prod(in), prod(out)).T` (wq [E,H,D] -> [H*D, E], wo [H,D,E] ->
               [E, H*D], lm_head [E,V] -> [V,E]).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from .config import ModelConfig
from .families import family_of

# logical axis -> its size in a config (letters as in llama.py's glossary)
AXIS_SIZES: dict[str, Callable[[ModelConfig], int]] = {
    "vocab": lambda c: c.vocab_size,  # V
    "embed": lambda c: c.hidden_size,  # E
    "ffn": lambda c: c.intermediate_size,  # F
    "layers": lambda c: c.num_layers,  # L
    "q_heads": lambda c: c.num_heads,  # H
    "kv_heads": lambda c: c.num_kv_heads,  # K
    "head_dim": lambda c: c.head_dim,  # D
    "experts": lambda c: c.num_experts,  # Y
    "moe_ffn": lambda c: c.moe_intermediate_size,  # F of an expert
}

HF_LAYOUTS = ("same", "flat", "linear")
INITS = ("normal", "ones", "zeros")


def _always(config: ModelConfig) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf.

    Attributes:
        name: its key in the params pytree (in `params["layers"]` when per-layer).
        axes: logical axis names of its dimensions ("layers" first when per-layer); the shape
            is their sizes in the config (`AXIS_SIZES`), the sharding their `RULES`.
        hf: the Hugging Face tensor name, with `{i}` for the layer index when per-layer and
            `{j}` for the expert when per-expert.
        hf_layout: "same", "flat" or "linear" (see the module docstring).
        hf_in_dims: for "linear", how many of the (per-layer) dimensions are the input side.
        init: "normal" (normal(0, std)), "ones" or "zeros".
        present: config -> whether the config has this leaf (qkv biases, untied lm_head).
        ignored_when_absent: a checkpoint may still hold the tensor when the config lacks the
            leaf; it is then skipped instead of refused (tied checkpoints that store the shared
            matrix twice).
    """

    name: str
    axes: tuple[str, ...]
    hf: str
    hf_layout: str = "same"
    hf_in_dims: int = 1
    init: str = "normal"
    present: Callable[[ModelConfig], bool] = _always
    ignored_when_absent: bool = False

    def __post_init__(self):
        assert self.hf_layout in HF_LAYOUTS and self.init in INITS, self
        assert all(a in AXIS_SIZES for a in self.axes), self
        assert self.per_layer == ("{i}" in self.hf), self
        assert self.per_expert == ("{j}" in self.hf), self

    @property
    def per_layer(self) -> bool:
        return self.axes[0] == "layers"

    @property
    def per_expert(self) -> bool:
        """Stored one tensor per (layer, expert): axes ("layers", "experts", ...)."""
        return self.axes[:2] == ("layers", "experts")

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        """The full shape (with the stacked layers axis when per-layer)."""
        return tuple(AXIS_SIZES[a](config) for a in self.axes)

    def slice_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """The shape of one HF tensor's worth of it: one layer's slice when per-layer, one
        (layer, expert)'s when per-expert."""
        return self.shape(config)[self.per_layer + self.per_expert:]

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        if self.per_layer:
            return self.hf.format(i=layer, j=expert)
        return self.hf

    def hf_keys(self, config: ModelConfig) -> list[tuple]:
        """The (layer, expert) index of each of its HF tensors, in stacking order: (None,
        None) for a whole leaf, (i, None) per layer, (i, j) per layer and expert."""
        if not self.per_layer:
            return [(None, None)]
        if not self.per_expert:
            return [(i, None) for i in range(config.num_layers)]
        return [(i, j) for i in range(config.num_layers) for j in range(config.num_experts)]

    def stack(self, config: ModelConfig, tensors: list) -> np.ndarray:
        """Our array from its HF tensors' slices, one per `hf_keys` entry in that order."""
        if not self.per_layer:
            return tensors[0]
        out = np.stack(tensors)
        return out.reshape(self.shape(config)) if self.per_expert else out

    def hf_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """The shape transformers stores (one layer's tensor when per-layer)."""
        ours = self.slice_shape(config)
        if self.hf_layout == "linear":
            return (math.prod(ours[self.hf_in_dims:]), math.prod(ours[:self.hf_in_dims]))
        if self.hf_layout == "flat":
            return (math.prod(ours),)
        return ours

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        """Our array (one layer's slice when per-layer) -> the HF tensor."""
        if self.hf_layout == "linear":
            return w.reshape(math.prod(w.shape[:self.hf_in_dims]), -1).T
        if self.hf_layout == "flat":
            return w.reshape(-1)
        return w

    def from_hf(self, w: np.ndarray, config: ModelConfig) -> np.ndarray:
        """The HF tensor (shape already checked against `hf_shape`) -> our (slice) array."""
        shape = self.slice_shape(config)
        return (w.T if self.hf_layout == "linear" else w).reshape(shape)

    def hf_rows_view(self, dst: np.ndarray) -> tuple[np.ndarray, bool]:
        """(view, transposed): a 2-D view of our contiguous (slice) array `dst` into which the HF
        tensor's rows are written in place, as `from_hf` would place them. transposed: the view
        is [in, out] and takes HF row r as its column r (a torch Linear); else it is [rows,
        row length] and takes row r as its row r."""
        assert dst.flags.c_contiguous, "a view needs a contiguous destination"
        if self.hf_layout == "linear":
            return dst.reshape(math.prod(dst.shape[:self.hf_in_dims]), -1), True
        if self.hf_layout == "flat" or dst.ndim == 1:
            return dst.reshape(1, -1), False
        return dst.reshape(-1, dst.shape[-1]), False


def _has_bias(config: ModelConfig) -> bool:
    return config.qkv_bias


def _has_qk_norm(config: ModelConfig) -> bool:
    return config.qk_norm


def _untied(config: ModelConfig) -> bool:
    return not config.tie_word_embeddings


def _sandwich(config: ModelConfig) -> bool:
    return config.sandwich_norms


def _no_sandwich(config: ModelConfig) -> bool:
    return not config.sandwich_norms


def _has_qk_norm_all(config: ModelConfig) -> bool:
    return config.qk_norm_across_heads


def _dense(config: ModelConfig) -> bool:
    return not config.is_moe


def _moe(config: ModelConfig) -> bool:
    return config.is_moe


_LAYER = "model.layers.{i}."

# The one table. Order: as transformers lists a model's tensors (and as `missing` names them).
LEAVES: tuple[Leaf, ...] = (
    Leaf("embed", ("vocab", "embed"), "model.embed_tokens.weight"),
    Leaf("final_norm", ("embed",), "model.norm.weight", init="ones"),
    Leaf("lm_head", ("embed", "vocab"), "lm_head.weight", "linear", present=_untied,
         ignored_when_absent=True),
    Leaf("attn_norm", ("layers", "embed"), _LAYER + "input_layernorm.weight", init="ones"),
    Leaf("wq", ("layers", "embed", "q_heads", "head_dim"), _LAYER + "self_attn.q_proj.weight",
         "linear"),
    Leaf("wk", ("layers", "embed", "kv_heads", "head_dim"), _LAYER + "self_attn.k_proj.weight",
         "linear"),
    Leaf("wv", ("layers", "embed", "kv_heads", "head_dim"), _LAYER + "self_attn.v_proj.weight",
         "linear"),
    Leaf("wo", ("layers", "q_heads", "head_dim", "embed"), _LAYER + "self_attn.o_proj.weight",
         "linear", hf_in_dims=2),
    Leaf("bq", ("layers", "q_heads", "head_dim"), _LAYER + "self_attn.q_proj.bias", "flat",
         init="zeros", present=_has_bias),
    Leaf("bk", ("layers", "kv_heads", "head_dim"), _LAYER + "self_attn.k_proj.bias", "flat",
         init="zeros", present=_has_bias),
    Leaf("bv", ("layers", "kv_heads", "head_dim"), _LAYER + "self_attn.v_proj.bias", "flat",
         init="zeros", present=_has_bias),
    Leaf("q_norm", ("layers", "head_dim"), _LAYER + "self_attn.q_norm.weight", init="ones",
         present=_has_qk_norm),
    Leaf("k_norm", ("layers", "head_dim"), _LAYER + "self_attn.k_norm.weight", init="ones",
         present=_has_qk_norm),
    # OLMoE: q and k normalized over all heads at once, one weight of H*D (K*D)
    Leaf("q_norm_all", ("layers", "q_heads", "head_dim"), _LAYER + "self_attn.q_norm.weight",
         "flat", init="ones", present=_has_qk_norm_all),
    Leaf("k_norm_all", ("layers", "kv_heads", "head_dim"), _LAYER + "self_attn.k_norm.weight",
         "flat", init="ones", present=_has_qk_norm_all),
    Leaf("mlp_norm", ("layers", "embed"), _LAYER + "post_attention_layernorm.weight",
         init="ones", present=_no_sandwich),
    # Gemma: the norm before the MLP is "pre_feedforward_layernorm", while
    # "post_attention_layernorm" normalizes the attention's output; its norms scale by (1 + w),
    # so their neutral value is 0
    Leaf("mlp_norm", ("layers", "embed"), _LAYER + "pre_feedforward_layernorm.weight",
         init="zeros", present=_sandwich),
    Leaf("post_attn_norm", ("layers", "embed"), _LAYER + "post_attention_layernorm.weight",
         init="zeros", present=_sandwich),
    Leaf("post_mlp_norm", ("layers", "embed"), _LAYER + "post_feedforward_layernorm.weight",
         init="zeros", present=_sandwich),
    Leaf("w_gate", ("layers", "embed", "ffn"), _LAYER + "mlp.gate_proj.weight", "linear",
         present=_dense),
    Leaf("w_up", ("layers", "embed", "ffn"), _LAYER + "mlp.up_proj.weight", "linear",
         present=_dense),
    Leaf("w_down", ("layers", "ffn", "embed"), _LAYER + "mlp.down_proj.weight", "linear",
         present=_dense),
    # mixtures of experts: the router [E, Y] and each expert's SwiGLU, stacked on the experts
    # axis (Mixtral's names are renamed into these on load, `Family.hf_renames`)
    Leaf("router", ("layers", "embed", "experts"), _LAYER + "mlp.gate.weight", "linear",
         present=_moe),
    Leaf("we_gate", ("layers", "experts", "embed", "moe_ffn"),
         _LAYER + "mlp.experts.{j}.gate_proj.weight", "linear", present=_moe),
    Leaf("we_up", ("layers", "experts", "embed", "moe_ffn"),
         _LAYER + "mlp.experts.{j}.up_proj.weight", "linear", present=_moe),
    Leaf("we_down", ("layers", "experts", "moe_ffn", "embed"),
         _LAYER + "mlp.experts.{j}.down_proj.weight", "linear", present=_moe),
)

# A name appears twice only where families store the same leaf under different HF names
# (mlp_norm); the two are never present together and have the same axes.
LEAF_BY_NAME: dict[str, Leaf] = {leaf.name: leaf for leaf in LEAVES}
assert all(LEAF_BY_NAME[leaf.name].axes == leaf.axes for leaf in LEAVES)


def fused_parts(config: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Each fused HF tensor of the config (one per layer) -> [(a part's own HF name, its first
    row, its end row)] in row order; {} for checkpoints without fused tensors.

    Some checkpoints store several leaves as one Linear, their outputs stacked along the rows
    (the family's `hf_fused`: Phi-3's qkv_proj holds q, k, v and its gate_up_proj gate then
    up); the leaves (and so sharding and the layouts) stay the separate ones, the loaders split
    the fused tensor and `save_hf_checkpoint` joins it."""
    out = {}
    for fused, names in family_of(config.model_type).hf_fused.items():
        for i in range(config.num_layers):
            parts, row = [], 0
            for name in names:
                leaf = LEAF_BY_NAME[name]
                rows = leaf.hf_shape(config)[0]
                parts.append((leaf.hf_name(i), row, row + rows))
                row += rows
            out[fused.format(i=i)] = parts
    return out


def leaves_of(config: ModelConfig) -> tuple[Leaf, ...]:
    """The leaves this config has, in table order."""
    return tuple(leaf for leaf in LEAVES if leaf.present(config))


def nest(config: ModelConfig, value: Callable[[Leaf], object]) -> dict:
    """The params-shaped dict {top-level leaves..., "layers": {per-layer leaves...}} holding
    value(leaf) for every leaf of the config."""
    out: dict = {}
    layers: dict = {}
    for leaf in leaves_of(config):
        (layers if leaf.per_layer else out)[leaf.name] = value(leaf)
    out["layers"] = layers
    return out
