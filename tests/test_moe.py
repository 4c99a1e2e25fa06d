"""Mixture-of-experts targets (issue 57): tiny random Qwen3-MoE, Mixtral and OLMoE models made
here with transformers, loaded from their directories.

- logits equal transformers' (fp32, both params layouts, both expert paths) and greedy
  decoding equals transformers' greedy, 2 prompts x 24 tokens;
- every method (vanilla, speculative, lookahead, prompt lookup, Ouroboros; a dense Llama
  draft of the same vocabulary) gives vanilla's greedy tokens: Ouroboros on every family, each
  other method on one family (`FAMILY_METHODS`);
- the grouped expert path equals the one-hot reference, and a T-token forward reads only the
  routed experts, each once: poisoning an unrouted expert's weights with NaN leaves the grouped
  logits unchanged (the one-hot path, which multiplies every expert, turns NaN), and the
  program multiplies one gathered slice per distinct routed expert;
- the layouts checkpoints use: one tensor per expert (what save_pretrained writes; Mixtral's
  w1/w2/w3 names), every expert of a layer stacked in one tensor (transformers' in-memory
  layout), slice-wise reading onto a mesh with the experts sharded, saving back;
- unsupported routings and layer patterns refused by name.
"""

import dataclasses
import json
import os

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ouroboros_jax as oj
from ouroboros_jax.decoding.lookahead import LookaheadConfig
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.prompt_lookup import PromptLookupConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig
from ouroboros_jax.models import causal_mask, forward
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.llama import expert_groups, init_params
from ouroboros_jax.models.loading import save_hf_checkpoint

from conftest import copy_dir, edit_config, make_hf_model
from test_families import check_load_sharded, check_logits, transformers_greedy

NEW = 24
V = 97
# two prompts in one batch; the second repeats itself, so prompt lookup finds matches
PROMPTS = [np.random.RandomState(1).randint(3, V, size=11).tolist(),
           [5, 9, 14, 22, 5, 9, 14, 22, 5, 9]]
Y, K = 8, 2  # experts, experts per token
# (model_type, the extra transformers config fields of its tiny model)
FAMILIES = {
    "qwen3_moe": dict(num_experts=Y, num_experts_per_tok=K, moe_intermediate_size=24,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=Y, num_experts_per_tok=K),
    "olmoe": dict(num_experts=Y, num_experts_per_tok=K),  # norm_topk_prob false
}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """model_type -> (Model, torch model) for each family's tiny target (2 layers, hidden 32,
    GQA 4/2 heads, 8 experts, top 2)."""
    out = {}
    for mt, extra in FAMILIES.items():
        d = tmp_path_factory.mktemp(mt)
        tm = make_hf_model(d, model_type=mt, vocab=V, hidden=32, heads=4, kv_heads=2, inter=48,
                           seed=57, **extra)
        out[mt] = (oj.load_model(str(d), dtype="float32"), tm)
    return out


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A dense one-layer Llama draft over the same vocabulary."""
    d = tmp_path_factory.mktemp("moe_draft")
    make_hf_model(d, vocab=V, layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=58)
    return oj.load_model(str(d), dtype="float32")


@pytest.mark.parametrize("mt", sorted(FAMILIES))
def test_logits_and_greedy_equal_transformers(moe, mt):
    model, tm = moe[mt]
    c = model.config
    assert (c.num_experts, c.experts_per_token) == (Y, K)
    assert c.norm_topk_prob == (mt != "olmoe")  # Mixtral always renormalizes
    check_logits(model, tm, V, T=128)
    check_logits(dataclasses.replace(model, config=dataclasses.replace(
        c, moe_dispatch="onehot")), tm, V, T=128)
    out = oj.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=-1)
    assert out.tokens == transformers_greedy(tm, PROMPTS, NEW)


METHODS = (("speculative", SpeculativeConfig(gamma=4)),
           ("lookahead", LookaheadConfig(window=4, ngram=3, guesses=3)),
           ("prompt_lookup", PromptLookupConfig(max_ngram=3, candidates=2, length=4)),
           ("ouroboros", OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)))


# A method meets a family only through `forward`, whose logits and greedy tokens equal
# transformers' for every family (above), and the MoE layer is one code path for all three: so
# Ouroboros (the tree verify, every mechanism) runs on every family and each other method on
# one: every method on an MoE target, two method loops compiled per family instead of four.
FAMILY_METHODS = {"mixtral": ("ouroboros", "prompt_lookup"), "olmoe": ("ouroboros", "lookahead"),
                  "qwen3_moe": ("ouroboros", "speculative")}


def test_family_methods_cover_every_method_and_family():
    assert sorted(FAMILY_METHODS) == sorted(FAMILIES)
    assert {m for ms in FAMILY_METHODS.values() for m in ms} == {m for m, _ in METHODS}


@pytest.mark.parametrize("mt", sorted(FAMILIES))
def test_every_method_equals_vanilla(moe, draft, mt):
    model, _ = moe[mt]
    kw = dict(max_new_tokens=NEW, eos_token_id=-1)
    want = oj.generate(model, PROMPTS, **kw).tokens
    for method, cfg in METHODS:
        if method not in FAMILY_METHODS[mt]:
            continue
        got = oj.generate(model, PROMPTS, draft=draft if method in ("speculative", "ouroboros")
                          else None, method=method, config=cfg, **kw).tokens
        assert got == want, method


# ------------------------------------------------------------------ the grouped path
def test_expert_groups_layout():
    """Rows sorted by expert, one slot per distinct routed expert (ascending), the slots left
    over pointing past the last expert with no rows; all experts once rows outnumber them."""
    experts = jnp.array([[3, 1], [1, 5], [3, 0]], jnp.int32)  # O = 6 < Y = 8
    order, slots, sizes = expert_groups(experts, Y)
    flat = np.asarray(experts).reshape(-1)
    assert np.all(np.diff(flat[np.asarray(order)]) >= 0)
    assert sorted(np.asarray(order).tolist()) == list(range(6))
    assert np.asarray(slots).tolist() == [0, 1, 3, 5, Y, Y]
    assert np.asarray(sizes).tolist() == [1, 2, 2, 1, 0, 0]
    many = jnp.array([[0, 1], [1, 2], [2, 1], [7, 1]], jnp.int32)  # O = 8 = Y
    _, slots, sizes = expert_groups(many, Y)
    assert np.asarray(slots).tolist() == list(range(Y))
    assert np.asarray(sizes).tolist() == [1, 4, 2, 0, 0, 0, 0, 1]


def _one_layer_moe(dispatch):
    c = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=1,
                    num_heads=4, num_kv_heads=2, num_experts=Y, experts_per_token=K,
                    moe_intermediate_size=24, norm_topk_prob=True, moe_dispatch=dispatch)
    return c, init_params(c, jax.random.key(57), std=0.3)


def _logits(params, c, tokens):
    T = len(tokens)
    out, _ = forward(params, c, jnp.array([tokens]), jnp.arange(T)[None], causal_mask(1, T))
    return np.asarray(out)


def _poisoned(params, expert):
    """params with one expert's weights all NaN."""
    lay = dict(params["layers"])
    for n in ("we_gate", "we_up", "we_down"):
        lay[n] = lay[n].at[:, expert].set(jnp.nan)
    return {**params, "layers": lay}


@pytest.mark.parametrize("tokens", [[7], [7, 40, 41]])
def test_a_forward_reads_only_its_routed_experts(tokens):
    """Of 8 experts, a 1-token forward (top 2) reads exactly 2 and a 3-token one at most 6:
    poisoning any other expert with NaN leaves its grouped logits exactly as they were, while
    the one-hot path reads (and is poisoned by) every expert."""
    c, params = _one_layer_moe("grouped")
    onehot = dataclasses.replace(c, moe_dispatch="onehot")
    clean = _logits(params, c, tokens)
    np.testing.assert_allclose(clean, _logits(params, onehot, tokens), rtol=1e-5, atol=1e-5)
    read = []
    for e in range(Y):
        bad = _poisoned(params, e)
        assert np.isnan(_logits(bad, onehot, tokens)).any()
        got = _logits(bad, c, tokens)
        if np.isnan(got).any():
            read.append(e)
        else:
            np.testing.assert_array_equal(got, clean)
    assert K <= len(read) <= min(Y, K * len(tokens))
    if len(tokens) == 1:
        assert len(read) == K


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (scan bodies, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_the_grouped_program_multiplies_each_routed_expert_once(moe):
    """The grouped forward of T tokens (O = 2T routed rows < 8 experts) multiplies its rows by
    gathered [O, E, F] slices, one per distinct routed expert, through 3 ragged dots per layer
    (gate, up, down); with more rows than experts, by the [Y, E, F] stack itself; the one-hot
    program multiplies every token by all Y experts and has no ragged dot."""
    model, _ = moe["qwen3_moe"]
    c = model.config
    E, F = c.hidden_size, c.moe_intermediate_size
    for T, slots in ((1, 2), (3, 6), (16, Y)):
        tok = jnp.zeros((1, T), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda p: forward(p, c, tok, jnp.arange(T)[None],
                                                 causal_mask(1, T)))(model.params)
        rd = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "ragged_dot_general"]
        assert len(rd) == 3  # the scan's body: gate, up, down
        assert sorted(e.invars[1].aval.shape for e in rd) == sorted(
            [(slots, E, F)] * 2 + [(slots, F, E)])
    onehot = dataclasses.replace(c, moe_dispatch="onehot")
    jaxpr = jax.make_jaxpr(lambda p: forward(p, onehot, tok, jnp.arange(T)[None],
                                             causal_mask(1, T)))(model.params)
    eqns = list(_eqns(jaxpr.jaxpr))
    assert not [e for e in eqns if e.primitive.name == "ragged_dot_general"]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert any(v.aval.shape == (Y, E, F) for e in dots for v in e.invars)


# ------------------------------------------------------------------ checkpoint layouts
def _stack_experts(src, dst, model):
    """A copy of directory src whose experts are stored as transformers holds them in memory:
    per layer mlp.experts.gate_up_proj [Y, 2F, E] and mlp.experts.down_proj [Y, E, F]."""
    from safetensors.numpy import load_file, save_file

    d = copy_dir(src, dst)
    fn = os.path.join(d, "model.safetensors")
    t = load_file(fn)
    mix = model.config.model_type == "mixtral"
    pre = "block_sparse_moe" if mix else "mlp"
    names = ("w1", "w3", "w2") if mix else ("gate_proj", "up_proj", "down_proj")
    for i in range(model.config.num_layers):
        def per_expert(n):
            return [t.pop(f"model.layers.{i}.{pre}.experts.{j}.{n}.weight") for j in range(Y)]

        gate, up, down = (per_expert(n) for n in names)
        t[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([g, u]) for g, u in zip(gate, up)])
        t[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(down)
        if mix:
            t[f"model.layers.{i}.mlp.gate.weight"] = t.pop(f"model.layers.{i}.{pre}.gate.weight")
    save_file(t, fn, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("mt", ["qwen3_moe", "mixtral"])
def test_stacked_expert_tensors_load_as_transformers_loads_them(moe, mt, tmp_path):
    import transformers

    model, tm = moe[mt]
    d = _stack_experts(model.path, tmp_path / "stacked", model)
    stacked = oj.load_model(d, dtype="float32")
    for a, b in zip(jax.tree.leaves(stacked.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # transformers reads the same layout into the same model
    toks = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(d).eval()(toks).logits
        # equal up to float32 rounding: torch may multiply a stacked expert tensor by another
        # kernel than the per-expert one (seen on an AMD Zen 5: 1.7e-6 at logits of ~5)
        np.testing.assert_allclose(theirs.numpy(), tm(toks).logits.numpy(), rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ValueError, match="slice-wise reading needs one tensor per expert"):
        from ouroboros_jax.sharding import load_sharded, make_mesh
        load_sharded(d, make_mesh(1, 2), dtype="float32")


@pytest.mark.parametrize("mt", ["mixtral", "olmoe"])
def test_load_sharded_puts_experts_on_the_model_axis(moe, mt):
    from jax.sharding import PartitionSpec as P

    from ouroboros_jax.sharding import make_mesh, param_specs

    model, _ = moe[mt]
    check_load_sharded(model)  # slice-wise, each device's experts read from their tensors
    specs = param_specs(model.config, make_mesh(1, 2))["layers"]
    assert specs["we_gate"] == P(None, "model", None, None)
    assert specs["we_down"] == P(None, "model", None, None)
    assert specs["router"] == P(None, None, "model")


def test_save_hf_checkpoint_round_trips_through_transformers(moe, tmp_path):
    """Our Mixtral saved (its w1/w2/w3 names, block_sparse_moe) loads into transformers with
    the same logits, and back into ours with the same params."""
    import transformers

    model, tm = moe["mixtral"]
    save_hf_checkpoint(str(tmp_path), model.config, model.params)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["num_local_experts"] == Y
    toks = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
        np.testing.assert_allclose(theirs(toks).logits.numpy(), tm(toks).logits.numpy(),
                                   rtol=0, atol=1e-5)
    back = oj.load_model(str(tmp_path), dtype="float32")
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("mt, change, match", [
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is unsupported"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\] is unsupported"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64),
     r"\['shared_expert_intermediate_size'\]"),
    ("qwen3_moe", dict(num_experts_per_tok=9), r"'num_experts_per_tok' must be in \[1, 8\]"),
    ("qwen3_moe", dict(num_experts=4), "disagree"),  # beside num_local_experts = 8
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0 is unsupported"),
    ("olmoe", dict(num_experts=None), "required field 'num_experts' is missing"),
    ("mixtral", dict(num_experts_per_tok=None), "required field 'num_experts_per_tok'"),
    ("mixtral", dict(scoring_func="sigmoid"), r"\['scoring_func'\]"),
    ("mixtral", dict(kv_lora_rank=512), r"\['kv_lora_rank'\]"),  # MLA attention
    ("mixtral", dict(model_type="deepseek_v3"), "unsupported model_type 'deepseek_v3'"),
])
def test_unsupported_fields_refused_by_name(moe, tmp_path, mt, change, match):
    d = copy_dir(moe[mt][0].path, tmp_path / "bad")
    edit_config(d, **change)
    with pytest.raises(ValueError, match=match):
        oj.load_model(d)


def test_a_dense_family_refuses_expert_fields(tiny_target, tmp_path):
    d = copy_dir(tiny_target.path, tmp_path / "bad")
    edit_config(d, num_experts=8)
    with pytest.raises(ValueError, match=r"\['num_experts'\] \(a olmoe / qwen3_moe field\)"):
        oj.load_model(d)


@pytest.mark.parametrize("change, match", [
    (dict(num_experts=8, experts_per_token=0), r"experts_per_token must be an integer in \[1"),
    (dict(num_experts=8, experts_per_token=9), r"experts_per_token must be an integer in \[1"),
    (dict(experts_per_token=2), "experts_per_token is set"),
    (dict(num_experts=-1), "num_experts must be an integer >= 0"),
    (dict(num_experts=8, experts_per_token=2, moe_dispatch="dense"), "moe_dispatch must be"),
])
def test_model_config_checks_the_expert_fields(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=1,
                    num_heads=4, num_kv_heads=2, **change)


# ------------------------------------------------------------------ GGUF
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
               "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
               "self_attn.o_proj.weight": "attn_output",
               "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
               "post_attention_layernorm.weight": "ffn_norm", "mlp.gate.weight": "ffn_gate_inp"}


def write_moe_gguf(path, tm, arch):
    """A GGUF file (F32) of a Qwen3-MoE, Mixtral ("llama") or OLMoE torch model as llama.cpp's
    converter writes it: each layer's experts stacked into one `*_exps` tensor, the router as
    `ffn_gate_inp`, the expert counts (and Qwen3-MoE's expert width) in the metadata; the
    q/k rows of a "llama" file permuted."""
    import gguf

    from ouroboros_jax.models.gguf import permute_qk

    cfg = tm.config
    w = gguf.GGUFWriter(str(path), arch)
    p = arch + "."
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key, v in (("block_count", cfg.num_hidden_layers),
                   ("context_length", cfg.max_position_embeddings),
                   ("embedding_length", cfg.hidden_size),
                   ("feed_forward_length", cfg.intermediate_size),
                   ("attention.head_count", cfg.num_attention_heads),
                   ("attention.head_count_kv", cfg.num_key_value_heads),
                   ("attention.key_length", D), ("attention.value_length", D),
                   ("rope.dimension_count", D), ("expert_count", cfg.num_experts),
                   ("expert_used_count", cfg.num_experts_per_tok)):
        w.add_uint32(p + key, v)
    if arch == "qwen3moe":
        w.add_uint32(p + "expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(p + "rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    sd = {k: v.detach().float().numpy() for k, v in tm.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf, name in _GGUF_LAYER.items():
            if pre + hf not in sd:
                continue  # Mixtral has no q/k norms
            a = sd[pre + hf]
            if arch == "llama" and name in ("attn_q", "attn_k"):
                a = permute_qk(a, cfg.num_attention_heads if name == "attn_q"
                               else cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{name}.weight", a)
        # transformers holds a layer's experts stacked: gate_up_proj [Y, 2F, E], down [Y, E, F]
        gate_up, down = sd[pre + "mlp.experts.gate_up_proj"], sd[pre + "mlp.experts.down_proj"]
        F = gate_up.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :F]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, F:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("mt, arch", [("qwen3_moe", "qwen3moe"), ("olmoe", "olmoe"),
                                      ("mixtral", "llama")])
def test_gguf_loads_to_the_directorys_model(moe, tmp_path, mt, arch):
    """The model written to GGUF as llama.cpp does loads to the directory's config (llama.cpp
    renormalizes Qwen3-MoE's and Mixtral's top k and not OLMoE's, as these tiny models do) and
    params, exactly; a "llama" file with expert keys is a Mixtral. gguf_to_hf turns it back
    into a directory transformers loads to the same logits."""
    pytest.importorskip("gguf")
    model, tm = moe[mt]
    g = oj.load_model(write_moe_gguf(tmp_path / f"{mt}.gguf", tm, arch), dtype="float32")
    assert g.config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps, rel=1e-6)
    assert g.config == dataclasses.replace(model.config, pad_token_id=None,
                                           rms_norm_eps=g.config.rms_norm_eps)
    for a, b in zip(jax.tree.leaves(g.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # checkpoints_tools/gguf_to_hf.py writes a directory transformers reads into the same model
    import transformers

    from checkpoints_tools.gguf_to_hf import main as gguf_to_hf

    gguf_to_hf([str(tmp_path / f"{mt}.gguf"), str(tmp_path / "hf")])
    toks = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        np.testing.assert_array_equal(back(toks).logits.numpy(), tm(toks).logits.numpy())


def test_gguf_expert_keys_checked_by_name(moe, tmp_path):
    pytest.importorskip("gguf")
    import gguf

    _, tm = moe["olmoe"]
    path = write_moe_gguf(tmp_path / "ok.gguf", tm, "olmoe")
    # the same file with expert_used_count above expert_count
    r = gguf.GGUFReader(path)
    bad = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(bad, "olmoe")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        v = Y + 1 if f.name == "olmoe.expert_used_count" else f.contents()
        if isinstance(v, float):
            w.add_float32(f.name, v)
        else:
            w.add_uint32(f.name, v)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'expert_used_count' \(9\) exceeds 'expert_count'"):
        oj.load_model(bad)


# ------------------------------------------------------------------ lowering
def test_moe_ouroboros_loop_lowers_with_experts_sharded():
    """An MoE target's Ouroboros loop (dense draft) lowers for TPU and CUDA on an abstract 2x4
    mesh, its experts split over "model" (expert parallel: 8 experts, 2 per device), with no
    host callback; the Qwen3-30B-A3B shapes in bf16 with no f32 copy of a weight."""
    from jax.sharding import AbstractMesh

    from ouroboros_jax import lowering as lw
    from ouroboros_jax.models.presets import PRESETS

    from test_lowering import TINY_DRAFT, arg_sharding, lowered

    mesh = AbstractMesh((2, 4), ("data", "model"))
    tiny = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=8, num_kv_heads=4, max_position_embeddings=1024,
                       model_type="qwen3_moe", qk_norm=True, num_experts=Y,
                       experts_per_token=K, moe_intermediate_size=32, norm_topk_prob=True)
    pair = lw.abstract_pair(tiny, TINY_DRAFT, mesh=mesh)
    exp = lowered(lw.loop_call("ouroboros", pair, batch=4, prompt_width=16, max_new_tokens=32))
    assert exp.nr_devices == 8
    text = exp.mlir_module()
    assert "ragged_dot" in text
    for leaf in ("we_gate", "we_up", "we_down"):
        assert arg_sharding(text, f"pair.tparams['layers']['{leaf}']") == \
            '[{}, {"model"}, {}, {}]'
    assert arg_sharding(text, "pair.tparams['layers']['router']") == '[{}, {}, {"model"}]'

    big, draft = PRESETS["qwen3-30b-a3b"], PRESETS["qwen3-0.6b"]
    pair = lw.abstract_pair(big, draft, dtype="bfloat16", mesh=mesh)
    exp = lowered(lw.loop_call("ouroboros", pair, batch=2, prompt_width=128,
                               max_new_tokens=256))
    assert not lw.f32_weight_copies(exp.mlir_module(), big, draft)


# ------------------------------------------------------------------ serving and memory
def test_engine_serves_an_moe_target_with_a_dense_draft(moe, draft):
    """The serving engine (Ouroboros, a dense draft) answers requests submitted together and
    mid-generation, more than its slots, each as `generate`'s vanilla greedy of its prompt
    alone."""
    from ouroboros_jax.serving import Engine, RequestParams

    model, _ = moe["qwen3_moe"]
    eng = Engine(model, draft, method="ouroboros",
                 config=OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2),
                 slots=2, max_cache_len=64, rounds_per_step=3)
    prompts, lengths = PROMPTS + [[30, 31, 32]], [12, 20, 7]
    handles = [eng.submit(p, RequestParams(max_tokens=n)) for p, n in zip(prompts[:2], lengths)]
    eng.step()
    handles.append(eng.submit(prompts[2], RequestParams(max_tokens=lengths[2])))
    while eng.step():
        pass
    for p, n, h in zip(prompts, lengths, handles):
        want = oj.generate(model, [p], max_new_tokens=n).tokens[0]  # the model's EOS, as served
        assert h.result(timeout=0).token_ids == want, (p, n)


def test_memory_plan_counts_the_experts(moe):
    """The memory planner (`ouroboros-jax memory`) counts every expert's bytes: the tiny
    model's plan is its params' bytes; the full-size presets have their published parameter
    counts (Qwen3-30B-A3B 30.5B, Mixtral-8x7B 46.7B, OLMoE-1B-7B 6.9B), and experts split over
    "model" leave a quarter of them per device on a 1x4 mesh."""
    from ouroboros_jax.models.presets import PRESETS
    from ouroboros_jax.sharding import memory_plan

    model, _ = moe["olmoe"]
    plan = memory_plan(model.config, 1, 1, 1, 64, dtype="float32")
    assert plan["params_total_bytes"] == sum(a.nbytes for a in jax.tree.leaves(model.params))
    assert plan["num_params"] == sum(a.size for a in jax.tree.leaves(model.params))
    for name, billions in (("qwen3-30b-a3b", 30.5), ("mixtral-8x7b", 46.7),
                           ("olmoe-1b-7b", 6.9)):
        c = PRESETS[name]
        plan = memory_plan(c, 1, 4, 1, 4096)
        assert round(plan["num_params"] / 1e9, 1) == billions
        assert plan["params_total_bytes"] == 2 * plan["num_params"]
        experts = 3 * c.num_layers * c.num_experts * c.hidden_size * c.moe_intermediate_size
        assert plan["params_per_device_bytes"] < 2 * (plan["num_params"] - experts * 3 / 4)


def test_methods_on_a_mesh_with_experts_sharded(moe, draft):
    """On a 1x4 mesh (8 experts, 2 per device; heads and the vocabulary split too) vanilla
    and Ouroboros, and on a 2x2 one Ouroboros, give single-device vanilla's greedy tokens."""
    from ouroboros_jax.sharding import make_mesh

    model, _ = moe["qwen3_moe"]
    kw = dict(max_new_tokens=NEW, eos_token_id=-1)
    want = oj.generate(model, PROMPTS, **kw).tokens
    ouro = dict(draft=draft, method="ouroboros",
                config=OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2))
    assert oj.generate(model, PROMPTS, mesh=make_mesh(1, 4), **kw).tokens == want
    for shape in ((1, 4), (2, 2)):
        assert oj.generate(model, PROMPTS, mesh=make_mesh(*shape), **ouro,
                           **kw).tokens == want, shape


def test_auto_on_an_moe_target(moe, draft, tmp_path, monkeypatch):
    """config="auto" (the default) with an MoE target and a dense draft: prices its forwards
    by the experts their tokens reach (its notes say so) and gives vanilla's greedy tokens."""
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(tmp_path))
    model, _ = moe["qwen3_moe"]
    kw = dict(max_new_tokens=16, eos_token_id=-1)
    want = oj.generate(model, PROMPTS, **kw).tokens
    out = oj.generate(model, PROMPTS, draft=draft, method="speculative", **kw)
    assert out.tokens == want
    assert any("distinct experts" in s for s in out.stats["auto"]["assumed"])


def test_the_verify_cost_bench_runs(capsys):
    """`python -m experiments.moe_verify` on a toy model: a row per T with both
    paths' times and the distinct experts of its tokens (k to min(Y, T*k)), and the cost
    model's: the uniform expectation of distinct experts, its union-of-experts curve from the
    measured t(1) (rising with T), and auto's prices, which hit the measured t(1), t(2), t(8)
    (its anchors)."""
    from experiments import moe_verify

    out = moe_verify.main(["--sizes", "1", "2", "3", "8", "--reps", "1", "--hidden", "32",
                           "--expert-ffn", "16", "--layers", "1", "--heads", "4",
                           "--vocab", "97", "--context", "8"])
    rows = {r["T"]: r for r in out["rows"]}
    assert sorted(rows) == [1, 2, 3, 8]
    assert rows[1]["layer0_distinct_experts"] == K
    assert K <= rows[3]["layer0_distinct_experts"] <= 3 * K
    assert all(r["grouped_ms"] > 0 and r["onehot_ms"] > 0 for r in out["rows"])
    assert [rows[T]["uniform_experts"] for T in (1, 2)] == [K, 3.5]
    assert rows[1]["union_ms"] == rows[1]["grouped_ms"]
    assert rows[1]["union_ms"] < rows[2]["union_ms"] < rows[3]["union_ms"] < rows[8]["union_ms"]
    for T in (1, 2, 8):
        assert rows[T]["auto_ms"] == pytest.approx(rows[T]["grouped_ms"], abs=1e-3)
    assert '"grouped_ms"' in capsys.readouterr().out


def test_speculative_sampling_keeps_an_moe_targets_distribution(tmp_path_factory):
    """Speculative sampling with a dense draft draws the first three tokens from the MoE
    target's distribution under transformers (chi-square), and not from another temperature's
    (vocabulary 8, so the three-token distribution is tabulated exactly)."""
    from test_families import SV, check_sampling

    d = tmp_path_factory.mktemp("moe_v8")
    tt = make_hf_model(d / "t", model_type="qwen3_moe", vocab=SV, hidden=32, heads=2,
                       kv_heads=1, inter=48, scale=0.15, seed=59,
                       **FAMILIES["qwen3_moe"])
    make_hf_model(d / "d", vocab=SV, layers=1, hidden=32, heads=2, kv_heads=1, inter=64,
                  scale=0.15, seed=60)
    check_sampling(oj.load_model(str(d / "t"), dtype="float32"),
                   oj.load_model(str(d / "d"), dtype="float32"), tt)
