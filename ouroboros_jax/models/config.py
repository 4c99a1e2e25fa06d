"""Model configuration: one frozen, hashable dataclass, static under `jit`.

`ModelConfig.from_hf_dict` is strict: a field it does not understand, or a value it does not
implement, is refused with a `ValueError` naming the field, because silently ignoring (say) an
attention bias would load weights "fine" and then produce wrong tokens.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")

# Fields of a Hugging Face config.json that `from_hf_dict` reads (or checks) itself.
_READ_HF_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
    "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "bos_token_id", "eos_token_id", "pad_token_id",
    # phi3 only (refused elsewhere)
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
# Qwen2 bookkeeping that only matters with use_sliding_window=true (refused).
HF_QWEN2_WINDOW_FIELDS = frozenset({"max_window_layers", "layer_types"})
# Fields accepted only at the value that leaves the numerics as implemented; any other value
# is refused by name.
HF_NEUTRAL_VALUES: dict[str, tuple] = {
    "rope_interleaved": (False,),  # SmolLM2: rotate-half rope, as implemented
    "use_mrope": (False,),  # Qwen2.5: multimodal rope off
    "partial_rotary_factor": (1, 1.0),  # rope over the whole head (phi3 reads it)
    # Phi-4-mini: fields of its remote code that transformers' Phi3 does not read, at the
    # values that mean the plain model (every layer full attention, no interpolation)
    "lm_head_bias": (False,),
    "full_attn_mod": (1,),
    "interpolate_factor": (1,),
}
# Gemma 2 / Gemma 3 fields, read by `_gemma_fields` (and refused for every other model type);
# `_sliding_window_pattern` is transformers' private copy, overwritten from
# `sliding_window_pattern` when it loads a config.
HF_GEMMA_FIELDS = frozenset({
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "layer_types", "sliding_window_pattern", "_sliding_window_pattern",
    "rope_local_base_freq", "use_bidirectional_attention", "sliding_window_size",
})
NUMERICS_NEUTRAL_FIELDS = (HF_METADATA_FIELDS | HF_TRAINING_FIELDS | HF_QWEN2_WINDOW_FIELDS
                           | frozenset(HF_NEUTRAL_VALUES))
_IGNORED_HF_FIELDS = _READ_HF_FIELDS | NUMERICS_NEUTRAL_FIELDS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, Mistral, Qwen2), and of
    Gemma 2 / Gemma 3 text through the feature fields below `pad_token_id`.

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
    # LongRoPE in its short regime (see `_parse_longrope`)
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
    # Gemma 2 / 3 features (`_gemma_fields`), each off for the Llama family:
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

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
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
        _check_gemma_features(self)

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

    def num_params(self) -> int:
        E, F, L, H, K, D, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size)
        per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * F + 2 * E
        if self.qkv_bias:
            per_layer += H * D + 2 * K * D
        per_layer += 2 * E * self.sandwich_norms + 2 * D * self.qk_norm
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    # ---------------------------------------------------------------- Hugging Face interop
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Strictly converts a Hugging Face config dict; raises ValueError naming the field."""

        if not isinstance(d, dict):
            raise ValueError(f"{source}: must hold a JSON object of config fields, got a "
                             f"{type(d).__name__}")

        def need(name):
            if name not in d or d[name] is None:
                raise ValueError(f"{source}: required field {name!r} is missing")
            return _int(d[name], name, source)

        def opt_int(name, default):
            v = d.get(name)
            return default if v is None else _int(v, name, source)

        def opt_float(name, default):
            v = d.get(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{source}: field {name!r} must be a number, got {v!r}")
            return float(v)

        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        gemma = model_type in GEMMA_MODEL_TYPES
        if model_type == "gemma3_text":
            d = _flat_gemma3_rope(d, source)
        unknown = sorted(k for k in d if k not in _IGNORED_HF_FIELDS
                         and not (gemma and k in HF_GEMMA_FIELDS))
        if unknown:
            raise ValueError(f"{source}: unsupported config field(s) {unknown}; refusing to load "
                             "a model whose numerics might differ from what is implemented")
        for name, allowed in HF_NEUTRAL_VALUES.items():
            if model_type == "phi3" and name == "partial_rotary_factor":
                continue  # implemented for phi3
            if name in d and d[name] is not None and (
                    isinstance(d[name], bool) != isinstance(allowed[0], bool)
                    or d[name] not in allowed):
                raise ValueError(f"{source}: {name}={d[name]!r} is unsupported (only "
                                 f"{allowed[0]!r} is implemented)")
        if not gemma and d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} unsupported (only 'silu')")
        if d.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is unsupported")
        if d.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is unsupported")

        # transformers >= 5 stores rope settings in `rope_parameters`; older ones use
        # `rope_theta` + `rope_scaling`.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ValueError(f"{source}: field 'rope_theta' must be a positive number, got "
                             f"{theta!r}")
        scaling_src = d.get("rope_scaling") or {}
        if not isinstance(scaling_src, dict):
            raise ValueError(f"{source}: field 'rope_scaling' must be an object, got "
                             f"{scaling_src!r}")
        if not scaling_src and rope.get("rope_type", "default") != "default":
            scaling_src = rope
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if model_type != "phi3":
            if "original_max_position_embeddings" in d:
                raise ValueError(f"{source}: field 'original_max_position_embeddings' is "
                                 f"unsupported for {model_type} (a phi3 field)")
        elif isinstance(partial, bool) or not isinstance(partial, (int, float)) \
                or not 0 < partial <= 1:
            raise ValueError(f"{source}: field 'partial_rotary_factor' must be in (0, 1], got "
                             f"{partial!r}")
        max_pos = opt_int("max_position_embeddings", 2048)
        if model_type == "phi3" and scaling_src.get("rope_type",
                                                    scaling_src.get("type")) == "longrope":
            head_dim = opt_int("head_dim", None) or need("hidden_size") // need(
                "num_attention_heads")
            rope_scaling = _parse_longrope(scaling_src, d, source, int(head_dim * partial),
                                           max_pos)
            max_pos = min(max_pos, rope_scaling[3])  # the short regime only (see there)
        else:
            rope_scaling = _parse_rope_scaling(scaling_src, source)

        sliding = None
        if model_type in ("mistral", "phi3"):
            sliding = d.get("sliding_window")
        elif model_type in ("qwen2", "qwen3") and d.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is unsupported for "
                             f"{model_type}")
        gemma_kw = _gemma_fields(d, source, model_type, need) if gemma else {}
        if gemma:
            sliding = d["sliding_window"]

        heads = need("num_attention_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "sliding_window"):
            if d.get(name) is not None and _int(d[name], name, source) <= 0:
                raise ValueError(f"{source}: field {name!r} must be positive, got {d[name]!r}")
        eps = opt_float("rms_norm_eps", 1e-6)
        if not 0 < eps < 1:
            raise ValueError(f"{source}: field 'rms_norm_eps' must be in (0, 1), got {eps!r}")
        tie = d.get("tie_word_embeddings", gemma)  # transformers' default: Gemma ties
        if not isinstance(tie, bool):
            raise ValueError(f"{source}: field 'tie_word_embeddings' must be true or false, got "
                             f"{tie!r}")
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=opt_int("num_key_value_heads", None) or heads,
            head_dim=opt_int("head_dim", None),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=eps,
            tie_word_embeddings=tie,
            qkv_bias=model_type == "qwen2",
            sliding_window=_int(sliding, "sliding_window", source) if sliding else None,
            max_position_embeddings=max_pos,
            model_type=model_type,
            bos_token_id=_token_id(d.get("bos_token_id"), "bos_token_id", source),
            eos_token_id=normalize_eos(d.get("eos_token_id"), f"{source}: field 'eos_token_id'"),
            pad_token_id=_token_id(d.get("pad_token_id"), "pad_token_id", source),
            partial_rotary_factor=float(partial),
            **{"qk_norm": model_type == "qwen3", **gemma_kw},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers loads for this model."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}[self.model_type]
        d: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type,
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
        if self.model_type == "llama":
            d.update(attention_bias=False, mlp_bias=False)
        if self.model_type == "qwen3":
            d["attention_bias"] = False
        if self.model_type in ("mistral", "phi3"):
            d["sliding_window"] = self.sliding_window
        if self.model_type == "phi3":
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_scaling is not None:
            if self.rope_scaling[0] == "longrope":
                _, short, long, orig, attn = self.rope_scaling
                d["original_max_position_embeddings"] = orig
                d["rope_scaling"] = {"type": "longrope", "short_factor": list(short),
                                     "long_factor": list(long), "attention_factor": attn}
            elif self.rope_scaling[0] == "factors":
                d["rope_scaling"] = llama3_from_factors(self.rope_theta, self.head_dim,
                                                        self.rope_scaling[1])
            elif self.rope_scaling[0] == "linear":
                d["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling[1]}
            else:
                _, f, lo, hi, orig = self.rope_scaling
                d["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                     "high_freq_factor": hi,
                                     "original_max_position_embeddings": orig}
        if self.model_type in GEMMA_MODEL_TYPES:
            _gemma_to_hf(self, d)
        return d


def _int(v, name: str, source: str) -> int:
    """An integer config field; refuses strings, bools and fractional numbers by name."""
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float)
                                                           and v.is_integer())):
        raise ValueError(f"{source}: field {name!r} must be an integer, got {v!r}")
    return int(v)


def _token_id(v, name: str, source: str) -> Optional[int]:
    if v is None:
        return None
    v = _int(v, name, source)
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


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                   original: int) -> list[float]:
    """The per-frequency divisors [D/2] of transformers' llama3 rope scaling (its inverse
    frequencies are the plain ones divided by these), as llama.cpp's converter writes them
    into a GGUF's `rope_freqs` tensor: 1 above the high-frequency wavelength bound, `factor`
    below the low one, the reciprocal of the smooth interpolation between."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(float(factor))
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def llama3_from_factors(theta: float, head_dim: int, factors) -> dict:
    """The llama3 `rope_scaling` dict whose divisors (`llama3_factors`) are `factors`, for
    writing a GGUF's rope factors as a config.json. The divisors fix the factor and, through
    the smooth band, original/(high-low) and low/(high-low); low = 1 (every Llama 3.x) picks
    the rest. ValueError naming rope_freqs when no llama3 scaling gives these divisors."""
    factors = [float(f) for f in factors]
    f = max(factors)
    band = [(2 * math.pi * theta ** (2 * i / head_dim), r) for i, r in enumerate(factors)
            if 1 + 1e-6 < r < f * (1 - 1e-6)]
    fail = ValueError("rope_freqs: these rope frequency factors are not those of a llama3 "
                      "rope_scaling, so they have no config.json form")
    if f <= 1 or len(band) < 2:
        raise fail
    # s = (1/r - 1/f) / (1 - 1/f) = a / wavelen - b over the smooth band: a line in 1/wavelen
    xs = [1 / w for w, _ in band]
    ys = [(1 / r - 1 / f) / (1 - 1 / f) for _, r in band]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
         / sum((x - mx) ** 2 for x in xs))
    b = a * mx - my
    if not (a > 0 and b > 0):
        raise fail
    d = {"rope_type": "llama3", "factor": f, "low_freq_factor": 1.0,
         "high_freq_factor": round((b + 1) / b, 6),
         "original_max_position_embeddings": round(a / b)}
    again = llama3_factors(theta, head_dim, f, 1.0, d["high_freq_factor"],
                           d["original_max_position_embeddings"])
    if any(abs(x - y) > 1e-4 * y for x, y in zip(again, factors)):
        raise fail
    return d


def _parse_longrope(s: dict, d: dict, source: str, rotary_dim: int,
                    max_pos: int) -> tuple:
    """Phi-3's LongRoPE (`rope_scaling.type = longrope`) -> ("longrope", short_factors,
    long_factors, original_max_position_embeddings, attention_factor), as transformers'
    `_compute_longrope_parameters` reads it: the frequencies divided by the short factors up
    to `original_max_position_embeddings` positions, cos and sin scaled by the attention factor
    (given, or sqrt(1 + ln(factor) / ln(original)) with factor = max_position / original).

    Past the original length transformers switches every position of a forward to the long
    factors once the sequence passes it, while the keys already cached keep the short ones:
    the result depends on how a sequence was split into forwards, so no decoding method could
    equal another there. Only the short regime is implemented: the config's
    max_position_embeddings becomes the original length, and a longer call is refused by
    name (max_cache_len / max_position_embeddings)."""

    def factors(name):
        v = s.get(name)
        if not isinstance(v, (list, tuple)) or len(v) != rotary_dim // 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v):
            raise ValueError(f"{source}: rope_scaling field {name!r} must be a list of "
                             f"{rotary_dim // 2} positive numbers (one per rotary frequency), "
                             f"got {v!r}")
        return tuple(float(x) for x in v)

    short, long = factors("short_factor"), factors("long_factor")
    orig = d.get("original_max_position_embeddings", s.get("original_max_position_embeddings"))
    orig = max_pos if orig is None else _int(orig, "original_max_position_embeddings", source)
    if orig <= 0:
        raise ValueError(f"{source}: field 'original_max_position_embeddings' must be positive, "
                         f"got {orig}")
    attn = s.get("attention_factor")
    if attn is None:
        factor = s.get("factor") or max_pos / orig
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    elif isinstance(attn, bool) or not isinstance(attn, (int, float)) or not attn > 0:
        raise ValueError(f"{source}: rope_scaling field 'attention_factor' must be a positive "
                         f"number, got {attn!r}")
    return ("longrope", short, long, orig, float(attn))


# ---------------------------------------------------------------------------- Gemma 2 / 3
GEMMA_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _check_gemma_features(c: ModelConfig) -> None:
    """Validates the Gemma feature fields of a ModelConfig (ValueError naming the field);
    normalizes sliding_layers to a tuple of bools."""
    if c.hidden_act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"ModelConfig.hidden_act must be one of {GEMMA_ACTIVATIONS}, got "
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


def _flat_gemma3_rope(d: dict, source: str) -> dict:
    """A gemma3_text config with its RoPE settings in the older flat fields: transformers >= 5
    writes `rope_parameters: {full_attention: {...}, sliding_attention: {...}}`; older
    configs `rope_theta` (global layers, default 1e6), `rope_scaling` (global layers only) and
    `rope_local_base_freq` (sliding layers, default 1e4). Local RoPE must be unscaled."""
    d = dict(d)
    rp = d.pop("rope_parameters", None)
    if rp:
        if not isinstance(rp, dict) or set(rp) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"{source}: field 'rope_parameters' of a gemma3_text config must "
                             f"hold 'full_attention' and 'sliding_attention', got {rp!r}")
        full = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
        if "rope_theta" in full:
            d["rope_theta"] = full.pop("rope_theta")
        if full.get("rope_type", full.get("type", "default")) != "default":
            d["rope_scaling"] = full
        if local.get("rope_type", local.get("type", "default")) != "default" or \
                set(local) - {"rope_type", "rope_theta"}:
            raise ValueError(f"{source}: rope_parameters.sliding_attention {local!r} is "
                             "unsupported (only unscaled RoPE on sliding layers)")
        if "rope_theta" in local:
            d["rope_local_base_freq"] = local["rope_theta"]
    d.setdefault("rope_theta", 1_000_000.0)
    return d


def _gemma_fields(d: dict, source: str, model_type: str, need) -> dict:
    """The Gemma feature fields of a gemma2 / gemma3_text config.json, strictly: a value that
    would change the numerics and is not implemented is refused naming the field."""
    gemma3 = model_type == "gemma3_text"
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"  # transformers' default
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{source}: hidden_activation {act!r} unsupported (only "
                         "'gelu_pytorch_tanh')")
    if d.get("hidden_act") not in (None, act):  # transformers reads hidden_activation only
        raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} differs from "
                         f"hidden_activation {act!r}")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true is unsupported")
    not_here = (("sliding_window_pattern", "rope_local_base_freq", "_sliding_window_pattern")
                if not gemma3 else ())
    for name in not_here:
        if name in d:
            raise ValueError(f"{source}: field {name!r} is not part of a {model_type} config")
    if d.get("sliding_window") is None:
        raise ValueError(f"{source}: required field 'sliding_window' is missing ({model_type} "
                         "has local sliding-window layers)")
    if d.get("sliding_window_size") not in (None, d["sliding_window"]):
        raise ValueError(f"{source}: sliding_window_size {d['sliding_window_size']!r} differs "
                         f"from sliding_window {d['sliding_window']!r}")

    def positive(name, required=False, default=None):
        v = d.get(name, default)  # absent: transformers' default; null: none
        if v is None:
            if required:
                raise ValueError(f"{source}: required field {name!r} is missing")
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{source}: field {name!r} must be a positive number, got {v!r}")
        return float(v)

    attn_cap = positive("attn_logit_softcapping", default=None if gemma3 else 50.0)
    if gemma3 and attn_cap is not None:  # transformers' Gemma 3 attention never applies it
        raise ValueError(f"{source}: attn_logit_softcapping={attn_cap} is unsupported for "
                         "gemma3_text")
    L = need("num_hidden_layers")
    types = d.get("layer_types")
    if types is None:
        pattern = 2
        if gemma3:
            pattern = d.get("sliding_window_pattern", 6)
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise ValueError(f"{source}: field 'sliding_window_pattern' must be an integer "
                                 f">= 1, got {pattern!r}")
        sliding = tuple(bool((i + 1) % pattern) for i in range(L))
    else:
        kinds = ("sliding_attention", "full_attention")
        if not isinstance(types, list) or len(types) != L or any(t not in kinds for t in types):
            raise ValueError(f"{source}: field 'layer_types' must list {L} entries, each one "
                             f"of {kinds}, got {types!r}")
        sliding = tuple(t == "sliding_attention" for t in types)
    out = dict(hidden_act=act, norm_unit_offset=True, embed_scale=True, sandwich_norms=True,
               qk_norm=gemma3, query_pre_attn_scalar=positive("query_pre_attn_scalar", True),
               attn_softcap=attn_cap, final_softcap=positive("final_logit_softcapping", default=None if gemma3 else 30.0),
               sliding_layers=sliding)
    if gemma3:
        out["rope_local_theta"] = positive("rope_local_base_freq") or 10_000.0
    return out


def _gemma_to_hf(c: ModelConfig, d: dict) -> None:
    """Adds a Gemma config's own fields to its config.json dict `d` (in place)."""
    d.update(hidden_act=c.hidden_act, hidden_activation=c.hidden_act,
             query_pre_attn_scalar=c.query_pre_attn_scalar,
             attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.final_softcap,
             sliding_window=c.sliding_window, attention_bias=False)
    if c.sliding_layers is not None:
        d["layer_types"] = ["sliding_attention" if s else "full_attention"
                            for s in c.sliding_layers]
    if c.model_type == "gemma3_text":
        d["rope_local_base_freq"] = c.rope_local_theta
