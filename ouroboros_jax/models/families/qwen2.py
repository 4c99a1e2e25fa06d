"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5, Qwen2.5-Coder): the Llama decoder with biases on the q, k
and v projections. Its sliding-window option (`use_sliding_window: true`) is refused; the
fields that only matter with it are bookkeeping otherwise. GGUF: "qwen2", stored unpermuted
(llama.cpp rotates it NeoX-style, as transformers does)."""

from __future__ import annotations

from .base import Family


def refuse_sliding_window(f, rope) -> dict:
    """Qwen2 and Qwen3's `use_sliding_window: true` (windows on some layers) is not implemented."""
    if f.get("use_sliding_window"):
        raise f.error(f"use_sliding_window=true is unsupported for {f.get('model_type')}")
    return {}


# Values from each model's config.json, checked against its GGUFs' metadata
_CODER = dict(vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
              max_position_embeddings=32768)
PRESETS = {  # the real pair the accelerator projection and device script size
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28,
                               num_heads=12, num_kv_heads=2, **_CODER),
    "qwen2.5-coder-0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24,
                               num_heads=14, num_kv_heads=2, **_CODER),
}

FAMILIES = (Family(
    model_type="qwen2", hf_class="Qwen2ForCausalLM", features={"qkv_bias": True},
    # use_mrope: Qwen2.5's multimodal rope, off; the window's layer bookkeeping (Qwen3 and
    # fine-tunes of either copy them)
    hf_neutral={"use_mrope": (False,)}, hf_ignored=frozenset({"max_window_layers", "layer_types"}),
    from_hf=refuse_sliding_window, gguf_arch="qwen2", presets=PRESETS),)
