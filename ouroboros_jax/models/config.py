"""Model configuration: one frozen, hashable dataclass, static under `jit`.

`ModelConfig.from_hf_dict` is strict: a field it does not understand, or a value it does not
implement, is refused with a `ValueError` naming the field, because silently ignoring (say) an
attention bias would load weights "fine" and then produce wrong tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Fields of a Hugging Face config.json that carry no meaning for inference numerics.
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "attention_dropout", "dtype", "torch_dtype", "initializer_range",
    "transformers_version", "use_cache", "pretraining_tp", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "tokenizer_class", "auto_map", "model_type",
    "max_window_layers", "layer_types", "use_sliding_window", "sliding_window", "bos_token_id",
    "eos_token_id", "pad_token_id", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
    "embd_pdrop", "resid_pdrop", "chunk_size_feed_forward", "is_decoder", "is_encoder_decoder",
    "problem_type", "id2label", "label2id", "task_specific_params", "finetuning_task",
    "tf_legacy_loss", "use_bfloat16", "torchscript", "pruned_heads", "tie_encoder_decoder",
    "cross_attention_hidden_size", "add_cross_attention", "bad_words_ids", "begin_suppress_tokens",
    "decoder_start_token_id", "sep_token_id", "prefix", "num_labels", "use_return_dict",
})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama 2/3, Mistral, Qwen2).

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
    rope_scaling: Optional[tuple] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: Optional[int] = None
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

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

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        E, F, L, H, K, D, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size)
        per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * F + 2 * E
        if self.qkv_bias:
            per_layer += H * D + 2 * K * D
        return V * E * (1 if self.tie_word_embeddings else 2) + L * per_layer + E

    # ---------------------------------------------------------------- Hugging Face interop
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Strictly converts a Hugging Face config dict; raises ValueError naming the field."""

        def need(name):
            if name not in d or d[name] is None:
                raise ValueError(f"{source}: required field {name!r} is missing")
            return d[name]

        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        unknown = sorted(k for k in d if k not in _IGNORED_HF_FIELDS)
        if unknown:
            raise ValueError(f"{source}: unsupported config field(s) {unknown}; refusing to load "
                             "a model whose numerics might differ from what is implemented")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d['hidden_act']!r} unsupported (only 'silu')")
        if d.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is unsupported")
        if d.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is unsupported")

        # transformers >= 5 stores rope settings in `rope_parameters`; older ones use
        # `rope_theta` + `rope_scaling`.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling_src = d.get("rope_scaling") or {}
        if not scaling_src and rope.get("rope_type", "default") != "default":
            scaling_src = rope
        rope_scaling = _parse_rope_scaling(scaling_src, source)

        sliding = None
        if model_type == "mistral":
            sliding = d.get("sliding_window")
        elif model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is unsupported for qwen2")

        heads = int(need("num_attention_heads"))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=d.get("head_dim"),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            sliding_window=int(sliding) if sliding else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers loads for this model."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            d.update(attention_bias=False, mlp_bias=False)
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.rope_scaling is not None:
            if self.rope_scaling[0] == "linear":
                d["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_scaling[1]}
            else:
                _, f, lo, hi, orig = self.rope_scaling
                d["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                     "high_freq_factor": hi,
                                     "original_max_position_embeddings": orig}
        return d


def _parse_rope_scaling(s: dict, source: str) -> Optional[tuple]:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return ("linear", float(s["factor"]))
    if kind == "llama3":
        try:
            return ("llama3", float(s["factor"]), float(s["low_freq_factor"]),
                    float(s["high_freq_factor"]), int(s["original_max_position_embeddings"]))
        except KeyError as e:
            raise ValueError(f"{source}: rope_scaling of type llama3 lacks field {e}") from None
    raise ValueError(f"{source}: rope_scaling type {kind!r} unsupported "
                     "(supported: default, linear, llama3)")
