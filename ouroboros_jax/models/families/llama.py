"""Llama (2, 3, 3.1, 3.2; CodeLlama, Yi, DeepSeek-Coder and SmolLM2 share its model_type) and
Mistral: the plain decoder every other family adds to.

- Llama 3.1+ RoPE: transformers computes its llama3 `rope_scaling` as per-frequency divisors
  (`llama3_factors`); llama.cpp's converter stores those divisors as a GGUF's `rope_freqs`
  tensor, which `llama3_from_factors` turns back into the config.json object.
- GGUF: llama.cpp permutes the q/k rows of the "llama" architecture so that its rotary kernel
  rotates adjacent pairs; the loader undoes it. Mistral files are written as "llama" too.
- SmolLM2 differs only in its published config.json: `rope_interleaved: false` (rotate-half
  RoPE, as implemented) and `is_llama_config` (bookkeeping).
- Mistral: `model_type` "mistral", and a sliding window over every layer.
"""

from __future__ import annotations

import math

from .base import Family

# SmolLM2's config.json: RoPE rotates halves, not interleaved pairs (the value implemented)
HF_NEUTRAL = {"rope_interleaved": (False,)}


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                   original: int) -> list[float]:
    """The per-frequency divisors [D/2] of transformers' llama3 rope scaling (its inverse
    frequencies are the plain ones divided by these), as llama.cpp's converter writes them
    into a GGUF's `rope_freqs` tensor: 1 above the high-frequency wavelength bound, `factor`
    below the low one, the reciprocal of the smooth interpolation between."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(float(factor))
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def llama3_from_factors(theta: float, head_dim: int, factors) -> dict:
    """The llama3 `rope_scaling` dict whose divisors (`llama3_factors`) are `factors`, for
    writing a GGUF's rope factors as a config.json. The divisors fix the factor and, through
    the smooth band, original/(high-low) and low/(high-low); low = 1 (every Llama 3.x) picks
    the rest. ValueError naming rope_freqs when no llama3 scaling gives these divisors."""
    factors = [float(f) for f in factors]
    f = max(factors)
    band = [(2 * math.pi * theta ** (2 * i / head_dim), r) for i, r in enumerate(factors)
            if 1 + 1e-6 < r < f * (1 - 1e-6)]
    fail = ValueError("rope_freqs: these rope frequency factors are not those of a llama3 "
                      "rope_scaling, so they have no config.json form")
    if f <= 1 or len(band) < 2:
        raise fail
    # s = (1/r - 1/f) / (1 - 1/f) = a / wavelen - b over the smooth band: a line in 1/wavelen
    xs = [1 / w for w, _ in band]
    ys = [(1 / r - 1 / f) / (1 - 1 / f) for _, r in band]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
         / sum((x - mx) ** 2 for x in xs))
    b = a * mx - my
    if not (a > 0 and b > 0):
        raise fail
    d = {"rope_type": "llama3", "factor": f, "low_freq_factor": 1.0,
         "high_freq_factor": round((b + 1) / b, 6),
         "original_max_position_embeddings": round(a / b)}
    again = llama3_factors(theta, head_dim, f, 1.0, d["high_freq_factor"],
                           d["original_max_position_embeddings"])
    if any(abs(x - y) > 1e-4 * y for x, y in zip(again, factors)):
        raise fail
    return d


def _llama_to_hf(c) -> dict:
    return {"attention_bias": False, "mlp_bias": False}


def _mistral_from_hf(f, rope) -> dict:
    return {"sliding_window": f.window()}


def _mistral_to_hf(c) -> dict:
    return {"sliding_window": c.sliding_window}


# Values from each model's config.json (llama-3.x: tests/test_families.py checks them against
# the published texts in tests/data/hub_configs)
_LLAMA2 = dict(vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=4096)
_YI = dict(vocab_size=64000, rope_theta=5e6, rms_norm_eps=1e-5, max_position_embeddings=4096)
_LLAMA3 = dict(vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5,
               max_position_embeddings=131072, bos_token_id=128000)
PRESETS = {  # the paper's pairs (Llama 2, Yi), Llama 3 and the canonical pairs of 2026 (issue 29)
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, **_LLAMA2),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                       num_kv_heads=32, **_LLAMA2),
    "yi-34b": dict(hidden_size=7168, intermediate_size=20480, num_layers=60, num_heads=56,
                   num_kv_heads=8, **_YI),
    "yi-6b": dict(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                  num_kv_heads=4, **_YI),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=5e5,
                       rms_norm_eps=1e-5, max_position_embeddings=8192),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, num_kv_heads=8,
                         rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), **_LLAMA3),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80,
                          num_heads=64, num_kv_heads=8,
                          rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), **_LLAMA3),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16,
                         num_heads=32, num_kv_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192), **_LLAMA3),
}

LLAMA = Family(
    model_type="llama", hf_class="LlamaForCausalLM", hf_neutral=HF_NEUTRAL,
    to_hf=_llama_to_hf, gguf_arch="llama", gguf_permuted_qk=True, presets=PRESETS)
MISTRAL = Family(
    model_type="mistral", hf_class="MistralForCausalLM", from_hf=_mistral_from_hf,
    to_hf=_mistral_to_hf)
FAMILIES = (LLAMA, MISTRAL)
