"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama decoder with q/k/v and gate/up stored fused,
RoPE over part of each head (`partial_rotary_factor`), a sliding window, and LongRoPE.

LongRoPE is implemented in its short regime only (`parse_longrope`): past the original length
transformers switches a whole forward to the long factors while the cached keys keep the short
ones, so its output depends on how a sequence was cut into forwards and no decoding method
could equal another there. The config's max_position_embeddings becomes the original length,
and a longer call is refused by name.

GGUF: "phi3", the fused tensors as in the HF checkpoints, the LongRoPE factors as two tensors
(`rope_factors_short/long`) read into the config.
"""

from __future__ import annotations

import math

from .base import Family, as_int, rope_kind

# q/k/v as one Linear and gate/up as one (the gate's rows first): fused name -> its leaves
HF_FUSED = {"model.layers.{i}.self_attn.qkv_proj.weight": ("wq", "wk", "wv"),
            "model.layers.{i}.mlp.gate_up_proj.weight": ("w_gate", "w_up")}
GGUF_FUSED = {"blk.{i}.attn_qkv.weight": ("wq", "wk", "wv"),
              "blk.{i}.ffn_up.weight": ("w_gate", "w_up")}
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
# Phi-4-mini's remote code reads these and transformers' Phi3 does not; at these values they
# mean the plain model (every layer full attention, no interpolation, no lm_head bias)
HF_NEUTRAL = {"lm_head_bias": (False,), "full_attn_mod": (1,), "interpolate_factor": (1,)}


def parse_longrope(s: dict, f, rotary_dim: int, max_pos: int) -> tuple:
    """`rope_scaling.type = longrope` -> ("longrope", short_factors, long_factors,
    original_max_position_embeddings, attention_factor), as transformers'
    `_compute_longrope_parameters` reads it: the frequencies divided by the short factors up
    to `original_max_position_embeddings` positions, cos and sin scaled by the attention factor
    (given, or sqrt(1 + ln(factor) / ln(original)) with factor = max_position / original).
    f: the config.json's `HFFields`."""

    def factors(name):
        v = s.get(name)
        if not isinstance(v, (list, tuple)) or len(v) != rotary_dim // 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v):
            raise f.error(f"rope_scaling field {name!r} must be a list of {rotary_dim // 2} "
                          f"positive numbers (one per rotary frequency), got {v!r}")
        return tuple(float(x) for x in v)

    short, long = factors("short_factor"), factors("long_factor")
    orig = f.get("original_max_position_embeddings", s.get("original_max_position_embeddings"))
    orig = max_pos if orig is None else as_int(orig, "original_max_position_embeddings",
                                               f.source)
    if orig <= 0:
        raise f.error(f"field 'original_max_position_embeddings' must be positive, got {orig}")
    attn = s.get("attention_factor")
    if attn is None:
        factor = s.get("factor") or max_pos / orig
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    elif isinstance(attn, bool) or not isinstance(attn, (int, float)) or not attn > 0:
        raise f.error(f"rope_scaling field 'attention_factor' must be a positive number, got "
                      f"{attn!r}")
    return ("longrope", short, long, orig, float(attn))


def _from_hf(f, rope) -> dict:
    partial = rope.partial
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) \
            or not 0 < partial <= 1:
        raise f.error(f"field 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    out = dict(partial_rotary_factor=float(partial), sliding_window=f.window())
    if rope_kind(rope.scaling) == "longrope":
        head_dim = f.int("head_dim") or f.need("hidden_size") // f.need("num_attention_heads")
        scaling = parse_longrope(rope.scaling, f, int(head_dim * partial), rope.max_pos)
        out.update(rope_scaling=scaling,  # the short regime only (see the module docstring)
                   max_position_embeddings=min(rope.max_pos, scaling[3]))
    return out


def _to_hf(c) -> dict:
    d = {"sliding_window": c.sliding_window, "partial_rotary_factor": c.partial_rotary_factor}
    if c.rope_scaling is not None and c.rope_scaling[0] == "longrope":
        _, short, long, orig, attn = c.rope_scaling
        d["original_max_position_embeddings"] = orig
        d["rope_scaling"] = {"type": "longrope", "short_factor": list(short),
                             "long_factor": list(long), "attention_factor": attn}
    return d


def longrope_from_gguf(g, half: int, max_pos: int) -> tuple:
    """LongRoPE as llama.cpp's converter writes it (the `rope_factors_short/long` tensors,
    rope.scaling.original_context_length, rope.scaling.attn_factor) -> the config's
    ("longrope", short, long, original, attention_factor); ValueError naming what is wrong.
    g: the file's `gguf.GGUFKeys`."""
    factors = []
    for name in ROPE_FACTORS:
        w = g.tensor(name)
        if w is None:
            raise g.error(f"tensor {name} is missing (LongRoPE needs both factor tensors)")
        if w.shape[0] != half or not all(math.isfinite(x) and x > 0 for x in w.tolist()):
            raise g.error(f"tensor {name} must hold {half} positive factors")
        factors.append(tuple(float(x) for x in w))
    orig = g.int("rope.scaling.original_context_length")
    scale = max_pos / orig
    default = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    attn = g.float("rope.scaling.attn_factor", default)
    return ("longrope", factors[0], factors[1], orig, attn)


def _from_gguf(g, s) -> dict:
    rot = g.int("rope.dimension_count", None)
    partial = 1.0
    if rot is not None:
        partial = rot / s.D
        if int(s.D * partial) != rot:
            raise g.error(f"rope.dimension_count {rot} is not a fraction of the head dim {s.D} "
                          "that transformers can express")
    # llama.cpp writes 0 for "no window" (Phi-4-mini's converter reads none)
    window = g.int("attention.sliding_window", None) if g.value("attention.sliding_window") \
        else None
    out = dict(partial_rotary_factor=partial, sliding_window=window)
    if g.has_tensor(ROPE_FACTORS[0]):
        if s.scaling is not None:
            raise g.error(f"LongRoPE factor tensors together with rope.scaling.type "
                          f"{s.scaling_type!r} are not supported")
        scaling = longrope_from_gguf(g, int(s.D * partial) // 2, s.max_pos)
        out.update(rope_scaling=scaling, max_position_embeddings=min(s.max_pos, scaling[3]))
    return out


PRESETS = {  # from its config.json; LongRoPE's short regime: 4096 positions, and the factor
    # sqrt(1 + ln 32 / ln 4096) on q and k's rotated dims
    "phi-4-mini": dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_layers=32,
        num_heads=24, num_kv_heads=8, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, sliding_window=262144, max_position_embeddings=4096,
        partial_rotary_factor=0.75, bos_token_id=199999, eos_token_id=199999,
        pad_token_id=199999, rope_scaling=("longrope", (1.0,) * 48, (
            1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
            2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
            4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
            8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
            16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884,
            32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97,
            33.28, 33.49, 33.5, 44.16, 47.77), 4096,
            math.sqrt(1 + math.log(32) / math.log(4096)))),
}

FAMILIES = (Family(
    model_type="phi3", hf_class="Phi3ForCausalLM",
    hf_fields=frozenset({"partial_rotary_factor", "original_max_position_embeddings"}),
    hf_neutral=HF_NEUTRAL, from_hf=_from_hf, to_hf=_to_hf, hf_fused=HF_FUSED,
    gguf_arch="phi3", gguf_keys=frozenset({"attention.sliding_window"}),
    gguf_tensors=ROPE_FACTORS, from_gguf=_from_gguf, gguf_fused=GGUF_FUSED, presets=PRESETS),)
