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
from ouroboros_jax.models.layout import pack, view_pack

from conftest import noisy_copy

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
                tie_word_embeddings=False, query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4)
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
    for config in (c, draft.config):  # config.json as written reads back the same
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_logits_equal_transformers_across_the_window(family):
    """150 tokens, ~10 windows: every local layer's mask, RoPE base, scale and cap matter."""
    kind, target, draft, torch_target = family
    toks = np.random.RandomState(0).randint(0, V, size=(1, 150))
    with torch.no_grad():
        ref = torch_target(torch.tensor(toks)).logits.numpy()
    T = toks.shape[1]
    outs = []
    for params in (target.params, pack(target.params, target.config),
                   view_pack(target.params, target.config)):
        logits, _ = forward(params, target.config, jnp.asarray(toks), jnp.arange(T)[None],
                            causal_mask(1, T))
        rel = np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, rel
        outs.append(np.asarray(logits))
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


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


OURO = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)


def test_speculative_with_a_smaller_gemma_draft_equals_vanilla(family, vanilla):
    """The 2-layer draft has its own window (8): its drafts cross both windows."""
    kind, target, draft, _ = family
    out = oj.generate(target, PROMPTS, draft=draft, method="speculative",
                      config=SpeculativeConfig(gamma=4), max_new_tokens=NEW, eos_token_id=-1)
    assert out.tokens == vanilla


def test_ouroboros_with_a_close_gemma_draft_equals_vanilla(family, vanilla):
    """A draft that agrees often (the target with 3% noise): long drafts and branches are
    accepted, so verification trees, and the commits after them, cross the window."""
    kind, target, _, _ = family
    out = oj.generate(target, PROMPTS, draft=noisy_copy(target), method="ouroboros",
                      config=OURO, max_new_tokens=NEW, eos_token_id=-1)
    assert out.tokens == vanilla
    hist = out.stats["acceptance_histogram"]
    assert sum(hist[3:]) > 0, hist  # several tokens per verification


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)  # its masks are any family's
def test_tree_past_the_window_equals_its_path_fed_one_by_one(family):
    """A verification tree after a cache longer than the window: each node sees the cache and
    its ancestors only within the window, as when its path is fed token by token."""
    kind, m, _, _ = family
    rs = np.random.RandomState(2)
    P = WINDOW + 7
    cache = init_cache(m.config, 1, 64)
    _, new = jax.jit(forward, static_argnums=1)(
        m.params, m.config, jnp.asarray(rs.randint(0, V, (1, P))),
                     jnp.arange(P)[None], causal_mask(1, P), cache)
    cache = commit_prefix(cache, new, jnp.array([P]))
    tree = jnp.asarray(rs.randint(0, V, (1, 4)))
    mask = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    pos = jnp.array([[P, P + 1, P + 1, P + 2]])
    fwd = jax.jit(forward, static_argnums=1)
    got, _ = fwd(m.params, m.config, tree, pos, mask, cache)
    seq = cache
    for node, p in ((0, P), (2, P + 1), (3, P + 2)):
        lg, n1 = fwd(m.params, m.config, tree[:, node:node + 1], jnp.array([[p]]),
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


# ----------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def small_gemma_pair(tmp_path_factory):
    """Gemma 2 target and draft over test_speculative's 6-token vocabulary, flat enough that
    many of the 216 outcomes of 3 tokens have mass."""
    from test_speculative import SV

    td, dd = tmp_path_factory.mktemp("g2_small_t"), tmp_path_factory.mktemp("g2_small_d")
    make_gemma(td, "gemma2", seed=5, scale=0.05, vocab=SV, **{**G2_TARGET, **G2_DRAFT})
    make_gemma(dd, "gemma2", seed=6, scale=0.05, vocab=SV, **{**G2_DRAFT, "layers": 1})
    return oj.load_model(str(td)), oj.load_model(str(dd))


def test_speculative_sampling_keeps_the_exact_distribution(small_gemma_pair):
    """test_speculative's chi-square check on a Gemma 2 pair (soft-capped logits): the first
    3 sampled tokens of 2 x 3000 rows against their exact distribution under vanilla
    sampling."""
    from test_speculative import chi2_pvalue, counts_of, exact_distribution, generated

    target, draft = small_gemma_pair
    probs = exact_distribution(target)
    runs = [generated(target, draft, seed) for seed in (11, 12)]
    assert runs[0] != runs[1]
    p = chi2_pvalue(counts_of(runs), probs)
    print(f"chi-square p-value, gemma2: {p:.3g}")
    assert p > 1e-3, p


# ----------------------------------------------------------------------------- GGUF

gguf = pytest.importorskip("gguf")


def write_gemma_gguf(path, torch_model, kind):
    """torch_model as llama.cpp's converter writes it (convert_hf_to_gguf.py, Gemma2Model /
    Gemma3Model): F32 tensors named by the gguf package's own tensor map, 1 added to every
    RMSNorm weight, no output tensor when tied; the metadata keys it writes."""
    cfg = torch_model.config
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[kind]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), kind)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    if kind == "gemma2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for hf, t in torch_model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        if hf.endswith("norm.weight"):
            a = a + np.float32(1)
        w.add_tensor(names.get_name(hf, try_suffixes=(".weight",)), a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_as_llama_cpp_writes_it_loads_to_the_same_model(family, tmp_path):
    kind, target, _, torch_target = family
    path = write_gemma_gguf(tmp_path / f"{kind}.gguf", torch_target, kind)
    g = oj.load_model(path, dtype="float32")
    # llama.cpp has no key for the score scale (1/sqrt(D) but for the 27B models) nor for
    # the layer pattern (every 2nd layer global for gemma2, every 6th for gemma3)
    pattern = 2 if kind == "gemma2" else 6
    want = dataclasses.replace(
        target.config, query_pre_attn_scalar=target.config.head_dim,
        sliding_layers=tuple(bool((i + 1) % pattern) for i in range(target.config.num_layers)),
        rms_norm_eps=g.config.rms_norm_eps)
    assert g.config.rms_norm_eps == pytest.approx(1e-6)  # stored as float32
    assert g.config == want
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), g.params,
                 target.params)


def test_load_sharded_places_the_same_params(family):
    """Every Gemma leaf (the extra norms included) has sharding axes and reads slice-wise."""
    from ouroboros_jax.sharding import load_sharded, make_mesh

    kind, target, _, _ = family
    placed = load_sharded(target.path, make_mesh(data=1, model=2), dtype="float32")
    assert set(placed.params["layers"]) == set(target.params["layers"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 placed.params, target.params)
    assert placed.params["layers"]["wq"].sharding.spec[2] == "model"  # heads split


def test_presets_count_their_published_sizes():
    """The planner's Gemma presets: parameters of their leaves' shapes (norms after attention
    and the MLP, q/k norms) add up to the published sizes."""
    from ouroboros_jax.models.llama import param_shapes
    from ouroboros_jax.models.presets import PRESETS

    published = {"gemma-2-2b": 2.61e9, "gemma-2-9b": 9.24e9, "gemma-2-27b": 27.2e9,
                 "gemma-3-1b": 1.0e9, "gemma-3-27b": 27.0e9}
    for name, n in published.items():
        c = PRESETS[name]
        total = sum(int(np.prod(s)) for s in jax.tree.leaves(
            param_shapes(c), is_leaf=lambda x: isinstance(x, tuple)))
        assert total == c.num_params()
        assert abs(total - n) / n < 0.01, (name, total)


# ----------------------------------------------------------------------------- chat

# google/gemma-7b-it's chat template, which gemma-2-*-it ship as well (search index file
# 19197196479 quotes it as gemma-7b-it's)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}")


def test_end_of_turn_is_gemmas_end_of_turn_token():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ouroboros_jax.chat import apply_chat, end_of_turn_id

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user",
             "model", "hi", "\n"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=["<start_of_turn>",
                                                             "<end_of_turn>"],
                                  chat_template=GEMMA_TEMPLATE)
    assert end_of_turn_id(tok) == 5
    ids = apply_chat(tok, [{"role": "user", "content": "hi"}])
    assert ids[:3] == [2, 4, 6] and ids[-2:] == [4, 7]  # <bos><start_of_turn>user ... model


# ----------------------------------------------------------------------------- refusals

HUB = os.path.join(os.path.dirname(__file__), "data", "hub_configs")


def _hub(name):
    with open(os.path.join(HUB, name + ".json")) as f:
        return json.load(f)


def test_the_published_gemma_configs_read_as_published():
    c = ModelConfig.from_hf_dict(_hub("google--gemma-2-2b-it"))
    assert (c.model_type, c.num_layers, c.head_dim, c.sliding_window) == ("gemma2", 26, 256, 4096)
    assert c.sliding_layers == (True, False) * 13 and c.tie_word_embeddings
    assert (c.attn_softcap, c.final_softcap, c.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert c.eos_token_id == (1, 107) and c.hidden_act == "gelu_pytorch_tanh"
    c = ModelConfig.from_hf_dict(_hub("google--gemma-2-9b-it"))
    assert (c.num_layers, c.num_kv_heads, c.sliding_window) == (42, 8, 4096)
    c = ModelConfig.from_hf_dict(_hub("google--gemma-3-1b-it"))
    assert (c.model_type, c.num_kv_heads, c.sliding_window, c.qk_norm) == (
        "gemma3_text", 1, 512, True)
    assert c.sliding_layers == ((True,) * 5 + (False,)) * 4 + (True,) * 2
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert (c.attn_softcap, c.final_softcap, c.eos_token_id) == (None, None, (1, 106))
    # absent soft caps are transformers' defaults (Gemma 2: 50 and 30), null ones none
    d = {k: v for k, v in _hub("google--gemma-2-2b-it").items() if "softcapping" not in k}
    c = ModelConfig.from_hf_dict(d)
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    c = ModelConfig.from_hf_dict({**d, "attn_logit_softcapping": None,
                                  "final_logit_softcapping": None})
    assert (c.attn_softcap, c.final_softcap) == (None, None)


@pytest.mark.parametrize("name, change, field", [
    ("google--gemma-2-2b-it", {"sliding_window": None}, "sliding_window"),
    ("google--gemma-2-2b-it", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar"),
    ("google--gemma-2-2b-it", {"hidden_activation": "gelu", "hidden_act": "gelu"},
     "hidden_activation"),
    ("google--gemma-2-2b-it", {"hidden_act": "silu"}, "hidden_act"),
    ("google--gemma-2-2b-it", {"attention_bias": True}, "attention_bias"),
    ("google--gemma-2-2b-it", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("google--gemma-2-2b-it", {"sliding_window_pattern": 6}, "sliding_window_pattern"),
    ("google--gemma-2-2b-it", {"sliding_window_size": 2048}, "sliding_window_size"),
    ("google--gemma-2-2b-it", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("google--gemma-2-2b-it", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     "rope_scaling"),
    ("google--gemma-3-1b-it", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("google--gemma-3-1b-it", {"use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ("google--gemma-3-1b-it", {"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ("google--gemma-3-1b-it", {"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                                   "sliding_attention": {
                                                       "rope_type": "linear", "factor": 2.0}}},
     "sliding_attention"),
    ("meta-llama--Llama-3.2-1B-Instruct", {"final_logit_softcapping": 30.0},
     "final_logit_softcapping"),
])
def test_bad_or_unsupported_fields_are_refused_by_name(name, change, field):
    d = {**_hub(name), **change}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(d)
