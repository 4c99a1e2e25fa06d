"""Weights kept quantized (models/quant.py, models/gguf_quant.py): GGUF blocks kept as codes and
scales that dequantize to `gguf`'s own bits; the quantized forward against a float forward of
the same codes dequantized; every method's greedy tokens on int8 and int4 weights (target and
draft) equal vanilla's on the same weights, and the serving engine's equal generate's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.models import layout, quant
from ouroboros_jax.models.gguf_quant import KEPT, decode_tensor
from ouroboros_jax.models.llama import causal_mask, forward
from ouroboros_jax.models.model import Model
from ouroboros_jax.models.params import leaves_of
from ouroboros_jax.serving import Engine, RequestParams

from conftest import REPEAT, make_hf_model

# The quantized forward accumulates in float32 like the float one; only the order of the sums
# differs (per group, then across groups), so its logits may differ from the dequantized
# reference's by float32 rounding, carried through two layers of the tiny model's large random
# weights: at most this fraction of the largest logit (seen: 1.1e-5 of it for int4 in groups
# of 16; a wrong scale, group or offset moves logits by percents).
LOGIT_RTOL = 1e-4


def _finite_blocks(kind: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random blocks of `kind` (any bit pattern is a valid block) whose f16 d (and Q4_K's dmin)
    are finite normal values: NaN payloads are no test of the codes."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    _, size = GGML_QUANT_SIZES[T[kind]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * blocks_per_row, size), np.uint8)
    d_at = {"Q8_0": [0], "Q5_0": [0], "Q4_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[kind]
    for at in d_at:
        d = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16)
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("kind", sorted(KEPT))
def test_gguf_blocks_keep_their_codes_and_dequantize_bit_for_bit(kind):
    """Each kept type: the codes and scales read from the blocks are gguf's own (Q8_0's int8
    bytes and f16 d; Q4_K's nibbles, d * sc and dmin * m from gguf's own unpacking), and the
    QuantArray made of them dequantizes to `gguf.quants.dequantize`'s float32 bits."""
    from gguf import GGMLQuantizationType as T
    from gguf import dequantize, quants

    rows, per_row = 6, 3
    data = _finite_blocks(kind, rows, per_row, seed=len(kind))
    want = np.asarray(dequantize(data, T[kind]), np.float32)  # [rows, cols]
    codes, scale, offset = decode_tensor(data, kind)  # [rows, ng, G], [rows, ng]
    bits, G = KEPT[kind]
    assert codes.shape == (rows, want.shape[1] // G, G) and scale.dtype == np.float32
    blocks = data.reshape(rows * per_row, -1)
    if kind == "Q8_0":
        np.testing.assert_array_equal(codes.reshape(-1, 32), blocks[:, 2:].view(np.int8))
        np.testing.assert_array_equal(scale.reshape(-1),
                                      blocks[:, :2].copy().view(np.float16)[:, 0])
    if kind == "Q4_K":
        sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(scale.reshape(-1, 8), d * sc.astype(np.float32))
        np.testing.assert_array_equal(offset.reshape(-1, 8), dmin * m.astype(np.float32))
        assert codes.min() >= 0 and codes.max() <= 15
    # as a weight [in = cols, out = rows]: groups along the input side
    q = quant.QuantArray(jnp.asarray(np.moveaxis(codes, 0, -1)),
                         jnp.asarray(np.moveaxis(scale, 0, -1)),
                         None if offset is None else jnp.asarray(np.moveaxis(offset, 0, -1)),
                         (want.shape[1],), 1, bits, jnp.float32)
    got = np.asarray(quant.dequantize(q)).T
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _write_gguf(path, torch_model, kinds: dict):
    """A llama GGUF of torch_model whose linear weights are random finite blocks of the type
    `kinds` gives for their GGUF name's tensor kind (attn_q, ffn_down, ...; a tuple: one type
    per layer); the rest F32."""
    from test_gguf import gguf_name, write_gguf

    raw = {}
    for hf, t in torch_model.state_dict().items():
        if t.dim() != 2:
            continue
        name = gguf_name(hf)
        kind = kinds.get(name.split(".")[-2])
        if isinstance(kind, tuple):  # one type per layer (llama.cpp's mixes)
            kind = kind[int(name.split(".")[1])]
        if kind is None:
            continue
        from gguf import GGML_QUANT_SIZES
        from gguf import GGMLQuantizationType as T

        block, _ = GGML_QUANT_SIZES[T[kind]]
        rows, cols = t.shape
        raw[name] = (_finite_blocks(kind, rows, cols // block, seed=len(raw)), T[kind])
    return write_gguf(path, torch_model, raw=raw)


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant_gguf")
    return make_hf_model(d / "hf", vocab=97, hidden=256, layers=2, heads=4, kv_heads=2,
                         inter=512, seed=5, scale=0.3)


def test_gguf_load_keeps_fitting_blocks_and_requantizes_the_rest(gguf_llama, tmp_path, capsys):
    """load_model(gguf, quantize=): Q4_K, Q8_0 and Q6_K leaves are kept as their blocks where
    the width fits (int8: all three; int4: Q4_K only), bit for bit the float load's values
    (llama's permuted q/k rows included); the others (F32 here) are quantized by us."""
    kinds = {"attn_q": "Q4_K", "attn_k": "Q8_0", "ffn_down": "Q6_K", "ffn_up": "Q4_0"}
    path = _write_gguf(tmp_path / "mix.gguf", gguf_llama, kinds)
    ref = oj.load_model(path, dtype="float32")
    for scheme, kept in (("int8", {"wq", "wk", "w_down", "w_up"}), ("int4", {"wq", "w_up"})):
        m = oj.load_model(path, dtype="float32", quantize=scheme)
        for leaf in leaves_of(m.config):
            w = m.params["layers"][leaf.name] if leaf.per_layer else m.params[leaf.name]
            if not quant.quantizable(leaf):
                assert not quant.is_quantized(w), leaf.name
                continue
            assert quant.is_quantized(w) and w.shape == leaf.shape(m.config), leaf.name
            if leaf.name in kept:
                want = np.asarray(ref.params["layers"][leaf.name])
                got = np.asarray(quant.dequantize(w))
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{scheme} {leaf.name}")
            else:
                assert w.bits == quant.BITS[scheme], leaf.name
    assert "runs slower" in capsys.readouterr().err  # the CPU note, once


def test_gguf_load_keeps_a_leaf_mixing_blocks_of_one_form(gguf_llama, tmp_path):
    """Q5_0 and Q8_0 (int8 codes, a scale per 32) across a leaf's layers are kept together, bit
    for bit, as llama.cpp's Q4_0 file of Qwen2.5 0.5B mixes them in attn_v; Q4_K beside Q6_K
    (offsets and groups of 32 against none and 16) is requantized."""
    kinds = {"attn_v": ("Q5_0", "Q8_0"), "ffn_gate": "Q5_0", "ffn_down": ("Q4_K", "Q6_K")}
    path = _write_gguf(tmp_path / "mixed.gguf", gguf_llama, kinds)
    ref = oj.load_model(path, dtype="float32")
    m = oj.load_model(path, dtype="float32", quantize="int8")
    for name in ("wv", "w_gate"):
        w = m.params["layers"][name]
        assert w.codes.dtype == jnp.int8 and w.group_size == 32 and w.offset is None, name
        got = np.asarray(quant.dequantize(w))
        want = np.asarray(ref.params["layers"][name])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)
    down = m.params["layers"]["w_down"]
    assert down.bits == 8 and down.group_size == m.config.intermediate_size  # per channel


def test_quantize_names_the_parameter(tiny_target):
    with pytest.raises(ValueError, match="quantize"):
        oj.load_model(tiny_target.path, quantize="int3")


def _quantized(model, scheme, group_size=None):
    return Model(config=model.config, tokenizer=model.tokenizer, path=model.path,
                 generation_config=model.generation_config,
                 params=quant.quantize_params(model.params, model.config, scheme, group_size))


@pytest.fixture(scope="module")
def quantized_pairs(tiny_pair):
    """scheme -> (target, draft) quantized: int8 per channel, int4 in groups of 16."""
    target, draft, _ = tiny_pair
    return {"int8": (_quantized(target, "int8"), _quantized(draft, "int8")),
            "int4": (_quantized(target, "int4", 16), _quantized(draft, "int4", 16))}


def _dequantized(model):
    params = jax.tree.map(quant.dequantize, model.params, is_leaf=quant.is_quantized)
    return Model(config=model.config, params=params)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_logits_match_a_dequantized_reference(quantized_pairs, random_prompts, scheme):
    """The quantized forward (stacked and packed) against the float forward of the same codes
    dequantized, within LOGIT_RTOL of the largest logit; the weights really are integers of
    the scheme's width and every linear leaf is quantized."""
    q = quantized_pairs[scheme][0]
    ref = _dequantized(q)
    wq = q.params["layers"]["wq"]
    lim = 2 ** (quant.BITS[scheme] - 1)
    assert wq.codes.dtype == (jnp.int8 if scheme == "int8" else jnp.int4)
    assert -lim <= int(jnp.min(wq.codes.astype(jnp.int32))) and \
        int(jnp.max(wq.codes.astype(jnp.int32))) < lim
    assert wq.group_size == (64 if scheme == "int8" else 16)
    prompt = random_prompts[0][:12]
    T = len(prompt)
    args = (jnp.asarray([prompt]), jnp.arange(T)[None], causal_mask(1, T))
    want = np.asarray(forward(ref.params, q.config, *args)[0])
    for params in (q.params, layout.pack(q.params, q.config)):
        got = np.asarray(forward(params, q.config, *args)[0])
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_RTOL * np.abs(want).max())


def test_linear_with_offsets_matches_its_dequantized_weight():
    """A Q4_K-like weight (uint4 codes, per-group scale and offset), a bf16 activation: the
    grouped product with the offsets' term equals x @ dequantize(w) in float32."""
    rng = np.random.default_rng(0)
    I, O, G = 64, 24, 32
    w = quant.QuantArray(jnp.asarray(rng.integers(0, 16, (I // G, G, 3, 8)).astype(jnp.uint4)),
                         jnp.asarray(rng.random((I // G, 3, 8), np.float32) * 0.1),
                         jnp.asarray(rng.random((I // G, 3, 8), np.float32) * 0.5),
                         (I,), 2, 4, jnp.bfloat16)
    assert w.shape == (I, 3, 8) and w.reshape(I, O).shape == (I, O)
    x = jnp.asarray(rng.standard_normal((2, 5, I)), jnp.bfloat16)
    got = quant.linear(x, w, out_dtype=jnp.float32)
    w32 = quant.QuantArray(w.codes, w.scale, w.offset, (I,), 2, 4, jnp.float32)  # no bf16 cast
    want = jnp.einsum("bti,io->bto", x.astype(jnp.float32),
                      quant.dequantize(w32).reshape(I, O)).reshape(2, 5, 3, 8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * float(jnp.abs(want).max()))


CALLS = [("speculative", oj.SpeculativeConfig(gamma=3)),
         ("lookahead", oj.LookaheadConfig(window=3, ngram=3, guesses=3)),
         ("ouroboros", oj.OuroborosConfig(gamma=3, window=2, ngram=3, guesses=2, suffixes=2)),
         ("prompt_lookup", oj.PromptLookupConfig(candidates=2, length=3))]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_method_on_quantized_weights_equals_vanilla(quantized_pairs, scheme):
    """Greedy, int8 and int4 weights, the draft quantized too: every method's tokens are
    vanilla's on the same weights, token for token."""
    target, draft = quantized_pairs[scheme]
    prompts = REPEAT[:4]
    kw = dict(max_new_tokens=16, eos_token_id=-1)
    want = oj.generate(target, prompts, method="vanilla", config=None, **kw).tokens
    assert set(METHODS) == {"vanilla"} | {m for m, _ in CALLS}  # a new method joins this list
    for method, cfg in CALLS:
        got = oj.generate(target, prompts, method=method, config=cfg,
                          draft=draft if METHODS[method].needs_draft else None, **kw).tokens
        assert got == want, (scheme, method)


def test_the_engine_serves_quantized_weights(quantized_pairs):
    """The serving engine on int8 target and draft: each request's tokens are generate's."""
    target, draft = quantized_pairs["int8"]
    cfg = oj.SpeculativeConfig(gamma=3)
    eng = Engine(target, draft, method="speculative", config=cfg, slots=2, max_cache_len=64,
                 rounds_per_step=3)
    hs = [eng.submit(p, RequestParams(max_tokens=10)) for p in REPEAT[:3]]
    while eng.step():
        pass
    for p, h in zip(REPEAT[:3], hs):
        want = oj.generate(target, [p], draft=draft, method="speculative", config=cfg,
                           max_new_tokens=10).tokens[0]
        assert h.result(timeout=0).token_ids == want


def test_memory_plan_counts_codes_scales_and_float_leaves():
    """The planner's int8 / int4 bytes for Llama-3.1-70B, against a count from the leaf table:
    the embedding and norms in bf16, each linear weight's codes (1 or 1/2 byte a value) and its
    f32 scales (one per output channel and group of the input side)."""
    from ouroboros_jax.models.presets import PRESETS
    from ouroboros_jax.sharding import memory_plan

    c = PRESETS["llama-3.1-70b"]
    for scheme, code_bytes in (("int8", 1.0), ("int4", 0.5)):
        want = 0
        for leaf in leaves_of(c):
            n = int(np.prod(leaf.shape(c)))
            if not quant.quantizable(leaf):
                want += 2 * n
                continue
            ins = int(np.prod(leaf.slice_shape(c)[:leaf.hf_in_dims]))
            G = quant.group_for(ins, quant.BITS[scheme])
            want += int(n * code_bytes) + 4 * (n // G)
        got = memory_plan(c, 1, 1, 1, 16, "bfloat16", quantize=scheme)["params_total_bytes"]
        assert got == want, scheme
        abstract = jax.eval_shape(lambda: quant.quantize_params(
            oj.models.llama.init_params(c, jax.random.key(0), jnp.bfloat16), c, scheme))
        assert quant.params_nbytes(abstract) == want  # what the device script counts


def test_memory_quantize_prints_the_70b_plan(capsys):
    """`ouroboros-jax memory --quantize int8 --quantize int4`: Llama-3.1-70B int8 with the 1B
    draft fits one 141 GB device and two 80 GB ones; bf16 fits no single device."""
    from ouroboros_jax import cli

    cli.main(["memory", "--quantize", "int8", "--quantize", "int4"])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith(("llama-3.1-70b + llama-3.2-1b", "yi-34b + llama-3.2-1b")):
            f = line.split()
            rows[(f[0], f[3], int(f[4]))] = (float(f[5]), f[7], f[9])
    assert {k[1] for k in rows} == {"bfloat16", "int8", "int4"}
    assert {k[2] for k in rows} == {1, 2, 4, 8} and {k[0] for k in rows} == {"llama-3.1-70b",
                                                                            "yi-34b"}
    gb, on80, on141 = rows[("llama-3.1-70b", "int8", 1)]
    assert on141 == "fits" and 70 < gb < 80  # (on 80 GB: under 6 GB left for the rest)
    assert rows[("llama-3.1-70b", "int8", 2)][1] == "fits"
    assert rows[("llama-3.1-70b", "bfloat16", 1)][1:] == ("no", "no")
    assert rows[("llama-3.1-70b", "int4", 1)][0] < rows[("llama-3.1-70b", "int8", 1)][0] / 1.7


def test_quantized_experts_match_a_dequantized_reference(tmp_path):
    """A mixture of experts (Qwen3-MoE) on int8 / int4 experts: the routed experts' codes
    gathered then dequantized (a decoding step: fewer rows than experts) and all experts (a
    prefill) give the dequantized reference's logits; the router stays float."""
    make_hf_model(tmp_path, model_type="qwen3_moe", vocab=97, hidden=32, heads=4, kv_heads=2,
                  inter=48, seed=57, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True)
    m = oj.load_model(str(tmp_path), dtype="float32")
    for scheme in ("int8", "int4"):
        q = _quantized(m, scheme, 16)
        assert quant.is_quantized(q.params["layers"]["we_down"])
        assert not quant.is_quantized(q.params["layers"]["router"])
        ref = _dequantized(q)
        for T in (1, 12):
            args = (jnp.arange(3, 3 + T)[None], jnp.arange(T)[None], causal_mask(1, T))
            want = np.asarray(forward(ref.params, q.config, *args)[0])
            got = np.asarray(forward(q.params, q.config, *args)[0])
            np.testing.assert_allclose(got, want, rtol=0,
                                       atol=LOGIT_RTOL * np.abs(want).max())


def test_a_sharded_quantized_model_gives_the_same_tokens(tmp_path, random_prompts):
    """int8 and int4 weights placed on 1x8 and 2x4 meshes (codes split as the float weights,
    `sharding.param_specs_of`): vanilla's greedy tokens are the unsharded model's."""
    from ouroboros_jax.sharding import make_mesh

    make_hf_model(tmp_path, heads=8, kv_heads=4, hidden=64)
    m = oj.load_model(str(tmp_path))
    prompts = random_prompts[:8]
    for scheme in ("int8", "int4"):
        q = _quantized(m, scheme, 16)
        ref = oj.generate(q, prompts, max_new_tokens=12).tokens
        for data, model in ((1, 8), (2, 4)):
            got = oj.generate(q, prompts, max_new_tokens=12, mesh=make_mesh(data, model)).tokens
            assert got == ref, (scheme, data, model)


def test_the_dequantize_first_product_gives_the_same_numbers():
    """`quant.set_matmul("dequantize")`, the device script's candidate product: the same
    products as the grouped one within float32 rounding; a bad mode is named."""
    rng = np.random.default_rng(1)
    w = quant.quantize(jnp.asarray(rng.standard_normal((64, 4, 8)), jnp.float32), 1, 4,
                       group_size=16)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    grouped = quant.linear(x, w)
    try:
        quant.set_matmul("dequantize")
        first = quant.linear(x, w)
    finally:
        quant.set_matmul("grouped")
    assert first.shape == grouped.shape == (3, 4, 8)
    np.testing.assert_allclose(np.asarray(first), np.asarray(grouped), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="mode must be one of"):
        quant.set_matmul("fast")
