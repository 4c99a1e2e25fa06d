"""Full-size configurations of the paper's model pairs, for planning (eval_shape only)."""

from .config import ModelConfig

PRESETS = {
    "llama-2-70b": ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, rms_norm_eps=1e-5,
                               max_position_embeddings=4096),
    "llama-2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32, rms_norm_eps=1e-5,
                              max_position_embeddings=4096),
    "yi-34b": ModelConfig(vocab_size=64000, hidden_size=7168, intermediate_size=20480,
                          num_layers=60, num_heads=56, num_kv_heads=8, rope_theta=5e6,
                          rms_norm_eps=1e-5, max_position_embeddings=4096),
    "yi-6b": ModelConfig(vocab_size=64000, hidden_size=4096, intermediate_size=11008,
                         num_layers=32, num_heads=32, num_kv_heads=4, rope_theta=5e6,
                         rms_norm_eps=1e-5, max_position_embeddings=4096),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=5e5,
                              rms_norm_eps=1e-5, max_position_embeddings=8192),
}


def _gemma(kind: str, **kw) -> ModelConfig:
    """A Gemma 2 / Gemma 3 text config with its family's fixed features (tied embeddings,
    GeGLU, (1 + w) norms before and after attention and the MLP; Gemma 2: soft caps 50 / 30
    and every 2nd layer global; Gemma 3: q/k norms, every 6th layer global, a local RoPE base
    of 1e4, 1e6 on global layers)."""
    L = kw["num_layers"]
    if kind == "gemma2":
        fixed = dict(attn_softcap=50.0, final_softcap=30.0, rope_theta=10000.0,
                     max_position_embeddings=8192, sliding_window=4096,
                     sliding_layers=tuple(bool((i + 1) % 2) for i in range(L)))
    else:
        fixed = dict(qk_norm=True, rope_theta=1e6, rope_local_theta=1e4,
                     sliding_layers=tuple(bool((i + 1) % 6) for i in range(L)))
    return ModelConfig(model_type={"gemma2": "gemma2", "gemma3": "gemma3_text"}[kind],
                       tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                       norm_unit_offset=True, embed_scale=True, sandwich_norms=True,
                       rms_norm_eps=1e-6, **fixed, **kw)


# Gemma sizes from their config.json texts (tests/data/hub_configs for gemma-2-2b-it,
# gemma-2-9b-it, gemma-3-1b-it; gemma-2-27b and gemma-3-27b's text_config as quoted in public
# repositories: head_dim 128, query_pre_attn_scalar 144 and 168)
PRESETS.update({
    "gemma-2-2b": _gemma("gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                         num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256,
                         query_pre_attn_scalar=256),
    "gemma-2-9b": _gemma("gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                         num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                         query_pre_attn_scalar=256),
    "gemma-2-27b": _gemma("gemma2", vocab_size=256000, hidden_size=4608,
                          intermediate_size=36864, num_layers=46, num_heads=32, num_kv_heads=16,
                          head_dim=128, query_pre_attn_scalar=144),
    "gemma-3-1b": _gemma("gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                         num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                         query_pre_attn_scalar=256, sliding_window=512,
                         max_position_embeddings=32768),
    "gemma-3-27b": _gemma("gemma3", vocab_size=262208, hidden_size=5376,
                          intermediate_size=21504, num_layers=62, num_heads=32, num_kv_heads=16,
                          head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                          rope_scaling=("linear", 8.0), max_position_embeddings=131072),
})
