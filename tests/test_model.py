"""The JAX model against transformers' torch models on the same weights (fp32)."""

import chex
import numpy as np
import jax.numpy as jnp
import pytest
import torch

import ouroboros_jax as oj
from ouroboros_jax.models import (causal_mask, commit, commit_prefix, forward, init_cache,
                                  rollback)
from ouroboros_jax.models.layout import pack, view_pack

from conftest import make_hf_model

CASES = [
    ("llama", dict(heads=4, kv_heads=4)),  # MHA
    ("llama", dict(heads=4, kv_heads=2)),  # GQA
    ("llama", dict(heads=4, kv_heads=1)),  # MQA
    ("llama", dict(heads=4, kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ("llama", dict(heads=4, kv_heads=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    ("llama", dict(heads=4, kv_heads=2, tie_word_embeddings=True)),
    ("mistral", dict(heads=4, kv_heads=2)),
    ("mistral", dict(heads=4, kv_heads=1, sliding_window=128)),
    ("qwen2", dict(heads=4, kv_heads=2)),
    ("qwen2", dict(heads=4, kv_heads=1)),
]


def _ids(case):
    kind, kw = case
    return kind + "-" + "-".join(f"{k}={v}" if not isinstance(v, dict) else f"{k}={v['rope_type']}"
                                 for k, v in kw.items())


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_logits_match_transformers(tmp_path, case):
    kind, kw = case
    torch_model = make_hf_model(tmp_path, model_type=kind, vocab=211, scale=0.05, **kw)
    model = oj.load_model(str(tmp_path))
    toks = np.random.RandomState(0).randint(0, 211, size=(1, 500))
    with torch.no_grad():
        ref = torch_model(torch.tensor(toks)).logits.numpy()
    T = toks.shape[1]
    # every layout: the canonical stacked one, the GPU's packed copy, the CPU's packed views
    outs = []
    for params in (model.params, pack(model.params, model.config),
                   view_pack(model.params, model.config)):
        logits, _ = forward(params, model.config, jnp.asarray(toks), jnp.arange(T)[None],
                            causal_mask(1, T))
        rel = np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, rel
        outs.append(np.asarray(logits))
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_prefill_then_decode_equals_full_forward(tiny_target):
    m = tiny_target
    T, split = 40, 25
    toks = jnp.asarray(np.random.RandomState(1).randint(0, 97, size=(2, T)))
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    full, _ = forward(m.params, m.config, toks, pos, causal_mask(2, T))
    chex.assert_shape(full, (2, T, m.config.vocab_size))
    cache = init_cache(m.config, 2, 64)
    lg, new = forward(m.params, m.config, toks[:, :split], pos[:, :split], causal_mask(2, split),
                      cache)
    cache = commit_prefix(cache, new, jnp.full((2,), split))
    steps = [lg]
    for t in range(split, T):
        lg, new = forward(m.params, m.config, toks[:, t:t + 1], pos[:, t:t + 1],
                          jnp.ones((2, 1, 1), bool), cache)
        cache = commit_prefix(cache, new, jnp.ones((2,), jnp.int32))
        steps.append(lg)
    chex.assert_shape(steps[1:], (2, 1, m.config.vocab_size))
    chex.assert_trees_all_close(jnp.concatenate(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_gathered_commit_equals_one_by_one(tiny_target):
    """Committing a subset of a forward's tokens (by index) gives the same cache as feeding
    exactly those tokens one at a time."""
    m = tiny_target
    rs = np.random.RandomState(2)
    prefix = jnp.asarray(rs.randint(0, 97, size=(1, 10)))
    cache0 = init_cache(m.config, 1, 64)
    _, new = forward(m.params, m.config, prefix, jnp.arange(10)[None], causal_mask(1, 10), cache0)
    cache0 = commit_prefix(cache0, new, jnp.array([10]))
    # a tree: node0 root; nodes 1,2 children of 0; node 3 child of 2
    tree_tokens = jnp.asarray(rs.randint(0, 97, size=(1, 4)))
    mask = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    pos = jnp.array([[10, 11, 11, 12]])
    _, new = forward(m.params, m.config, tree_tokens, pos, mask, cache0)
    via_gather = commit(cache0, new, jnp.array([[0, 2, 3]]), jnp.array([3]))
    seq = cache0
    for node, p in ((0, 10), (2, 11), (3, 12)):
        _, n1 = forward(m.params, m.config, tree_tokens[:, node:node + 1], jnp.array([[p]]),
                        jnp.ones((1, 1, 1), bool), seq)
        seq = commit_prefix(seq, n1, jnp.array([1]))
    assert int(via_gather.lengths[0]) == int(seq.lengths[0]) == 13
    chex.assert_trees_all_equal_shapes_and_dtypes(via_gather, seq)
    chex.assert_trees_all_close((via_gather.k[:, :, :13], via_gather.v[:, :, :13]),
                                (seq.k[:, :, :13], seq.v[:, :, :13]), rtol=1e-5, atol=1e-5)
    # rollback is a length: rolling back to 11 then recommitting gives the same prefix
    rb = rollback(via_gather, jnp.array([11]))
    assert int(rb.lengths[0]) == 11


def test_commit_never_overwrites_past_the_end(tiny_target):
    m = tiny_target
    cache = init_cache(m.config, 1, 8)
    toks = jnp.zeros((1, 6), jnp.int32)
    _, new = forward(m.params, m.config, toks, jnp.arange(6)[None], causal_mask(1, 6), cache)
    cache = commit_prefix(cache, new, jnp.array([6]))
    before = np.asarray(cache.k)
    cache2 = commit_prefix(cache, new, jnp.array([6]))  # only 2 slots left: the rest is dropped
    chex.assert_trees_all_equal_shapes(cache2, cache)
    chex.assert_trees_all_equal(cache2.k[:, :, :6], before[:, :, :6])


def test_bf16_params_run_and_stay_close(tiny_pair, tmp_path):
    m32 = tiny_pair[0]
    m16 = oj.load_model(m32.path, dtype="bfloat16")
    assert m16.params["embed"].dtype == jnp.bfloat16
    toks = jnp.asarray(np.random.RandomState(3).randint(0, 97, size=(1, 30)))
    pos, mask = jnp.arange(30)[None], causal_mask(1, 30)
    a, _ = forward(m32.params, m32.config, toks, pos, mask)
    b, _ = forward(m16.params, m16.config, toks, pos, mask)
    chex.assert_type(b, jnp.float32)
    chex.assert_equal_shape([a, b])
    assert np.mean(np.argmax(a, -1) == np.argmax(b, -1)) > 0.8
