"""Pricing a mixture-of-experts target (issue 57, item 4) and counting its experts' memory
(item 5): all from shapes and arithmetic, nothing timed.

- `cost.expected_experts`: the distinct experts T tokens route to under uniform routing;
- `cost.shape_latency` of an MoE shape reads the dense weights and that share of the experts,
  and multiplies k/Y of the experts per token: its t(T) climbs with T where a dense model of
  the same active size is flat (an accelerator, weights-bound);
- `config="auto"` prices the Qwen3-30B-A3B preset's verification by that curve and so chooses
  shorter drafts for it than for a dense model of its active size with the same draft;
- the forward timers take distinct tokens, so a timed MoE forward of T tokens reaches the
  experts a verification's T nodes would (T copies of one token reach only k);
- `memory_plan` and `ouroboros-jax memory` count the experts' bytes and the active
  parameters per token (the presets' published active sizes).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax import cli
from ouroboros_jax.auto import prices
from ouroboros_jax.auto.choice import choose
from ouroboros_jax.decoding import cost
from ouroboros_jax.models import init_params
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.llama import embed_tokens, rms_norm, route
from ouroboros_jax.models.presets import PRESETS
from ouroboros_jax.models.timing import timing_tokens
from ouroboros_jax.sharding import memory_plan

Y, K = 8, 2  # experts, experts per token


def _abstract(cfg):
    return oj.Model(cfg, jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0)))


def _dense_of_equal_active(cfg: ModelConfig) -> ModelConfig:
    """The MoE config's dense twin: the same attention and layers, one MLP as wide as the k
    experts a token goes through (the same active parameters, less the router)."""
    return dataclasses.replace(cfg, model_type="qwen3", num_experts=0, experts_per_token=0,
                               intermediate_size=cfg.experts_per_token *
                               cfg.moe_intermediate_size,
                               moe_intermediate_size=None, norm_topk_prob=False)


TINY = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                   model_type="qwen3_moe", qk_norm=True, num_experts=Y, experts_per_token=K,
                   moe_intermediate_size=24, norm_topk_prob=True)


def test_expected_experts_under_uniform_routing():
    """E[distinct] = Y (1 - (1 - k/Y)^T): k for one token, Y in the limit, and a simulation of
    tokens each drawing k of Y experts at random agrees."""
    assert cost.expected_experts(Y, K, 0) == 0.0
    assert cost.expected_experts(Y, K, 1) == pytest.approx(K)
    assert cost.expected_experts(Y, K, 4) == pytest.approx(8 * (1 - 0.75 ** 4))  # 5.47
    assert cost.expected_experts(Y, K, 200) == pytest.approx(Y)
    rng = np.random.RandomState(0)
    for T in (2, 4, 8, 16):
        picks = rng.rand(4000, T, Y).argsort(-1)[..., :K].reshape(4000, -1)  # k of Y each
        distinct = [len(set(row)) for row in picks]
        assert np.mean(distinct) == pytest.approx(cost.expected_experts(Y, K, T), rel=0.02)


def test_an_moe_shape_reads_the_experts_its_tokens_route_to():
    """On an accelerator (weights-bound) an MoE shape's t(T) is its dense bytes plus the
    expected distinct experts' bytes over the bandwidth, climbing to every expert's; a dense
    shape of the same active bytes stays flat. On a CPU each token past the first adds the
    flops of its active parameters only (k/Y of the experts'), not of all of them."""
    dense_b, expert_b = 1e9, 8e9  # bytes; one expert 1e9
    moe = cost.ModelShape(weight_bytes=dense_b + expert_b, matmul_params=(dense_b + expert_b) / 2,
                          layers=10, kv_bytes=0.0, expert_bytes=expert_b,
                          expert_params=expert_b / 2, experts=Y, experts_per_token=K)
    twin = cost.ModelShape(weight_bytes=dense_b + expert_b * K / Y,
                           matmul_params=(dense_b + expert_b * K / Y) / 2, layers=10,
                           kv_bytes=0.0)
    gpu = cost.DeviceRates(bandwidth=1e12, flops=1e15, per_layer=1e-5, overlap=True)
    sizes = (1, 2, 4, 8, 16, 64)
    t = cost.shape_latency(moe, gpu, 1, 0, sizes)
    d = cost.shape_latency(twin, gpu, 1, 0, sizes)
    for n in sizes:
        read = dense_b + expert_b / Y * cost.expected_experts(Y, K, n)
        assert t[n] == pytest.approx(1e-4 + read / 1e12)
        assert d[n] == pytest.approx(d[1])
    assert t[1] == pytest.approx(d[1])  # one token reads what the dense twin reads
    assert t[64] == pytest.approx(1e-4 + (dense_b + expert_b) / 1e12, rel=1e-3)
    # a batch of 4 rows of 2 tokens routes 8 tokens: the union is the batch's
    assert cost.shape_latency(moe, gpu, 4, 0, (2,))[2] == pytest.approx(t[8])
    cpu = dataclasses.replace(gpu, flops=1e11, overlap=False)
    t, d = cost.shape_latency(moe, cpu, 1, 0, (1, 5)), cost.shape_latency(twin, cpu, 1, 0, (1, 5))
    flops_per_token = 2 * twin.matmul_params / 1e11
    assert t[1] == pytest.approx(d[1])
    assert d[5] - d[1] == pytest.approx(4 * flops_per_token)
    extra_read = expert_b / Y * (cost.expected_experts(Y, K, 5) - K) / 1e12
    assert t[5] - t[1] == pytest.approx(4 * flops_per_token + extra_read)


def test_model_shape_counts_the_experts_of_the_grouped_path_only():
    """`prices.model_shape`: the expert bytes are the we_gate / we_up / we_down leaves' bytes;
    a one-hot MoE (every expert on every token) and a dense model are priced as dense."""
    model = _abstract(TINY)
    shape = prices.model_shape(model)
    layers = model.params["layers"]
    want = sum(layers[n].size * layers[n].dtype.itemsize for n in ("we_gate", "we_up",
                                                                    "we_down"))
    assert shape.expert_bytes == want and shape.expert_params == want / 4
    assert (shape.experts, shape.experts_per_token) == (Y, K)
    onehot = prices.model_shape(_abstract(dataclasses.replace(TINY, moe_dispatch="onehot")))
    assert onehot.expert_bytes == 0 and onehot.weight_bytes == shape.weight_bytes
    assert prices.model_shape(_abstract(_dense_of_equal_active(TINY))).expert_bytes == 0
    # its timings are keyed apart from those taken on copies of one token (k experts only)
    assert prices.timed_tag(model) != prices.timed_tag(_abstract(_dense_of_equal_active(TINY)))


def test_auto_prices_an_moe_target_by_its_union_of_experts(monkeypatch):
    """Before any probe on a GPU, auto's prices for Qwen3-30B-A3B (top 8 of 128 experts)
    climb with the verified tokens (t(16) over 5x t(1): 82 experts read of 128, against 8),
    where its dense twin of the same 3.3B active parameters is flat; with the same
    Qwen3-0.6B draft and agreement, auto chooses a shorter chain for the MoE target (or
    vanilla), for speculative decoding and for Ouroboros."""
    monkeypatch.setattr(prices.jax, "default_backend", lambda: "gpu")
    moe = PRESETS["qwen3-30b-a3b"]
    twin = _dense_of_equal_active(moe)
    assert abs(twin.num_params() - moe.active_params()) < 0.01 * moe.active_params()
    sizes = (1, 2, 4, 8, 16, 32, 64)
    tm = prices.prior_latency(_abstract(moe), 1, 1024, sizes)
    td = prices.prior_latency(_abstract(twin), 1, 1024, sizes)
    draft = prices.prior_latency(_abstract(PRESETS["qwen3-0.6b"]), 1, 1024, sizes)
    assert tm[1] == pytest.approx(td[1], rel=0.02)
    assert tm[16] / tm[1] > 5 and td[16] / td[1] < 1.01
    assert all(tm[a] < tm[b] for a, b in zip(sizes, sizes[1:]))
    for method in ("speculative", "ouroboros"):
        for a in (0.8, 0.9):
            m, d = choose(method, tm, draft, a), choose(method, td, draft, a)
            assert d.method == method
            assert (m.config.gamma if m.method == method else 0) < d.config.gamma, (method, a)


def test_auto_notes_name_the_expert_pricing(monkeypatch, tmp_path):
    """latency_tables on a tiny MoE target (timers and calibration stubbed at its shape's
    prices, so the anchors are 1): the table is the MoE shape's, the notes say so."""
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))
    rates = cost.DeviceRates(bandwidth=1e9, flops=1e11, per_layer=3e-5, overlap=False)
    model = oj.Model(TINY, init_params(TINY, jax.random.key(0)))
    shape = prices.model_shape(model)
    monkeypatch.setattr(prices, "calibrate", lambda dtype, reps=5: rates)
    monkeypatch.setattr(prices, "forward_seconds", lambda m, b, n, s, inner=4: (
        lambda: cost.shape_latency(prices.model_shape(m), rates, 1, s // 2, (n,))[n]))
    from ouroboros_jax.auto import AutoTuner

    tt, _, notes = AutoTuner().prices.latency_tables(model, None, 1, 64, use_cache=False)
    assert tt == pytest.approx(cost.shape_latency(shape, rates, 1, 32, tuple(tt)))
    assert any("distinct experts" in s for s in notes["assumed"])


def test_timed_forwards_reach_as_many_experts_as_a_verification():
    """The timers' T tokens (`timing_tokens`) are distinct and, through a random MoE layer's
    router, reach more than k experts, as a verification's T different nodes do; T copies of
    one token (what the timers took before) reach exactly k, pricing a T-token MoE forward at
    about one token's experts."""
    params = init_params(TINY, jax.random.key(3))

    def reached(tokens):
        h = rms_norm(embed_tokens(params, TINY, tokens), params["layers"]["mlp_norm"][0],
                     TINY.rms_norm_eps)
        experts, _ = route(TINY, h.reshape(-1, TINY.hidden_size), params["layers"]["router"][0])
        return len(np.unique(np.asarray(experts)))

    toks = timing_tokens(1, 8, TINY.vocab_size)
    assert toks.shape == (1, 8) and len(np.unique(np.asarray(toks))) == 8
    assert reached(toks) >= 5  # uniform routing expects 7.2 of 8
    assert reached(jnp.ones((1, 8), jnp.int32)) == K


def test_memory_counts_expert_bytes_and_active_params(capsys):
    """memory_plan: the experts' bytes (all of them held) and the parameters one token uses,
    the presets' published active sizes (Qwen3-30B-A3B 3.3B, Mixtral-8x7B 12.9B, OLMoE-1B-7B
    1.3B); a dense model's experts 0 and active all. `ouroboros-jax memory` prints them."""
    for name, active in (("qwen3-30b-a3b", 3.3), ("mixtral-8x7b", 12.9), ("olmoe-1b-7b", 1.3)):
        c = PRESETS[name]
        p = memory_plan(c, 1, 1, 1, 64)
        assert p["active_params"] / 1e9 == pytest.approx(active, rel=0.02), name
        assert p["expert_bytes"] == 2 * 3 * c.num_layers * c.num_experts * c.hidden_size * \
            c.moe_intermediate_size
        assert p["active_bytes"] == 2 * p["active_params"]
    p = memory_plan(PRESETS["llama-3-8b"], 1, 1, 1, 64)
    assert p["expert_bytes"] == 0 and p["active_params"] == p["num_params"]
    cli.main(["memory", "--preset", "qwen3-30b-a3b", "--preset", "llama-3-8b"])
    out = capsys.readouterr().out
    assert "experts 54.00GiB of the params (128 per layer, top 8)" in out
    assert "active per token 3.35B params (6.25GiB)" in out
    assert out.count("experts ") == 1  # the dense model has no expert line
