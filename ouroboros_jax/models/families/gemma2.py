"""Gemma 2, and what Gemma 3 (gemma3.py) shares with it: embeddings times sqrt(E), RMSNorm with
(1 + w), GeGLU with tanh GELU, norms before and after attention and the MLP,
`query_pre_attn_scalar`, and local sliding-window layers beside global ones (`layer_types`,
else every 2nd layer global). Gemma 2 alone: attention and final logit soft caps (transformers'
defaults 50 and 30 when absent).

GGUF: "gemma2"; llama.cpp's converter adds 1 to every RMSNorm weight (taken off again here, as
transformers does) and writes no key for the score scale, which llama.cpp derives from the
model's size (`common_from_gguf`).
"""

from __future__ import annotations

from .base import Family

# what every Gemma has, whatever file it came from (ModelConfig fields)
FEATURES = {"hidden_act": "gelu_pytorch_tanh", "norm_unit_offset": True, "embed_scale": True,
            "sandwich_norms": True}
# config.json fields Gemma 2 and 3 read ("hidden_act": checked here, not only "silu")
HF_FIELDS = frozenset({
    "hidden_act", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "layer_types", "use_bidirectional_attention",
    "sliding_window_size",
})
LAYER_KINDS = ("sliding_attention", "full_attention")


def _sliding_layers(f, L: int, pattern) -> tuple:
    """Per layer, whether it is local: config.json's `layer_types`, else every `pattern()`-th
    layer global (pattern is read only when layer_types is absent)."""
    types = f.get("layer_types")
    if types is None:
        every = pattern()
        return tuple(bool((i + 1) % every) for i in range(L))
    if not isinstance(types, list) or len(types) != L or any(t not in LAYER_KINDS for t in types):
        raise f.error(f"field 'layer_types' must list {L} entries, each one of {LAYER_KINDS}, "
                      f"got {types!r}")
    return tuple(t == "sliding_attention" for t in types)


def common_from_hf(f, pattern) -> dict:
    """The fields of a Gemma 2 / Gemma 3 config.json they read alike, strictly: a value that
    would change the numerics and is not implemented is refused naming the field. pattern:
    () -> every how many layers one is global, when layer_types is absent."""
    act = f.get("hidden_activation") or "gelu_pytorch_tanh"  # transformers' default
    if act != "gelu_pytorch_tanh":
        raise f.error(f"hidden_activation {act!r} unsupported (only 'gelu_pytorch_tanh')")
    if f.get("hidden_act") not in (None, act):  # transformers reads hidden_activation only
        raise f.error(f"hidden_act {f.get('hidden_act')!r} differs from hidden_activation "
                      f"{act!r}")
    if f.get("use_bidirectional_attention"):
        raise f.error("use_bidirectional_attention=true is unsupported")
    if f.get("sliding_window") is None:
        raise f.error(f"required field 'sliding_window' is missing ({f.get('model_type')} has "
                      "local sliding-window layers)")
    if f.get("sliding_window_size") not in (None, f.get("sliding_window")):
        raise f.error(f"sliding_window_size {f.get('sliding_window_size')!r} differs from "
                      f"sliding_window {f.get('sliding_window')!r}")
    return dict(hidden_act=act, sliding_window=f.window(),
                sliding_layers=_sliding_layers(f, f.need("num_hidden_layers"), pattern),
                query_pre_attn_scalar=f.positive("query_pre_attn_scalar", required=True))


def _from_hf(f, rope) -> dict:
    attn_cap = f.positive("attn_logit_softcapping", default=50.0)
    return dict(common_from_hf(f, lambda: 2), attn_softcap=attn_cap,
                final_softcap=f.positive("final_logit_softcapping", default=30.0))


def common_to_hf(c) -> dict:
    """The config.json fields of a Gemma 2 / Gemma 3 config (the inverse of its from_hf)."""
    d = dict(hidden_act=c.hidden_act, hidden_activation=c.hidden_act,
             query_pre_attn_scalar=c.query_pre_attn_scalar,
             attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.final_softcap,
             sliding_window=c.sliding_window, attention_bias=False)
    if c.sliding_layers is not None:
        d["layer_types"] = ["sliding_attention" if s else "full_attention"
                            for s in c.sliding_layers]
    return d


def common_from_gguf(g, s, window_default, pattern: int, big_layers: int) -> dict:
    """The fields of a Gemma GGUF, as llama.cpp reads the file (llama-model.cpp): the window
    (`window_default` when the key is absent; "required": refused), every `pattern`-th layer
    global, and no key for the score scale: 1/sqrt(E/H) for the 27B models (`big_layers`
    layers), 1/sqrt(D) else."""
    window = g.int("attention.sliding_window", window_default)
    big = s.L == big_layers
    return dict(query_pre_attn_scalar=float(s.E // s.H if big else s.D), sliding_window=window,
                sliding_layers=tuple(bool((i + 1) % pattern) for i in range(s.L)))


def _from_gguf(g, s) -> dict:
    return dict(common_from_gguf(g, s, 4096, pattern=2, big_layers=46),
                attn_softcap=g.float("attn_logit_softcapping", 50.0),
                final_softcap=g.float("final_logit_softcapping", 30.0))


def preset(every: int, **kw) -> dict:
    """A Gemma preset's fields: tied embeddings, eps 1e-6, every `every`-th layer global."""
    layers = tuple(bool((i + 1) % every) for i in range(kw["num_layers"]))
    return dict(tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_layers=layers, **kw)


# Sizes from their config.json texts (tests/data/hub_configs for gemma-2-2b-it, gemma-2-9b-it;
# gemma-2-27b's as quoted in public repositories: head_dim 128, query_pre_attn_scalar 144)
_GEMMA2 = dict(vocab_size=256000, attn_softcap=50.0, final_softcap=30.0, rope_theta=10000.0,
               max_position_embeddings=8192, sliding_window=4096)
PRESETS = {
    "gemma-2-2b": preset(2, hidden_size=2304, intermediate_size=9216, num_layers=26,
                         num_heads=8, num_kv_heads=4, head_dim=256, query_pre_attn_scalar=256,
                         **_GEMMA2),
    "gemma-2-9b": preset(2, hidden_size=3584, intermediate_size=14336, num_layers=42,
                         num_heads=16, num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256,
                         **_GEMMA2),
    "gemma-2-27b": preset(2, hidden_size=4608, intermediate_size=36864, num_layers=46,
                          num_heads=32, num_kv_heads=16, head_dim=128,
                          query_pre_attn_scalar=144, **_GEMMA2),
}

FAMILIES = (Family(
    model_type="gemma2", hf_class="Gemma2ForCausalLM", features=FEATURES, hf_fields=HF_FIELDS,
    tied_by_default=True, from_hf=_from_hf, to_hf=common_to_hf, gguf_arch="gemma2",
    gguf_keys=frozenset({"attention.sliding_window", "attn_logit_softcapping",
                         "final_logit_softcapping"}),
    from_gguf=_from_gguf, gguf_norm_shift=1.0, presets=PRESETS),)
