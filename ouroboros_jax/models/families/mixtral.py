"""Mixtral (Mixtral-8x7B, 8x22B): Mistral's attention (a sliding window over every layer when
set) and a mixture of `num_local_experts` experts of `intermediate_size` in every layer: a
softmax router, the top `num_experts_per_tok`, always renormalized to sum to 1. Its
checkpoints name the experts `block_sparse_moe.experts.{j}.w1 / w3 / w2` (gate / up / down),
renamed into ours on load and back on save (`hf_renames`); `router_jitter_noise` only acts
in training. GGUF: llama.cpp writes Mixtral as the Llama architecture with expert keys
(`expert_count`, `expert_used_count`) and each layer's experts stacked (`ffn_gate_exps`, ...);
such a file is this family's (`gguf_experts_of`), its q/k rows permuted as Llama's are.
"""

from __future__ import annotations

from .base import Family
from .llama import LLAMA
from .qwen3_moe import GGUF_MOE_KEYS, MOE_IGNORED, experts_count, moe_from_gguf, moe_from_hf


def _from_hf(f, rope) -> dict:
    n = experts_count(f, ("num_local_experts",))
    return {"sliding_window": f.window(),
            **moe_from_hf(f, n, f.need("intermediate_size"), True)}


def _from_gguf(g, shape) -> dict:
    return moe_from_gguf(g, True)  # llama.cpp renormalizes Mixtral's top k, as transformers


def _to_hf(c) -> dict:
    return {"sliding_window": c.sliding_window, "num_local_experts": c.num_experts,
            "num_experts_per_tok": c.experts_per_token}


# checkpoint spelling -> ours (params.LEAVES), applied in order
HF_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
              (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"))

# Values from the model's config.json (mistralai/Mixtral-8x7B-v0.1)
PRESETS = {
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=1e6,
                         rms_norm_eps=1e-5, max_position_embeddings=32768, bos_token_id=1,
                         eos_token_id=2, num_experts=8, experts_per_token=2),
}

FAMILIES = (Family(
    model_type="mixtral", hf_class="MixtralForCausalLM",
    features={"norm_topk_prob": True},
    hf_fields=frozenset({"num_local_experts", "num_experts_per_tok", "router_jitter_noise"}),
    hf_ignored=MOE_IGNORED, from_hf=_from_hf, to_hf=_to_hf, hf_renames=HF_RENAMES,
    gguf_experts_of=LLAMA.gguf_arch, gguf_keys=GGUF_MOE_KEYS, from_gguf=_from_gguf,
    gguf_permuted_qk=True, presets=PRESETS),)
