"""Full-size configurations of the paper's model pairs and of the pairs the accelerator
projection and device script size (Llama 3.1/3.2, the real Qwen2.5-Coder pair), for planning,
lowering and projection (shapes only: nothing here holds weights). Values from each model's
Hugging Face config.json (the Qwen pair's checked against its GGUFs' metadata)."""

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
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=5e5,
                                rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
                                max_position_embeddings=131072),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                rope_theta=5e5, rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192),
                                rms_norm_eps=1e-5, tie_word_embeddings=True,
                                max_position_embeddings=131072),
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
