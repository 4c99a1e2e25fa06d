"""Full-size configurations of the paper's model pairs and of the pairs the accelerator
projection and device script size (Llama 3.1/3.2, the real Qwen2.5-Coder pair), for planning,
lowering and projection (shapes only: nothing here holds weights). Values from each model's
Hugging Face config.json (the Qwen pair's checked against its GGUFs' metadata)."""

import math

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
    "qwen2.5-coder-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                      num_layers=28, num_heads=12, num_kv_heads=2,
                                      rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True,
                                      tie_word_embeddings=True, max_position_embeddings=32768,
                                      model_type="qwen2"),
    "qwen2.5-coder-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                      num_layers=24, num_heads=14, num_kv_heads=2,
                                      rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True,
                                      tie_word_embeddings=True, max_position_embeddings=32768,
                                      model_type="qwen2"),
}

# The canonical target/draft pairs of 2026 (issue 29), as their published config.json texts
# give them (tests/data/hub_configs; tests/test_families.py checks each against its text).
_LLAMA3 = dict(vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5,
               max_position_embeddings=131072, bos_token_id=128000)
PRESETS.update({
    "llama-3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8,
                                rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), **_LLAMA3),
    "llama-3.1-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, num_kv_heads=8,
                                 rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), **_LLAMA3),
    "llama-3.2-1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64,
                                tie_word_embeddings=True,
                                rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192), **_LLAMA3),
})
_QWEN3 = dict(vocab_size=151936, num_kv_heads=8, head_dim=128, rope_theta=1e6,
              rms_norm_eps=1e-6, max_position_embeddings=40960, model_type="qwen3",
              qk_norm=True, bos_token_id=151643, eos_token_id=151645)
PRESETS.update({
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, tie_word_embeddings=True, **_QWEN3),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, **_QWEN3),
    "qwen3-32b": ModelConfig(hidden_size=5120, intermediate_size=25600, num_layers=64,
                             num_heads=64, **_QWEN3),
})
# LongRoPE's short regime only (config._parse_longrope): 4096 positions, and the factor
# sqrt(1 + ln 32 / ln 4096) on q and k's rotated dims
PRESETS["phi-4-mini"] = ModelConfig(
    vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_layers=32, num_heads=24,
    num_kv_heads=8, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    sliding_window=262144, max_position_embeddings=4096, model_type="phi3",
    partial_rotary_factor=0.75, bos_token_id=199999, eos_token_id=199999, pad_token_id=199999,
    rope_scaling=("longrope", (1.0,) * 48, (
        1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
        2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
        4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
        8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
        16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
        32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49,
        33.5, 44.16, 47.77), 4096, math.sqrt(1 + math.log(32) / math.log(4096))))

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
