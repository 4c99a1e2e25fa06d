"""The model families people pair for speculative decoding (issue 29), each against
transformers on tiny random models made here:

- Llama 3.1+ from GGUF: the `rope_freqs` tensor (llama3 rope scaling as llama.cpp's converter
  stores it) applied as the frequency divisors transformers computes from `rope_scaling`;
- Qwen3 (dense): per-head RMSNorm of q and k before RoPE, no q/k/v bias, a head_dim that is
  not hidden/heads, tied draft;
- Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary embeddings, LongRoPE
  (its short regime, inside original_max_position_embeddings), a sliding window;

For each family: logits equal transformers' (fp32, both params layouts), greedy `generate`
equals transformers' greedy, speculative and Ouroboros with a same-family draft equal vanilla,
speculative sampling keeps the exact distribution (chi-square), a GGUF round trip, and
unsupported fields refused by name. Compiles are shared: every greedy call has the same batch
and prompt bucket.
"""

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ouroboros_jax as oj
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig
from ouroboros_jax.models import causal_mask, forward
from ouroboros_jax.models.config import llama3_factors, llama3_from_factors
from ouroboros_jax.models.gguf import permute_qk
from ouroboros_jax.models.layout import pack, view_pack

from conftest import make_hf_model
from test_speculative import chi2_pvalue

gguf = pytest.importorskip("gguf")

NEW = 24
SPEC = SpeculativeConfig(gamma=4)
OURO = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
# four prompts in one batch (one prompt bucket), ids in [3, 97)
PROMPTS = [np.random.RandomState(s).randint(3, 97, size=n).tolist()
           for s, n in ((1, 7), (2, 30), (3, 1), (4, 19))]


# ------------------------------------------------------------------ GGUF files as llama.cpp writes
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors(tm, arch):
    """GGUF name -> float32 array of a torch model, as llama.cpp's converter names and lays
    them out (q/k rows permuted for "llama"; the tied head not stored)."""
    cfg = tm.config
    out = {}
    for hf, t in tm.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf in _TOP:
            name = _TOP[hf]
        else:
            _, _, i, rest = hf.split(".", 3)
            name = f"blk.{i}.{_PER_LAYER[rest]}"
        a = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = permute_qk(a, cfg.num_attention_heads if "attn_q" in name
                           else cfg.num_key_value_heads)
        out[name] = a
    return out


def write_gguf(path, tm, arch, extra_tensors=None, extra_keys=None, drop=()):
    """A GGUF file of torch model `tm` (F32) with the metadata llama.cpp writes for `arch`."""
    cfg = tm.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    p = arch + "."
    for key, v in (("block_count", cfg.num_hidden_layers),
                   ("context_length", cfg.max_position_embeddings),
                   ("embedding_length", cfg.hidden_size),
                   ("feed_forward_length", cfg.intermediate_size),
                   ("attention.head_count", cfg.num_attention_heads),
                   ("attention.head_count_kv", cfg.num_key_value_heads),
                   ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                   ("rope.dimension_count",
                    int(head_dim * rope.get("partial_rotary_factor", 1.0))),
                   ("vocab_size", cfg.vocab_size)):
        w.add_uint32(p + key, v)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(p + "rope.freq_base", rope["rope_theta"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, (kind, value) in (extra_keys or {}).items():
        getattr(w, "add_" + kind)(key, value)
    tensors = {**gguf_tensors(tm, arch), **(extra_tensors or {})}
    for name, a in tensors.items():
        if name not in drop:
            w.add_tensor(name, np.asarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ------------------------------------------------------------------ the checks every family runs
def check_logits(model, tm, vocab, T=300):
    """Our logits on both params layouts equal transformers' (fp32) over T positions."""
    toks = np.random.RandomState(0).randint(0, vocab, size=(1, T))
    with torch.no_grad():
        ref = tm(torch.tensor(toks)).logits.numpy()
    for params in (model.params, pack(model.params, model.config),
                   view_pack(model.params, model.config)):
        logits, _ = forward(params, model.config, jnp.asarray(toks), jnp.arange(T)[None],
                            causal_mask(1, T))
        rel = np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, rel
    return ref


def transformers_greedy(tm, prompts, new=NEW):
    """transformers' greedy continuation of each prompt, no stop token (argmax of its forward
    over the whole sequence, step by step: `generate`'s min_new_tokens would also forbid the
    EOS id, which our eos_token_id=-1 does not)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(new):
                seq.append(int(tm(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p):])
    return out


def check_methods(target, draft, want):
    """Vanilla, speculative and Ouroboros (same-family draft) all give `want` on PROMPTS."""
    kw = dict(max_new_tokens=NEW, eos_token_id=-1)
    assert oj.generate(target, PROMPTS, **kw).tokens == want
    assert oj.generate(target, PROMPTS, draft=draft, method="speculative", config=SPEC,
                       **kw).tokens == want
    assert oj.generate(target, PROMPTS, draft=draft, method="ouroboros", config=OURO,
                       **kw).tokens == want


SV, S_ROWS, S_TEMP = 8, 3000, 0.8
S_PROMPT = [1, 5, 3, 6]


def three_token_probs(tm, temperature):
    """Exact P(t1, t2, t3 | S_PROMPT) under temperature sampling, from transformers."""
    with torch.no_grad():
        def nxt(seqs):
            return torch.softmax(tm(torch.tensor(seqs)).logits[:, -1].double() / temperature,
                                 -1)
        p1 = nxt([S_PROMPT])[0]
        p2 = nxt([S_PROMPT + [a] for a in range(SV)])
        p3 = nxt([S_PROMPT + [a, b] for a in range(SV) for b in range(SV)]).reshape(SV, SV, SV)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def check_sampling(target, draft, tm):
    """Speculative sampling (gamma 2: rejections at depth 1 and 2, a bonus) draws the first
    three tokens from transformers' distribution; the wrong temperature is rejected."""
    out = oj.generate(target, [S_PROMPT] * S_ROWS, draft=draft, method="speculative",
                      config=SpeculativeConfig(gamma=2), max_new_tokens=3, eos_token_id=-1,
                      temperature=S_TEMP, seed=29)
    counts = np.zeros((SV,) * 3, int)
    np.add.at(counts, tuple(np.asarray(out.tokens).T), 1)
    p_right = chi2_pvalue(counts, three_token_probs(tm, S_TEMP))
    p_wrong = chi2_pvalue(counts, three_token_probs(tm, 1.0))
    assert p_right > 1e-3, p_right
    assert p_wrong < 1e-6, p_wrong


# ====================================================================== Llama 3.1+ from GGUF
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def llamacpp_rope_freqs(cfg):
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), transcribed: the
    llama3 rope factors it writes as `rope_freqs.weight`."""
    rope = cfg.rope_parameters
    base = rope["rope_theta"]
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, np.float32)


def _llama3_gguf(tm, path, **kw):
    return write_gguf(path, tm, "llama",
                      extra_tensors={"rope_freqs.weight": llamacpp_rope_freqs(tm.config)}, **kw)


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    """(target, draft, torch target): Llama 3.1-style target (GQA, untied) and Llama 3.2-style
    draft (tied), both with llama3 rope scaling, loaded from GGUF files written as llama.cpp
    writes them (rope_freqs tensor, no rope_scaling metadata)."""
    d = tmp_path_factory.mktemp("llama31")
    kw = dict(rope_theta=10000.0, rope_scaling=dict(LLAMA3))  # transformers edits its dict
    tt = make_hf_model(d / "t", vocab=97, seed=11, **kw)
    td = make_hf_model(d / "d", vocab=97, layers=1, hidden=32, heads=2, kv_heads=1, inter=64,
                       seed=12, tie_word_embeddings=True, **kw)
    return (oj.load_model(_llama3_gguf(tt, d / "t.gguf")),
            oj.load_model(_llama3_gguf(td, d / "d.gguf")), tt)


def test_llama31_gguf_rope_freqs_are_transformers_llama3(llama31):
    target, _, tm = llama31
    assert target.config.rope_scaling[0] == "factors"
    ref = check_logits(target, tm, 97)
    # the factors matter here: the same weights without them are far off
    import dataclasses

    plain = dataclasses.replace(target.config, rope_scaling=None)
    T = ref.shape[1]
    toks = np.random.RandomState(0).randint(0, 97, size=(1, T))  # check_logits' tokens
    logits, _ = forward(target.params, plain, jnp.asarray(toks), jnp.arange(T)[None],
                        causal_mask(1, T))
    assert np.abs(np.asarray(logits) - ref).max() / np.abs(ref).max() > 1e-2


def test_llama31_gguf_greedy_and_methods(llama31):
    target, draft, tm = llama31
    want = transformers_greedy(tm, PROMPTS)
    check_methods(target, draft, want)


def test_llama31_gguf_sampling_keeps_the_distribution(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama31_v8")
    kw = dict(vocab=SV, rope_theta=10000.0, rope_scaling=dict(LLAMA3), scale=0.15)
    tt = make_hf_model(d / "t", hidden=32, heads=2, kv_heads=1, inter=64, seed=13, **kw)
    td = make_hf_model(d / "d", layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=14,
                       tie_word_embeddings=True, **kw)
    check_sampling(oj.load_model(_llama3_gguf(tt, d / "t.gguf")),
                   oj.load_model(_llama3_gguf(td, d / "d.gguf")), tt)


def test_llama31_factors_as_config_json(llama31, tmp_path):
    """gguf_to_hf writes the factors back as the llama3 rope_scaling they came from, and
    transformers loads that directory to the same logits."""
    from checkpoints_tools.gguf_to_hf import convert

    target = llama31[0]
    theta, D = 10000.0, target.config.head_dim
    got = llama3_from_factors(theta, D, target.config.rope_scaling[1])
    assert got == LLAMA3
    np.testing.assert_allclose(llama3_factors(theta, D, 8.0, 1.0, 4.0, 64),
                               target.config.rope_scaling[1], rtol=1e-6)
    out = tmp_path / "hf"
    convert(target.path, str(out))
    back = oj.load_model(str(out))
    assert back.config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64)
    check_logits(back, llama31[2], 97, T=120)


def test_llama31_gguf_bad_rope_freqs_refused(llama31, tmp_path):
    tm = llama31[2]
    freqs = llamacpp_rope_freqs(tm.config)
    short = write_gguf(tmp_path / "short.gguf", tm, "llama",
                       extra_tensors={"rope_freqs.weight": freqs[:-1]})
    with pytest.raises(ValueError, match=r"short\.gguf: tensor rope_freqs\.weight has 7 values, "
                                         "the head dim 16 implies 8"):
        oj.load_model(short)
    neg = write_gguf(tmp_path / "neg.gguf", tm, "llama",
                     extra_tensors={"rope_freqs.weight": -freqs})
    with pytest.raises(ValueError, match=r"neg\.gguf: tensor rope_freqs\.weight must hold "
                                         "positive finite factors"):
        oj.load_model(neg)
    both = _llama3_gguf(tm, tmp_path / "both.gguf", extra_keys={
        "llama.rope.scaling.type": ("string", "linear"),
        "llama.rope.scaling.factor": ("float32", 2.0)})
    with pytest.raises(ValueError, match=r"both\.gguf: tensor 'rope_freqs\.weight' together "
                                         "with rope.scaling.type 'linear'"):
        oj.load_model(both)
    with pytest.raises(ValueError, match="rope_freqs: these rope frequency factors are not "
                                         "those of a llama3 rope_scaling"):
        llama3_from_factors(10000.0, 16, [1.0, 3.0, 1.5, 8.0, 8.0, 8.0, 8.0, 8.0])


# ====================================================================== Qwen3 (dense)
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(target, draft, torch target, torch draft): a Qwen3 target (GQA, untied, head_dim 32 !=
    hidden/heads) and a tied draft (as Qwen3-0.6B), from HF directories."""
    d = tmp_path_factory.mktemp("qwen3")
    tt = make_hf_model(d / "t", model_type="qwen3", vocab=97, head_dim=32, seed=21)
    td = make_hf_model(d / "d", model_type="qwen3", vocab=97, layers=1, hidden=32, heads=2,
                       kv_heads=1, inter=64, seed=22, tie_word_embeddings=True)
    return oj.load_model(str(d / "t")), oj.load_model(str(d / "d")), tt, td


def test_qwen3_logits_greedy_and_methods(qwen3):
    target, draft, tm, _ = qwen3
    c = target.config
    assert (c.qk_norm, c.qkv_bias, c.head_dim, c.hidden_size // c.num_heads) == (
        True, False, 32, 16)
    check_logits(target, tm, 97)
    check_methods(target, draft, transformers_greedy(tm, PROMPTS))


def test_qwen3_sampling_keeps_the_distribution(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_v8")
    kw = dict(model_type="qwen3", vocab=SV, hidden=32, heads=2, kv_heads=1, inter=64,
              scale=0.15)
    tt = make_hf_model(d / "t", seed=23, **kw)
    make_hf_model(d / "d", layers=1, seed=24, tie_word_embeddings=True, **kw)
    check_sampling(oj.load_model(str(d / "t")), oj.load_model(str(d / "d")), tt)


def test_qwen3_gguf_round_trip(qwen3, tmp_path):
    """qwen3 GGUFs as llama.cpp writes them (attn_q_norm / attn_k_norm, q/k unpermuted, a tied
    head not stored) load to the directories' config and params exactly."""
    import dataclasses

    import jax

    for m, tm in ((qwen3[0], qwen3[2]), (qwen3[1], qwen3[3])):
        g = oj.load_model(write_gguf(tmp_path / f"{m.config.num_layers}.gguf", tm, "qwen3"))
        # GGUF keeps eps as float32 and no pad id here
        assert g.config.rms_norm_eps == pytest.approx(m.config.rms_norm_eps, rel=1e-6)
        assert g.config == dataclasses.replace(m.config, pad_token_id=None,
                                               rms_norm_eps=g.config.rms_norm_eps)
        for a, b in zip(jax.tree.leaves(g.params), jax.tree.leaves(m.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_load_sharded(model):
    """load_sharded over a 2-way "model" axis reads the directory into the same params, each
    leaf placed by its table axes (norm vectors over head_dim replicated)."""
    import jax

    from ouroboros_jax.sharding import load_sharded, make_mesh, param_shardings

    mesh = make_mesh(1, 2)
    sharded = load_sharded(model.path, mesh, dtype="float32")
    want = param_shardings(model.config, mesh)
    for a, b, sh in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(model.params),
                        jax.tree.leaves(want)):
        assert a.sharding == sh
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qwen3_load_sharded(qwen3):
    check_load_sharded(qwen3[0])


def test_qwen3_bad_fields_refused(qwen3):
    import json

    from ouroboros_jax.models.config import ModelConfig

    with open(os.path.join(HUB, "Qwen--Qwen3-8B.json")) as f:
        hub = json.load(f)
    for change, match in (
            (dict(use_sliding_window=True), "use_sliding_window=true is unsupported for qwen3"),
            (dict(attention_bias=True), "attention_bias=true is unsupported"),
            (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}),
             "rope_scaling type 'yarn' unsupported"),
            (dict(num_experts=8), r"unsupported config field\(s\) \['num_experts'\]")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**hub, **change})


# ====================================================================== Phi-3 / Phi-4-mini
def _longrope(rotary_dim, seed):
    rs = np.random.RandomState(seed)
    return {"type": "longrope", "short_factor": (1 + rs.rand(rotary_dim // 2)).tolist(),
            "long_factor": (4 + 8 * rs.rand(rotary_dim // 2)).tolist()}


PHI = dict(model_type="phi3", vocab=97, partial_rotary_factor=0.75,
           original_max_position_embeddings=256)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(target, draft, torch target, torch draft) as Phi-4-mini: fused qkv_proj and
    gate_up_proj, RoPE over 3/4 of each head, LongRoPE (4x the original 256 positions: an
    attention factor of 1.118); the target with GQA and a sliding window of 48, the draft
    tied."""
    d = tmp_path_factory.mktemp("phi3")
    tt = make_hf_model(d / "t", seed=31, sliding_window=48, rope_scaling=_longrope(12, 0), **PHI)
    td = make_hf_model(d / "d", layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=32,
                       tie_word_embeddings=True, rope_scaling=_longrope(12, 1), **PHI)
    return oj.load_model(str(d / "t")), oj.load_model(str(d / "d")), tt, td


def test_phi3_logits_greedy_and_methods(phi3):
    target, draft, tm, _ = phi3
    c = target.config
    assert (c.rotary_dim, c.sliding_window, c.max_position_embeddings) == (12, 48, 256)
    assert c.rope_attention_scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))
    check_logits(target, tm, 97, T=250)  # inside the original 256 positions
    check_methods(target, draft, transformers_greedy(tm, PROMPTS))


def test_phi3_sampling_keeps_the_distribution(tmp_path_factory):
    d = tmp_path_factory.mktemp("phi3_v8")
    kw = dict(PHI, vocab=SV, hidden=32, heads=2, kv_heads=1, inter=64, scale=0.15)
    tt = make_hf_model(d / "t", seed=33, rope_scaling=_longrope(12, 2), **kw)
    make_hf_model(d / "d", layers=1, seed=34, tie_word_embeddings=True,
                  rope_scaling=_longrope(12, 3), **kw)
    check_sampling(oj.load_model(str(d / "t")), oj.load_model(str(d / "d")), tt)


def test_phi3_load_sharded_and_save(phi3, tmp_path):
    """load_sharded reads each head's rows out of the fused tensors; save_hf_checkpoint writes
    them fused again, as transformers loads them."""
    import transformers

    from ouroboros_jax.models.loading import save_hf_checkpoint

    target, _, tm, _ = phi3
    check_load_sharded(target)
    save_hf_checkpoint(str(tmp_path), target.config, target.params)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ref = tm.state_dict()
    assert "model.layers.0.self_attn.qkv_proj.weight" in back.state_dict()
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), ref[k].numpy(), err_msg=k)
    toks = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        np.testing.assert_allclose(back(toks).logits.numpy(), tm(toks).logits.numpy(),
                                   rtol=1e-5, atol=1e-5)


def _phi3_gguf(tm, path, **kw):
    """tm as llama.cpp's Phi3MiniModel converter writes it: fused tensors as they are, the
    LongRoPE factors as tensors with the original length and the attention factor as keys,
    the sliding window as a key (0: none)."""
    cfg, rope = tm.config, tm.config.rope_parameters
    orig = cfg.original_max_position_embeddings
    scale = cfg.max_position_embeddings / orig
    return write_gguf(path, tm, "phi3", extra_tensors={
        "rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)},
        extra_keys={"phi3.rope.scaling.original_context_length": ("uint32", orig),
                    "phi3.rope.scaling.attn_factor": (
                        "float32", math.sqrt(1 + math.log(scale) / math.log(orig))),
                    "phi3.attention.sliding_window": ("uint32", cfg.sliding_window or 0)},
        **kw)


def test_phi3_gguf_round_trip(phi3, tmp_path):
    """phi3 GGUFs load to the directories' params exactly and to their config (LongRoPE,
    partial rotary, window), so to the same logits."""
    import jax

    for m, tm in ((phi3[0], phi3[2]), (phi3[1], phi3[3])):
        g = oj.load_model(_phi3_gguf(tm, tmp_path / f"{m.config.num_layers}.gguf"))
        c, want = g.config, m.config
        assert (c.partial_rotary_factor, c.sliding_window, c.max_position_embeddings,
                c.tie_word_embeddings) == (want.partial_rotary_factor, want.sliding_window,
                                           want.max_position_embeddings,
                                           want.tie_word_embeddings)
        assert c.rope_scaling[0] == "longrope" and c.rope_scaling[3] == want.rope_scaling[3]
        np.testing.assert_allclose(c.rope_scaling[1:3], want.rope_scaling[1:3], rtol=1e-6)
        assert c.rope_attention_scale == pytest.approx(want.rope_attention_scale, rel=1e-6)
        for a, b in zip(jax.tree.leaves(g.params), jax.tree.leaves(m.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = _phi3_gguf(phi3[2], tmp_path / "bad.gguf", drop={"blk.0.attn_qkv.weight"})
    with pytest.raises(ValueError, match=r"bad\.gguf: GGUF file lacks tensor\(s\) "
                                         r"\['blk\.0\.attn_qkv\.weight:wq'"):
        oj.load_model(bad)


def test_phi3_bad_fields_refused(phi3):
    import json

    from ouroboros_jax.models.config import ModelConfig

    with open(os.path.join(HUB, "microsoft--Phi-4-mini-instruct.json")) as f:
        hub = json.load(f)
    short = dict(hub["rope_scaling"], short_factor=hub["rope_scaling"]["short_factor"][:-1])
    for change, match in (
            (dict(rope_scaling=short), "rope_scaling field 'short_factor' must be a list of 48 "
                                       "positive numbers"),
            (dict(rope_scaling={"type": "su", "short_factor": [1.0] * 48,
                                "long_factor": [1.0] * 48}), "rope_scaling type 'su'"),
            (dict(partial_rotary_factor=1.5), "field 'partial_rotary_factor' must be in"),
            (dict(hidden_act="gelu_new"), "hidden_act 'gelu_new' unsupported")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**hub, **change})
    llama = {**hub, "model_type": "llama", "rope_scaling": None}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75 is unsupported"):
        ModelConfig.from_hf_dict(llama)


# ====================================================================== presets and hub configs
HUB = os.path.join(os.path.dirname(__file__), "data", "hub_configs")
PRESET_OF = {  # memory-planner preset -> the published config.json it stands for
    "llama-3.1-8b": "meta-llama--Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama--Llama-3.1-70B-Instruct",
    "llama-3.2-1b": "meta-llama--Llama-3.2-1B-Instruct",
    "qwen3-0.6b": "Qwen--Qwen3-0.6B", "qwen3-8b": "Qwen--Qwen3-8B", "qwen3-32b": "Qwen--Qwen3-32B",
    "phi-4-mini": "microsoft--Phi-4-mini-instruct",
}
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
                "tie_word_embeddings", "qkv_bias", "model_type", "max_position_embeddings",
                "qk_norm", "partial_rotary_factor", "sliding_window")


@pytest.mark.parametrize("preset", sorted(PRESET_OF))
def test_preset_is_its_published_config(preset):
    import json

    from ouroboros_jax.models.config import ModelConfig
    from ouroboros_jax.models.presets import PRESETS

    with open(os.path.join(HUB, PRESET_OF[preset] + ".json")) as f:
        hub = ModelConfig.from_hf_dict(json.load(f))
    for field in SHAPE_FIELDS:
        assert getattr(PRESETS[preset], field) == getattr(hub, field), field
    assert PRESETS[preset].num_params() == hub.num_params()


# ====================================================================== chat templates
TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "chat_templates")


def _template_tokenizer(template, specials, eos):
    """A character-level tokenizer carrying the family's special tokens and its published
    chat template (the real tokenizers are not shipped here)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials)}
    for c in ["\n"] + [chr(c) for c in range(32, 127)]:
        vocab.setdefault(c, len(vocab))
    t = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token=specials[0], eos_token=eos,
                                  unk_token=specials[0], chat_template=template)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


@pytest.mark.parametrize("name, specials, eot, prompt_end", [
    ("Qwen--Qwen3-4B", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>",
     "<|im_start|>assistant\n<think>\n"),
    ("microsoft--Phi-4-mini-instruct", ["<|endoftext|>", "<|user|>", "<|assistant|>",
                                        "<|system|>", "<|end|>"], "<|end|>", "<|assistant|>"),
    ("meta-llama--Meta-Llama-3-8B-Instruct", [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>"], "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
])
def test_family_chat_template_and_end_of_turn(name, specials, eot, prompt_end):
    """The published template renders a conversation with its generation prompt, and the turn
    ends in the family's end-of-turn token, which becomes a default stop."""
    from ouroboros_jax.chat import apply_chat, end_of_turn_id

    with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
        tok = _template_tokenizer(f.read(), specials, specials[1] if "Llama" in name
                                  else specials[0])
    chat = [{"role": "user", "content": "Hi"}]
    ids = apply_chat(tok, chat)
    assert tok.decode(ids).endswith(prompt_end)
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids(eot) == specials.index(eot)
