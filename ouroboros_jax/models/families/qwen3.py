"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm of q and k before RoPE (`qk_norm`,
leaves `q_norm` / `k_norm`) and a head_dim that need not be hidden / heads. As Qwen2, its
sliding-window option is refused. GGUF: "qwen3", stored unpermuted."""

from __future__ import annotations

from .base import Family
from .qwen2 import refuse_sliding_window


def _to_hf(c) -> dict:
    return {"attention_bias": False}


# Values from each model's config.json (tests/test_families.py checks them against the
# published texts in tests/data/hub_configs)
_QWEN3 = dict(vocab_size=151936, num_kv_heads=8, head_dim=128, rope_theta=1e6,
              rms_norm_eps=1e-6, max_position_embeddings=40960, bos_token_id=151643,
              eos_token_id=151645)
PRESETS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       tie_word_embeddings=True, **_QWEN3),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     **_QWEN3),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                      **_QWEN3),
}

FAMILIES = (Family(
    model_type="qwen3", hf_class="Qwen3ForCausalLM", features={"qk_norm": True},
    from_hf=refuse_sliding_window, to_hf=_to_hf, gguf_arch="qwen3", presets=PRESETS),)
