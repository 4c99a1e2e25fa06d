"""OLMoE (allenai/OLMoE-1B-7B): the Llama decoder with q and k each RMS-normalized over all
heads at once, before the split into heads and RoPE (`qk_norm_across_heads`, leaves
`q_norm_all` [H,D] / `k_norm_all` [K,D]), and a mixture of `num_experts` experts of
`intermediate_size` in every layer: a softmax router, the top `num_experts_per_tok`,
renormalized when `norm_topk_prob`. `clip_qkv` (clamping q, k and v) is refused unless null.
GGUF: "olmoe" (llama.cpp never renormalizes its top k, so its files load without
`norm_topk_prob`), stored unpermuted.
"""

from __future__ import annotations

from .base import Family
from .qwen3_moe import GGUF_MOE_KEYS, MOE_IGNORED, experts_count, moe_from_gguf, moe_from_hf


def _from_hf(f, rope) -> dict:
    if f.get("clip_qkv") is not None:
        raise f.error(f"clip_qkv={f.get('clip_qkv')!r} is unsupported (only null)")
    heads, hidden = f.need("num_attention_heads"), f.need("hidden_size")
    if f.get("head_dim") is not None and f.int("head_dim") * heads != hidden:
        # transformers sizes OLMoE's k_norm by hidden_size // heads whatever head_dim says
        raise f.error(f"head_dim={f.get('head_dim')} is unsupported for olmoe (only "
                      f"hidden_size / num_attention_heads = {hidden // heads})")
    n = experts_count(f, ("num_experts", "num_local_experts"))
    return moe_from_hf(f, n, f.need("intermediate_size"), f.get("norm_topk_prob", False))


def _from_gguf(g, shape) -> dict:
    return moe_from_gguf(g, False)


def _to_hf(c) -> dict:
    return {"attention_bias": False, "clip_qkv": None, "num_experts": c.num_experts,
            "num_experts_per_tok": c.experts_per_token, "norm_topk_prob": c.norm_topk_prob}


# Values from the model's config.json (allenai/OLMoE-1B-7B-0924)
PRESETS = {
    "olmoe-1b-7b": dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                        num_layers=16, num_heads=16, num_kv_heads=16, rope_theta=10000.0,
                        rms_norm_eps=1e-5, max_position_embeddings=4096, eos_token_id=50279,
                        pad_token_id=1, num_experts=64, experts_per_token=8),
}

FAMILIES = (Family(
    model_type="olmoe", hf_class="OlmoeForCausalLM", features={"qk_norm_across_heads": True},
    hf_fields=frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                         "norm_topk_prob", "clip_qkv"}),
    hf_ignored=MOE_IGNORED, from_hf=_from_hf, to_hf=_to_hf, gguf_arch="olmoe",
    gguf_keys=GGUF_MOE_KEYS, from_gguf=_from_gguf, presets=PRESETS),)
