"""Model configuration: one frozen, hashable dataclass, static under `jit`.

`ModelConfig.from_hf_dict` is strict: a field it does not understand, or a value it does not
implement, is refused with a `ValueError` naming the field, because silently ignoring (say) an
attention bias would load weights "fine" and then produce wrong tokens. It reads the fields
every family shares; each family's own (names, defaults, translation both ways) live in its
module under `models/families/`, which this module consults and never branches on.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional

from .families import (BY_MODEL_TYPE, HF_IGNORED_FIELDS, SUPPORTED_MODEL_TYPES, Family,
                       family_of)
from .families import HF_NEUTRAL_VALUES as _FAMILY_NEUTRAL_VALUES
from .families.base import HFFields, HFRope, as_int
# the Llama 3 RoPE: a GGUF's rope_freqs written back as a config.json (re-exported)
from .families.llama import llama3_factors, llama3_from_factors  # noqa: F401

# Fields of a Hugging Face config.json that `from_hf_dict` reads (or checks) itself, in every
# family; a family's own fields are its `Family.hf_fields` (models/families/).
_READ_HF_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
    "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "bos_token_id", "eos_token_id", "pad_token_id",
    # transformers reads it for some RoPE types of any model; refused by name (`_hf_rope`)
    # unless the family reads it (Phi-3's LongRoPE)
    "original_max_position_embeddings",
})

# Hub config fields accepted without effect because they do not change inference numerics
# (README "Real models" lists them). Metadata and transformers' bookkeeping: names, versions,
# the class to build, which kernel or dtype to run with (we run what `load_model` is told).
HF_METADATA_FIELDS = frozenset({
    "architectures", "_name_or_path", "_model_name_or_path", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_from_model_config", "transformers_version", "transformers.js_config", "dtype",
    "torch_dtype", "use_bfloat16", "torchscript", "auto_map", "tokenizer_class",
    "is_llama_config", "unk_token_id", "sep_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "use_cache",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    "task_specific_params", "prefix", "bad_words_ids", "begin_suppress_tokens",
    "is_decoder", "is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "pruned_heads", "chunk_size_feed_forward", "tf_legacy_loss",
    "cache_implementation",
})
# Training-only fields: dropout is off at inference, initialisers and tensor-parallel
# pretraining slices (pretraining_tp) compute the same function.
HF_TRAINING_FIELDS = frozenset({
    "attention_dropout", "embd_pdrop", "resid_pdrop", "hidden_dropout", "initializer_range",
    "pretraining_tp",
})
# Fields accepted only at the value that leaves the numerics as implemented; any other value
# is refused by name (unless the config's family implements it: `Family.hf_fields`). The
# families' own (SmolLM2's rope_interleaved, ...) are declared in their modules.
HF_NEUTRAL_VALUES: dict[str, tuple] = {
    "partial_rotary_factor": (1, 1.0),  # rope over the whole head (phi3 reads it)
    **_FAMILY_NEUTRAL_VALUES,
}
NUMERICS_NEUTRAL_FIELDS = (HF_METADATA_FIELDS | HF_TRAINING_FIELDS | HF_IGNORED_FIELDS
                           | frozenset(HF_NEUTRAL_VALUES))
_IGNORED_HF_FIELDS = _READ_HF_FIELDS | NUMERICS_NEUTRAL_FIELDS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of the decoder every family runs (models/families/): the Llama
    one, and the features other families switch on through the fields below `pad_token_id`.

    Dimension letters: E = hidden_size, F = intermediate_size, L = num_layers,
    H = num_heads, K = num_kv_heads, D = head_dim, V = vocab_size.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    # ("linear", factor) or ("llama3", factor, low_freq_factor, high_freq_factor, original_max_pos)
    # or ("factors", (one divisor per frequency, D/2 floats)): a GGUF's `rope_freqs` tensor
    # or ("longrope", short_factors, long_factors, original_max_pos, attention_factor): Phi-3's
    # LongRoPE in its short regime (see `families/phi3.py`)
    rope_scaling: Optional[tuple] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: Optional[int] = None
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    bos_token_id: Optional[int] = None
    # one id or a tuple of ids (Llama 3 / Qwen2.5 instruct configs list several)
    eos_token_id: Optional[int | tuple] = None
    pad_token_id: Optional[int] = None
    # Phi-3 / Phi-4-mini: RoPE rotates only the first int(D * factor) dims of each head
    partial_rotary_factor: float = 1.0
    # Gemma 2 / 3 features (families/gemma2.py, gemma3.py), each off for the Llama family:
    # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, tanh GELU)
    hidden_act: str = "silu"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w) instead of w
    embed_scale: bool = False  # embeddings times sqrt(E) (cast to the params' dtype)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by its -1/2 (None: D)
    attn_softcap: Optional[float] = None  # scores -> c * tanh(scores / c)
    final_softcap: Optional[float] = None  # logits -> c * tanh(logits / c)
    # per layer: True where the layer attends within `sliding_window` (Gemma's local layers);
    # None: every layer does when `sliding_window` is set (Mistral)
    sliding_layers: Optional[tuple] = None
    rope_local_theta: Optional[float] = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    # q and k normalized over all heads at once, before the split into heads (OLMoE; its leaves
    # q_norm_all [H,D] / k_norm_all [K,D]), instead of per head (`qk_norm`)
    qk_norm_across_heads: bool = False
    # Mixture of experts (families/qwen3_moe.py, mixtral.py, olmoe.py), 0 experts: a dense MLP.
    # Every layer's MLP is then `num_experts` SwiGLU experts of `moe_intermediate_size` (None:
    # intermediate_size) and a router: softmax over the experts' logits (fp32), the top
    # `experts_per_token`, renormalized to sum to 1 when `norm_topk_prob`.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = False
    # how the experts run (llama.py, `_moe`): "grouped" sorts the (token, expert) assignments by
    # expert and multiplies each routed expert's rows with its weights, read once, by
    # `jax.lax.ragged_dot`; "onehot" runs every expert on every token and weights the results
    # (the reference the tests and the bench compare with). The same numbers either way.
    moe_dispatch: str = "grouped"

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_experts and self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type {self.model_type!r} is not one of "
                             f"{SUPPORTED_MODEL_TYPES}")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f <= 1 \
                or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor must be in (0, 1] and leave an "
                             f"even number of rotary dims, got {f!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < 1:
            # eps <= 0 divides by zero on an all-zero row; >= 1 is surely a typo
            raise ValueError(f"ModelConfig.rms_norm_eps must be a number in (0, 1), got {eps!r}")
        object.__setattr__(self, "eos_token_id",
                           normalize_eos(self.eos_token_id, "ModelConfig.eos_token_id"))
        _check_features(self)

    @property
    def rotary_dim(self) -> int:
        """Head dims RoPE rotates (the first ones), as transformers: int(D * factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_attention_scale(self) -> float:
        """LongRoPE's factor on cos and sin (so on q and k's rotated dims); 1 otherwise."""
        sc = self.rope_scaling
        return float(sc[4]) if sc is not None and sc[0] == "longrope" else 1.0

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a mixture of experts (`num_experts` > 0)."""
        return self.num_experts > 0

    def num_params(self) -> int:
        E, F, L, H, K, D, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size)
        if self.is_moe:  # the router [E, Y] and Y experts' gate, up and down
            mlp = E * self.num_experts + 3 * self.num_experts * E * self.moe_intermediate_size
        else:
            mlp = 3 * E * F
        per_layer = E * H * D + 2 * E * K * D + H * D * E + mlp + 2 * E
        if self.qkv_bias:
            per_layer += H * D + 2 * K * D
        per_layer += 2 * E * self.sandwich_norms + 2 * D * self.qk_norm
        per_layer += (H + K) * D * self.qk_norm_across_heads
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    def expert_params(self) -> int:
        """Parameters of the routed experts, all layers (gate, up and down of each; the router
        is not one): 0 for a dense model."""
        if not self.is_moe:
            return 0
        return 3 * self.num_layers * self.num_experts * self.hidden_size * \
            self.moe_intermediate_size

    def active_params(self) -> int:
        """Parameters a token uses: `num_params` less the experts it does not route to (all
        but experts_per_token of num_experts per layer); `num_params` for a dense model."""
        if not self.is_moe:
            return self.num_params()
        idle = self.expert_params() // self.num_experts * \
            (self.num_experts - self.experts_per_token)
        return self.num_params() - idle

    # ---------------------------------------------------------------- Hugging Face interop
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Strictly converts a Hugging Face config dict; raises ValueError naming the field.
        The fields every family shares are read here, the family's own by its
        `Family.from_hf` (models/families/)."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: must hold a JSON object of config fields, got a "
                             f"{type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        family = family_of(model_type)
        f = HFFields(family.normalize_hf(d, source), source)
        _check_hf_fields(f, family)
        theta, rope = _hf_rope(f, family)
        own = dict(family.from_hf(f, rope))
        if "rope_scaling" not in own:
            own["rope_scaling"] = _parse_rope_scaling(rope.scaling, source)
        if "partial_rotary_factor" not in own:
            own["partial_rotary_factor"] = float(rope.partial)
        heads = f.need("num_attention_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "sliding_window"):
            if f.get(name) is not None and as_int(f.get(name), name, source) <= 0:
                raise f.error(f"field {name!r} must be positive, got {f.get(name)!r}")
        eps = f.number("rms_norm_eps", 1e-6)
        if not 0 < eps < 1:
            raise f.error(f"field 'rms_norm_eps' must be in (0, 1), got {eps!r}")
        tie = f.get("tie_word_embeddings", family.tied_by_default)
        if not isinstance(tie, bool):
            raise f.error(f"field 'tie_word_embeddings' must be true or false, got {tie!r}")
        kw = dict(
            vocab_size=f.need("vocab_size"),
            hidden_size=f.need("hidden_size"),
            intermediate_size=f.need("intermediate_size"),
            num_layers=f.need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=f.int("num_key_value_heads") or heads,
            head_dim=f.int("head_dim"),
            rope_theta=float(theta),
            rms_norm_eps=eps,
            tie_word_embeddings=tie,
            max_position_embeddings=rope.max_pos,
            model_type=model_type,
            bos_token_id=_token_id(f.get("bos_token_id"), "bos_token_id", source),
            eos_token_id=normalize_eos(f.get("eos_token_id"), f"{source}: field 'eos_token_id'"),
            pad_token_id=_token_id(f.get("pad_token_id"), "pad_token_id", source),
        )
        return cls(**{**kw, **family.features, **own})

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers loads for this model: the shared fields, then
        the family's own (`Family.to_hf`)."""
        family = family_of(self.model_type)
        d: dict[str, Any] = {
            "architectures": [family.hf_class], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                             else self.eos_token_id),
            "pad_token_id": self.pad_token_id,
        }
        own = family.to_hf(self)
        if self.rope_scaling is not None and "rope_scaling" not in own:
            d["rope_scaling"] = _rope_scaling_to_hf(self)
        d.update(own)
        return d


def _check_hf_fields(f: HFFields, family: Family) -> None:
    """Refuses, by name, every field of the config.json that is neither read nor known to
    change nothing, every neutral field at another value, and the activations and biases that
    are not implemented."""
    unknown = sorted(k for k in f.d if k not in _IGNORED_HF_FIELDS
                     and k not in family.hf_fields)
    if unknown:
        raise f.error(f"unsupported config field(s) {unknown}{_readers(unknown)}; refusing to "
                      "load a model whose numerics might differ from what is implemented")
    for name, allowed in HF_NEUTRAL_VALUES.items():
        if name in family.hf_fields:
            continue  # implemented for this family
        v = f.get(name)
        if v is not None and (isinstance(v, bool) != isinstance(allowed[0], bool)
                              or v not in allowed):
            raise f.error(f"{name}={v!r} is unsupported (only {allowed[0]!r} is implemented)")
    if "hidden_act" not in family.hf_fields and f.get("hidden_act", "silu") != "silu":
        raise f.error(f"hidden_act {f.get('hidden_act')!r} unsupported (only 'silu')")
    if f.get("mlp_bias"):
        raise f.error("mlp_bias=true is unsupported")
    if f.get("attention_bias"):
        raise f.error("attention_bias=true is unsupported")


def _readers(fields: list) -> str:
    """" (a phi3 field)"-style notes on the fields some other family reads, for an error
    message: the likely cause is a model_type that does not match the rest of the config."""
    notes = []
    for k in fields:
        types = [t for t, fam in BY_MODEL_TYPE.items() if k in fam.hf_fields]
        if types:
            notes.append(f"{k + ': ' if len(fields) > 1 else ''}a {' / '.join(types)} field")
    return f" ({'; '.join(notes)})" if notes else ""


def _hf_rope(f: HFFields, family: Family) -> tuple[float, HFRope]:
    """(rope_theta, HFRope) of a config.json: transformers >= 5 stores the rope settings in
    `rope_parameters`; older ones use `rope_theta` + `rope_scaling`."""
    rope = dict(f.get("rope_parameters") or {})
    theta = rope.get("rope_theta", f.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise f.error(f"field 'rope_theta' must be a positive number, got {theta!r}")
    scaling = f.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise f.error(f"field 'rope_scaling' must be an object, got {scaling!r}")
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling = rope
    partial = rope.get("partial_rotary_factor", f.get("partial_rotary_factor", 1.0))
    if "original_max_position_embeddings" in f and \
            "original_max_position_embeddings" not in family.hf_fields:
        raise f.error(f"field 'original_max_position_embeddings' is unsupported for "
                      f"{family.model_type}{_readers(['original_max_position_embeddings'])}")
    return theta, HFRope(scaling, partial, f.int("max_position_embeddings", 2048))


def _rope_scaling_to_hf(c: ModelConfig) -> dict:
    """The config.json `rope_scaling` of the scalings every family may have (a family's own,
    Phi-3's LongRoPE, is its `to_hf`'s): linear, llama3, and a GGUF's rope_freqs divisors as
    the llama3 scaling they came from."""
    kind = c.rope_scaling[0]
    if kind == "factors":
        return llama3_from_factors(c.rope_theta, c.head_dim, c.rope_scaling[1])
    if kind == "linear":
        return {"rope_type": "linear", "factor": c.rope_scaling[1]}
    if kind == "llama3":
        _, f, lo, hi, orig = c.rope_scaling
        return {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                "high_freq_factor": hi, "original_max_position_embeddings": orig}
    raise ValueError(f"ModelConfig.rope_scaling of kind {kind!r} has no config.json form for "
                     f"model_type {c.model_type!r}")


def _token_id(v, name: str, source: str) -> Optional[int]:
    if v is None:
        return None
    v = as_int(v, name, source)
    if v < 0:
        raise ValueError(f"{source}: field {name!r} must be a token id >= 0, got {v}")
    return v


def normalize_eos(v, what: str = "eos_token_id") -> Optional[int | tuple]:
    """None, one id, or a tuple of distinct ids (a one-element list becomes its id); ids must
    be integers in [0, 2**31) (they travel as int32). Raises ValueError naming `what`."""
    if v is None:
        return None
    ids = list(v) if isinstance(v, (list, tuple)) else [v]
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < 2**31:
            raise ValueError(f"{what} must be a token id (an integer in [0, 2**31)) or a list "
                             f"of them, got {v!r}")
        if int(i) not in out:
            out.append(int(i))
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


def _parse_rope_scaling(s: dict, source: str) -> Optional[tuple]:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None

    def num(name, cast=float):
        if name not in s:
            raise ValueError(f"{source}: rope_scaling of type {kind} lacks field {name!r}")
        v = s[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{source}: rope_scaling field {name!r} must be a positive number, "
                             f"got {v!r}")
        return cast(v)

    if kind == "linear":
        return ("linear", num("factor"))
    if kind == "llama3":
        return ("llama3", num("factor"), num("low_freq_factor"), num("high_freq_factor"),
                num("original_max_position_embeddings", int))
    raise ValueError(f"{source}: rope_scaling type {kind!r} unsupported "
                     "(supported: default, linear, llama3)")


# ------------------------------------------------------------------------- feature fields
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
MOE_DISPATCHES = ("grouped", "onehot")


def _check_features(c: ModelConfig) -> None:
    """Validates the feature fields of a ModelConfig (Gemma's, so far; ValueError naming the
    field); normalizes sliding_layers to a tuple of bools."""
    if c.hidden_act not in ACTIVATIONS:
        raise ValueError(f"ModelConfig.hidden_act must be one of {ACTIVATIONS}, got "
                         f"{c.hidden_act!r}")
    for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta"):
        v = getattr(c, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                              or not v > 0):
            raise ValueError(f"ModelConfig.{name} must be a positive number or None, got {v!r}")
    if c.sliding_layers is not None:
        layers = tuple(c.sliding_layers)
        if len(layers) != c.num_layers or not all(isinstance(b, bool) for b in layers):
            raise ValueError(f"ModelConfig.sliding_layers must hold one bool per layer "
                             f"({c.num_layers}), got {c.sliding_layers!r}")
        if c.sliding_window is None:
            raise ValueError("ModelConfig.sliding_layers needs a sliding_window")
        object.__setattr__(c, "sliding_layers", layers)
    _check_moe(c)


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral)


def _check_moe(c: ModelConfig) -> None:
    """Validates the mixture-of-experts fields (ValueError naming the field): all at their
    defaults for a dense model; for an MoE one, 1 <= experts_per_token <= num_experts."""
    if not _is_int(c.num_experts) or c.num_experts < 0:
        raise ValueError(f"ModelConfig.num_experts must be an integer >= 0, got "
                         f"{c.num_experts!r}")
    if c.moe_dispatch not in MOE_DISPATCHES:
        raise ValueError(f"ModelConfig.moe_dispatch must be one of {MOE_DISPATCHES}, got "
                         f"{c.moe_dispatch!r}")
    if not isinstance(c.norm_topk_prob, bool):
        raise ValueError(f"ModelConfig.norm_topk_prob must be true or false, got "
                         f"{c.norm_topk_prob!r}")
    if not c.is_moe:
        for name in ("experts_per_token", "moe_intermediate_size", "norm_topk_prob"):
            if getattr(c, name) not in (0, None, False):
                raise ValueError(f"ModelConfig.{name} is set ({getattr(c, name)!r}) but "
                                 "num_experts is 0 (a dense MLP)")
        return
    k = c.experts_per_token
    if not _is_int(k) or not 1 <= k <= c.num_experts:
        raise ValueError(f"ModelConfig.experts_per_token must be an integer in [1, "
                         f"num_experts={c.num_experts}], got {k!r}")
    if not _is_int(c.moe_intermediate_size) or c.moe_intermediate_size <= 0:
        raise ValueError(f"ModelConfig.moe_intermediate_size must be a positive integer, got "
                         f"{c.moe_intermediate_size!r}")
