"""Gemma 3 text (`gemma3_text`), where it differs from Gemma 2 (gemma2.py): q/k norms, every
6th layer global (`sliding_window_pattern`), a RoPE base of its own on the local layers
(`rope_local_base_freq`, unscaled), no soft cap on the scores (transformers' Gemma 3 attention
never applies one, so a value is refused) and none on the logits by default.

GGUF: "gemma3"; the window is required, the local base is llama.cpp's 10000.
"""

from __future__ import annotations

from .base import Family
from .gemma2 import FEATURES, HF_FIELDS, common_from_gguf, common_from_hf, common_to_hf, preset


def _flat_rope(d: dict, source: str) -> dict:
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


def _pattern(f):
    """() -> sliding_window_pattern (transformers' default 6), checked when it is read."""
    def read() -> int:
        pattern = f.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise f.error(f"field 'sliding_window_pattern' must be an integer >= 1, got "
                          f"{pattern!r}")
        return pattern
    return read


def _from_hf(f, rope) -> dict:
    attn_cap = f.positive("attn_logit_softcapping")
    if attn_cap is not None:
        raise f.error(f"attn_logit_softcapping={attn_cap} is unsupported for gemma3_text")
    return dict(common_from_hf(f, _pattern(f)), attn_softcap=None,
                final_softcap=f.positive("final_logit_softcapping"),
                rope_local_theta=f.positive("rope_local_base_freq") or 10_000.0)


def _to_hf(c) -> dict:
    return dict(common_to_hf(c), rope_local_base_freq=c.rope_local_theta)


def _from_gguf(g, s) -> dict:
    return dict(common_from_gguf(g, s, "required", pattern=6, big_layers=62),
                rope_local_theta=10000.0)


# Sizes from their config.json texts (tests/data/hub_configs for gemma-3-1b-it; gemma-3-27b's
# text_config as quoted in public repositories: head_dim 128, query_pre_attn_scalar 168)
_GEMMA3 = dict(rope_theta=1e6, rope_local_theta=1e4)
PRESETS = {
    "gemma-3-1b": preset(6, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                         num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                         query_pre_attn_scalar=256, sliding_window=512,
                         max_position_embeddings=32768, **_GEMMA3),
    "gemma-3-27b": preset(6, vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                          num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
                          query_pre_attn_scalar=168, sliding_window=1024,
                          rope_scaling=("linear", 8.0), max_position_embeddings=131072,
                          **_GEMMA3),
}

FAMILIES = (Family(
    model_type="gemma3_text", hf_class="Gemma3ForCausalLM",
    features=dict(FEATURES, qk_norm=True),
    hf_fields=HF_FIELDS | {"sliding_window_pattern", "_sliding_window_pattern",
                           "rope_local_base_freq"},
    tied_by_default=True, normalize_hf=_flat_rope, from_hf=_from_hf, to_hf=_to_hf,
    gguf_arch="gemma3", gguf_keys=frozenset({"attention.sliding_window"}),
    from_gguf=_from_gguf, gguf_norm_shift=1.0, presets=PRESETS),)
