"""Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`): logits equal transformers' (fp32, both
layouts) across the sliding-window boundary, with GQA, soft caps, tied and untied heads; greedy
`generate` equals transformers' greedy past the window; speculative and Ouroboros with a second
tiny Gemma as draft equal vanilla; sampling keeps the exact distribution; a tree verified past
the window equals feeding its path token by token; blockwise attention skips (never reads)
cache blocks below a local layer's window; GGUF files as llama.cpp writes them load to the same
params; the chat template's `<end_of_turn>` stops generation; bad fields are refused by name.

Tiny models made locally with transformers (eager attention: sdpa ignores Gemma 2's soft cap),
module-scoped, windows of 16 and 8 tokens so that short prompts cross them.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ouroboros_jax as oj
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig
from ouroboros_jax.models import causal_mask, commit_prefix, forward, init_cache
from ouroboros_jax.models.attention import (blockwise_attention, dense_attention,
                                            first_window_block)
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.layout import pack

V = 97
WINDOW = 16


def make_gemma(d, kind, seed, scale=0.3, embed_scale=0.02, layers=3, hidden=64, heads=4,
               kv_heads=2, head_dim=16, inter=128, window=WINDOW, vocab=V, **extra):
    """Saves a random transformers Gemma 2 / Gemma 3 text model to d and returns it (eval,
    fp32, eager attention), every weight plus N(0, scale) noise so that logits are far from
    ties, the embedding only N(0, embed_scale): Gemma multiplies it by sqrt(E), and a larger
    one drowns the layers' (normed) outputs, so that greedy just repeats the last token."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, sliding_window=window,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=1024,
                  attn_implementation="eager")
    cls = {"gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[kind]
    cfg = cls(**common, **extra)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (embed_scale if "embed" in name else scale))
    m.save_pretrained(d)
    return m


# target: 3 layers (local, global, local), GQA, a score scale other than 1/sqrt(D), soft caps
# low enough to bend the scores; draft: 2 layers, MQA, untied head, a narrower window
G2_TARGET = dict(query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                 final_logit_softcapping=10.0)
G2_DRAFT = dict(layers=2, hidden=32, heads=2, kv_heads=1, inter=64, window=8,
                tie_word_embeddings=False, query_pre_attn_scalar=16,
                attn_logit_softcapping=20.0, final_logit_softcapping=30.0)
# target: layers local, local, global (pattern 3), linear RoPE scaling on the global layer
# only, its own local base, q/k norms; draft: 2 local layers (the default pattern of 6)
G3_TARGET = dict(query_pre_attn_scalar=12, sliding_window_pattern=3, rope_theta=1e6,
                 rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0})
G3_DRAFT = dict(layers=2, hidden=32, heads=2, kv_heads=1, inter=64, window=8,
                query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4)
SPECS = {"gemma2": (G2_TARGET, G2_DRAFT), "gemma3": (G3_TARGET, G3_DRAFT)}


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def family(request, tmp_path_factory):
    """(kind, target Model, draft Model, torch target) of one family."""
    kind = request.param
    target_kw, draft_kw = SPECS[kind]
    td = tmp_path_factory.mktemp(f"{kind}_target")
    dd = tmp_path_factory.mktemp(f"{kind}_draft")
    torch_target = make_gemma(td, kind, seed=0, **target_kw)
    make_gemma(dd, kind, seed=1, **draft_kw)
    return kind, oj.load_model(str(td)), oj.load_model(str(dd)), torch_target


def test_configs_read_as_transformers_builds_them(family):
    kind, target, draft, torch_target = family
    c = target.config
    assert c.model_type == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[kind]
    assert c.sliding_layers == tuple(t == "sliding_attention"
                                     for t in torch_target.config.layer_types)
    assert c.sliding_window == WINDOW and c.query_pre_attn_scalar == 12
    assert c.tie_word_embeddings and not draft.config.tie_word_embeddings
    if kind == "gemma2":
        assert c.sliding_layers == (True, False, True)
        assert (c.attn_softcap, c.final_softcap, c.qk_norm) == (5.0, 10.0, False)
    else:
        assert c.sliding_layers == (True, True, False)
        assert draft.config.sliding_layers == (True, True)
        assert (c.attn_softcap, c.final_softcap, c.qk_norm) == (None, None, True)
        assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, ("linear", 4.0))


def test_logits_equal_transformers_across_the_window(family):
    """150 tokens, ~10 windows: every local layer's mask, RoPE base, scale and cap matter."""
    kind, target, draft, torch_target = family
    toks = np.random.RandomState(0).randint(0, V, size=(1, 150))
    with torch.no_grad():
        ref = torch_target(torch.tensor(toks)).logits.numpy()
    T = toks.shape[1]
    outs = []
    for params in (target.params, pack(target.params, target.config)):
        logits, _ = forward(params, target.config, jnp.asarray(toks), jnp.arange(T)[None],
                            causal_mask(1, T))
        rel = np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, rel
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the window is no formality: the same model without it gives other logits
    wide = dataclasses.replace(target.config, sliding_layers=None, sliding_window=None)
    other, _ = forward(target.params, wide, jnp.asarray(toks), jnp.arange(T)[None],
                       causal_mask(1, T))
    assert np.abs(np.asarray(other)[0, WINDOW + 4:] - ref[0, WINDOW + 4:]).max() > 1e-2


def _hf_greedy(torch_model, prompt, n):
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                   eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [np.random.RandomState(i).randint(3, V, size=n).tolist()
           for i, n in enumerate((1, 5, 9, 14, 17, 23, 31, 40))]
NEW = 40


@pytest.fixture(scope="module")
def vanilla(family):
    kind, target, _, _ = family
    return oj.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=-1).tokens


def test_greedy_generate_equals_transformers_past_the_window(family, vanilla):
    kind, target, _, torch_target = family
    for i in (1, 3, 7):  # 5 + 40, 14 + 40 and 40 + 40 tokens: the cache crosses the window
        assert vanilla[i] == _hf_greedy(torch_target, PROMPTS[i], NEW)


@pytest.mark.parametrize("method", ["speculative", "ouroboros"])
def test_methods_with_a_gemma_draft_equal_vanilla(family, vanilla, method):
    """Drafts and verification trees cross both models' windows (16 and 8) many times."""
    kind, target, draft, _ = family
    cfg = (SpeculativeConfig(gamma=4) if method == "speculative"
           else OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2))
    out = oj.generate(target, PROMPTS, draft=draft, method=method, config=cfg,
                      max_new_tokens=NEW, eos_token_id=-1)
    assert out.tokens == vanilla
    assert out.stats["target_calls"] < NEW  # drafts were accepted: trees were verified


def test_sampling_same_seed_equals_vanilla(family):
    kind, target, draft, _ = family
    kw = dict(max_new_tokens=24, eos_token_id=-1, temperature=0.8, top_k=20, seed=3)
    ref = oj.generate(target, PROMPTS[2:6], **kw).tokens
    cfg = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
    assert oj.generate(target, PROMPTS[2:6], draft=target, method="ouroboros", config=cfg,
                       **kw).tokens == ref


def test_tree_past_the_window_equals_its_path_fed_one_by_one(family):
    """A verification tree after a cache longer than the window: each node sees the cache and
    its ancestors only within the window, as when its path is fed token by token."""
    kind, m, _, _ = family
    rs = np.random.RandomState(2)
    P = WINDOW + 7
    cache = init_cache(m.config, 1, 64)
    _, new = forward(m.params, m.config, jnp.asarray(rs.randint(0, V, (1, P))),
                     jnp.arange(P)[None], causal_mask(1, P), cache)
    cache = commit_prefix(cache, new, jnp.array([P]))
    tree = jnp.asarray(rs.randint(0, V, (1, 4)))
    mask = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    pos = jnp.array([[P, P + 1, P + 1, P + 2]])
    got, _ = forward(m.params, m.config, tree, pos, mask, cache)
    seq = cache
    for node, p in ((0, P), (2, P + 1), (3, P + 2)):
        lg, n1 = forward(m.params, m.config, tree[:, node:node + 1], jnp.array([[p]]),
                         jnp.ones((1, 1, 1), bool), seq)
        seq = commit_prefix(seq, n1, jnp.array([1]))
        np.testing.assert_allclose(np.asarray(got[0, node]), np.asarray(lg[0, 0]), rtol=1e-4,
                                   atol=1e-4)


def test_blockwise_never_reads_blocks_below_the_window():
    """Blocks wholly below every new token's window are skipped: NaN there changes nothing,
    and the result equals the dense kernel on a clean cache (a traced per-layer window, a
    score scale and a soft cap)."""
    rs = np.random.RandomState(0)
    B, T, H, K, D, S, L, Z = 2, 3, 4, 2, 8, 64, 2, 4
    q = jnp.asarray(rs.randn(B, T, H, D), jnp.float32)
    kn, vn = (jnp.asarray(rs.randn(B, T, K, D), jnp.float32) for _ in range(2))
    ck, cv = (jnp.asarray(rs.randn(L, B, S, K, D), jnp.float32) for _ in range(2))
    clen = jnp.array([40, 37], jnp.int32)
    positions = clen[:, None] + jnp.array([[0, 1, 1]], jnp.int32)
    mask = jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)[None].repeat(B, 0)
    windows = jnp.array([8, 2**30], jnp.int32)  # layer 0 local, layer 1 global
    assert int(first_window_block(positions, 8, Z)) == (37 - 8 + 1) // Z == 7
    # NaN in every slot below the lowest window start (slot 30) of layer 0
    poisoned = (ck.at[0, :, :28].set(jnp.nan), cv.at[0, :, :28].set(jnp.nan))

    @jax.jit
    def both(layer, ck_b, cv_b):
        w = windows[layer]
        kw = dict(scale=0.3, softcap=4.0)
        return (blockwise_attention(q, kn, vn, positions, mask, ck_b, cv_b, clen, layer, w,
                                    block=Z, **kw),
                dense_attention(q, kn, vn, positions, mask, ck, cv, clen, layer, w, **kw))

    got, ref = both(jnp.int32(0), *poisoned)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    got, ref = both(jnp.int32(1), ck, cv)  # the global layer reads every live block
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
