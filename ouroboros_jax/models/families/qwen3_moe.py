"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms) and a
mixture of experts in every layer's MLP: a softmax router over `num_experts`, the top
`num_experts_per_tok`, renormalized when `norm_topk_prob`, experts of `moe_intermediate_size`.
Dense layers among the sparse ones (`decoder_sparse_step` > 1, `mlp_only_layers`) and the
sliding-window option are refused by name. GGUF: "qwen3moe" (llama.cpp always renormalizes
its top k, so its files load with `norm_topk_prob`), stored unpermuted.

`moe_from_hf` / `moe_to_hf` read and write the expert fields the MoE families share (Mixtral
and OLMoE use them too). transformers 5 writes Qwen3-MoE's expert count as
`num_local_experts` (its alias of `num_experts`); either spelling is read.
"""

from __future__ import annotations

from .base import Family
from .qwen2 import refuse_sliding_window

# fields the MoE families' checkpoints carry that change no inference numerics: the router's
# auxiliary loss (training) and whether forward also returns the router logits
MOE_IGNORED = frozenset({"router_aux_loss_coef", "output_router_logits"})


def experts_count(f, names=("num_experts", "num_local_experts")) -> int:
    """The number of experts, from whichever of its spellings the config.json uses (they must
    agree when both are there); ValueError naming them when absent or not positive."""
    given = {n: f.int(n) for n in names if f.get(n) is not None}
    if not given:
        raise f.error(f"required field {names[0]!r} is missing (a {f.get('model_type')} model "
                      "is a mixture of experts)")
    if len(set(given.values())) > 1:
        raise f.error(f"fields {sorted(given)} disagree: {given}")
    n = next(iter(given.values()))
    if n <= 0:
        raise f.error(f"field {next(iter(given))!r} must be positive, got {n}")
    return n


def moe_from_hf(f, num_experts: int, intermediate: int, norm_topk_prob) -> dict:
    """The `ModelConfig` expert fields: the count given, the top k (`num_experts_per_tok`,
    required, in [1, num_experts]), the experts' intermediate size and `norm_topk_prob`
    (a bool); ValueError naming the field."""
    k = f.int("num_experts_per_tok")
    if k is None:
        raise f.error("required field 'num_experts_per_tok' is missing")
    if not 1 <= k <= num_experts:
        raise f.error(f"field 'num_experts_per_tok' must be in [1, {num_experts}] (the number "
                      f"of experts), got {k}")
    if not isinstance(norm_topk_prob, bool):
        raise f.error(f"field 'norm_topk_prob' must be true or false, got {norm_topk_prob!r}")
    if intermediate <= 0:
        raise f.error(f"the experts' intermediate size must be positive, got {intermediate}")
    return {"num_experts": num_experts, "experts_per_token": k,
            "moe_intermediate_size": intermediate, "norm_topk_prob": norm_topk_prob}


def _from_hf(f, rope) -> dict:
    refuse_sliding_window(f, rope)
    step = f.int("decoder_sparse_step", 1)
    if step != 1:  # layer i is sparse iff (i + 1) % step == 0: the others dense
        raise f.error(f"decoder_sparse_step={step} is unsupported (only 1: every layer a "
                      "mixture of experts)")
    if f.get("mlp_only_layers"):
        raise f.error(f"mlp_only_layers={f.get('mlp_only_layers')!r} is unsupported (dense "
                      "layers among the experts' ones; only [] is implemented)")
    inter = f.int("moe_intermediate_size", 768)  # transformers' default
    return moe_from_hf(f, experts_count(f), inter, f.get("norm_topk_prob", False))


# `<arch>.` keys of the MoE families' GGUF files (llama.cpp's names)
GGUF_MOE_KEYS = frozenset({"expert_count", "expert_used_count"})


def moe_from_gguf(g, norm_topk_prob: bool, intermediate=None) -> dict:
    """The expert fields of a GGUF file: `expert_count`, `expert_used_count` (at most the
    count) and, where given, the experts' intermediate size; ValueError naming the key.
    norm_topk_prob: what llama.cpp's graph for the architecture does (no key says it)."""
    n, k = g.int("expert_count"), g.int("expert_used_count")
    if k > n:
        raise g.error(f"GGUF key 'expert_used_count' ({k}) exceeds 'expert_count' ({n})")
    out = {"num_experts": n, "experts_per_token": k, "norm_topk_prob": norm_topk_prob}
    if intermediate is not None:
        out["moe_intermediate_size"] = intermediate
    return out


def _from_gguf(g, shape) -> dict:
    return moe_from_gguf(g, True, g.int("expert_feed_forward_length"))


def _to_hf(c) -> dict:
    return {"attention_bias": False, "num_experts": c.num_experts,
            "num_experts_per_tok": c.experts_per_token,
            "moe_intermediate_size": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}


# Values from the model's config.json (Qwen/Qwen3-30B-A3B)
PRESETS = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                          rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                          bos_token_id=151643, eos_token_id=151645, num_experts=128,
                          experts_per_token=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
}

FAMILIES = (Family(
    model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM", features={"qk_norm": True},
    hf_fields=frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                         "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                         "mlp_only_layers"}),
    hf_ignored=MOE_IGNORED, from_hf=_from_hf, to_hf=_to_hf, gguf_arch="qwen3moe",
    gguf_keys=GGUF_MOE_KEYS | {"expert_feed_forward_length"}, from_gguf=_from_gguf,
    presets=PRESETS),)
