"""GGUF loading (models/gguf.py): tiny random Llama/Qwen2 models written here as GGUF files with
the `gguf` package's GGUFWriter, the way llama.cpp's converter lays them out (q/k rows permuted
for "llama"), then loaded by `oj.load_model` and compared with the original weights and with
transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, an independent
reading of the layout). Bad files are refused with the file and the tensor or type named.
"""

import os
import struct

import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.models.gguf import dequantizable_types, permute_qk
from ouroboros_jax.models.params import leaves_of

from conftest import make_hf_model

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# GGUF names of HF tensors (as llama.cpp's converter names them)
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}

# every type the installed gguf package can both quantize and dequantize
QUANTIZABLE = [t for t in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                           T.TQ1_0, T.TQ2_0, T.MXFP4)
               if t.name in dequantizable_types()]
LOSSLESS = {T.F32}


def gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def write_gguf(path, torch_model, arch="llama", qtype=T.F32, drop=(), extra_keys=None,
               reshape=None, raw=None):
    """Writes torch_model as a GGUF file: 2-D weights in `qtype`, 1-D tensors in F32 (as
    llama.cpp keeps norms and biases), q/k rows permuted for arch "llama". drop: GGUF tensor
    names left out; extra_keys: {key: (kind, value)} added; reshape: {name: new numpy shape};
    raw: {name: (uint8 bytes array, GGMLQuantizationType)} written as given."""
    cfg = torch_model.config
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    p = arch + "."
    w.add_uint32(p + "block_count", cfg.num_hidden_layers)
    w.add_uint32(p + "context_length", cfg.max_position_embeddings)
    w.add_uint32(p + "embedding_length", cfg.hidden_size)
    w.add_uint32(p + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(p + "attention.head_count", H)
    w.add_uint32(p + "attention.head_count_kv", K)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(p + "rope.freq_base", 10000.0)
    w.add_uint32(p + "rope.dimension_count", cfg.hidden_size // H)
    w.add_uint32(p + "vocab_size", cfg.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, (kind, value) in (extra_keys or {}).items():
        getattr(w, "add_" + kind)(key, value)
    for hf, t in torch_model.state_dict().items():
        if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight"
                                                  and cfg.tie_word_embeddings):
            continue
        name = gguf_name(hf)
        if name in drop:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = permute_qk(a, H if "attn_q" in name else K)
        if reshape and name in reshape:
            a = a.reshape(reshape[name])
        if raw and name in raw:
            data, kind = raw[name]
            w.add_tensor(name, data, raw_dtype=kind)
        elif a.ndim == 1 or qtype == T.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == T.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A torch Llama whose every 2-D weight has 256-multiple rows (the K/TQ block size)."""
    d = tmp_path_factory.mktemp("gguf_llama_hf")
    return make_hf_model(d, vocab=97, hidden=256, layers=2, heads=4, kv_heads=2, inter=512,
                         seed=5, scale=0.3)


def _hf_tensors(model):
    """HF name -> numpy array of a loaded oj model, via the params table's own layout."""
    out = {}
    for leaf in leaves_of(model.config):
        if leaf.per_layer:
            arr = np.asarray(model.params["layers"][leaf.name])
            for i in range(model.config.num_layers):
                out[leaf.hf_name(i)] = leaf.to_hf(arr[i])
        else:
            out[leaf.hf_name()] = leaf.to_hf(np.asarray(model.params[leaf.name]))
    return out


def _transformers_gguf(path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def test_f32_gguf_equals_the_original_weights_and_greedy(tiny_llama, tmp_path):
    import torch

    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama)
    m = oj.load_model(path, dtype="float32")
    assert m.config.num_heads == 4 and m.config.num_kv_heads == 2 and m.config.head_dim == 64
    assert m.config.tie_word_embeddings is False and m.tokenizer is None
    ours = _hf_tensors(m)
    ref = {k: v.numpy() for k, v in tiny_llama.state_dict().items() if k in ours}
    assert set(ref) == set(ours)
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    prompt = [5, 17, 33, 2 + 40, 61, 7]
    out = oj.generate(m, [prompt], max_new_tokens=8, eos_token_id=-1)
    with torch.no_grad():
        want = tiny_llama.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                   min_new_tokens=8, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens[0] == want


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_every_quant_type_loads_as_transformers_reads_it(tiny_llama, tmp_path, qtype):
    path = write_gguf(tmp_path / f"tiny_{qtype.name}.gguf", tiny_llama, qtype=qtype)
    m = oj.load_model(path, dtype="float32")
    ours = _hf_tensors(m)
    theirs = {k: v.numpy() for k, v in _transformers_gguf(path).state_dict().items()}
    orig = {k: v.numpy() for k, v in tiny_llama.state_dict().items()}
    for k, v in ours.items():
        np.testing.assert_array_equal(v, theirs[k], err_msg=f"{qtype.name} {k}")
        # and the dequantized weight is the original's approximation, not a shuffled one
        if qtype not in LOSSLESS and v.ndim == 2 and qtype.name not in ("TQ1_0", "TQ2_0"):
            assert np.corrcoef(v.ravel(), orig[k].ravel())[0, 1] > 0.9, (qtype.name, k)


def test_bfloat16_dtype_casts(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=T.Q8_0)
    m = oj.load_model(path, dtype="bfloat16")
    assert str(m.params["embed"].dtype) == "bfloat16"


def test_qwen2_gguf_is_not_permuted_and_keeps_biases(tmp_path):
    d = tmp_path / "qwen_hf"
    tm = make_hf_model(d, model_type="qwen2", vocab=97, hidden=64, layers=2, heads=4,
                       kv_heads=2, inter=128, seed=6)
    path = write_gguf(tmp_path / "qwen.gguf", tm, arch="qwen2")
    m = oj.load_model(path, dtype="float32")
    assert m.config.model_type == "qwen2" and m.config.qkv_bias
    ours = _hf_tensors(m)
    for k, v in tm.state_dict().items():
        if k in ours:
            np.testing.assert_array_equal(ours[k], v.numpy(), err_msg=k)
    theirs = _transformers_gguf(path).state_dict()
    for k, v in ours.items():
        np.testing.assert_array_equal(v, theirs[k].numpy(), err_msg=k)


# ------------------------------------------------------------------ bad files
@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_small_hf")
    return make_hf_model(d, vocab=97, hidden=64, layers=2, heads=4, kv_heads=2, inter=128)


def test_nonexistent_gguf_path(tmp_path):
    p = str(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf.*does not exist"):
        oj.load_model(p)


def test_a_gguf_name_that_is_no_gguf(tmp_path):
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="fake.gguf: not a GGUF file"):
        oj.load_model(str(p))


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated_gguf(small_llama, tmp_path, keep):
    path = write_gguf(tmp_path / "whole.gguf", small_llama)
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        oj.load_model(str(cut))


def test_unsupported_architecture(small_llama, tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", small_llama, arch="gpt2")
    with pytest.raises(ValueError, match="gpt2.gguf: GGUF architecture 'gpt2' is not supported"):
        oj.load_model(path)


def test_unknown_tensor_type_id(small_llama, tmp_path):
    """A type id no GGML type has (patched into the tensor info of token_embd.weight)."""
    path = write_gguf(tmp_path / "ok.gguf", small_llama)
    data = bytearray(open(path, "rb").read())
    name = b"token_embd.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"badtype\.gguf.*250"):
        oj.load_model(str(bad))


def test_a_type_gguf_cannot_dequantize_is_named(small_llama, tmp_path):
    # Q8_K (llama.cpp's intermediate type): 292 bytes per 256 values, no dequantizer in gguf
    assert "Q8_K" not in dequantizable_types()
    rows = np.zeros((small_llama.config.vocab_size, 292), np.uint8)
    path = write_gguf(tmp_path / "q8k.gguf", small_llama,
                      raw={"token_embd.weight": (rows, T.Q8_K)})
    with pytest.raises(ValueError, match=r"q8k\.gguf: tensor token_embd\.weight has quantization "
                                         r"type Q8_K, which the gguf package cannot dequantize"):
        oj.load_model(path)


def test_integer_tensor_refused(small_llama, tmp_path):
    ints = np.zeros((small_llama.config.vocab_size, small_llama.config.hidden_size), np.int32)
    path = write_gguf(tmp_path / "int.gguf", small_llama,
                      raw={"token_embd.weight": (ints, None)})
    with pytest.raises(ValueError, match=r"int\.gguf: tensor token_embd\.weight has type I32"):
        oj.load_model(path)


def test_missing_tensor_named(small_llama, tmp_path):
    path = write_gguf(tmp_path / "miss.gguf", small_llama, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"miss\.gguf: GGUF file lacks tensor\(s\) "
                                         r"\['blk\.1\.ffn_up\.weight'\]"):
        oj.load_model(path)


def test_misshapen_tensor_named(small_llama, tmp_path):
    E = small_llama.config.hidden_size
    path = write_gguf(tmp_path / "shape.gguf", small_llama,
                      reshape={"blk.0.ffn_gate.weight": (E, -1)})
    with pytest.raises(ValueError, match=r"shape\.gguf: tensor blk\.0\.ffn_gate\.weight has shape"):
        oj.load_model(path)


def test_unknown_architecture_key_named(small_llama, tmp_path):
    # shared experts (DeepSeek's key): no family reads them ("llama.expert_count" alone makes
    # the file a Mixtral's, tests/test_moe.py)
    path = write_gguf(tmp_path / "moe.gguf", small_llama,
                      extra_keys={"llama.expert_shared_count": ("uint32", 2)})
    with pytest.raises(ValueError, match=r"moe\.gguf: unsupported GGUF key\(s\) "
                                         r"\['llama\.expert_shared_count'\]"):
        oj.load_model(path)
    # an expert count alone: read as a Mixtral, which needs its experts per token
    path = write_gguf(tmp_path / "moe2.gguf", small_llama,
                      extra_keys={"llama.expert_count": ("uint32", 8)})
    with pytest.raises(ValueError, match="lacks 'llama.expert_used_count'"):
        oj.load_model(path)


def test_unsupported_rope_scaling_named(small_llama, tmp_path):
    path = write_gguf(tmp_path / "yarn.gguf", small_llama,
                      extra_keys={"llama.rope.scaling.type": ("string", "yarn")})
    with pytest.raises(ValueError, match="yarn.gguf: GGUF rope.scaling.type 'yarn'"):
        oj.load_model(path)


# ------------------------------------------------------------------ checkpoints_tools.gguf_to_hf
def test_gguf_to_hf_writes_a_directory_transformers_and_we_load(tiny_llama, tmp_path):
    import torch
    import transformers

    from checkpoints_tools.gguf_to_hf import main

    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=T.Q8_0)
    out = tmp_path / "hf_out"
    main([path, str(out)])
    from_gguf = _hf_tensors(oj.load_model(path, dtype="float32"))
    from_dir = _hf_tensors(oj.load_model(str(out), dtype="float32"))
    tm = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for k, v in from_gguf.items():
        np.testing.assert_array_equal(from_dir[k], v, err_msg=k)
        np.testing.assert_array_equal(tm.state_dict()[k].numpy(), v, err_msg=k)


def test_gguf_to_hf_refuses_and_writes_nothing(small_llama, tmp_path):
    from checkpoints_tools.gguf_to_hf import main

    path = write_gguf(tmp_path / "gpt2.gguf", small_llama, arch="gpt2")
    out = tmp_path / "never"
    with pytest.raises(SystemExit, match="architecture 'gpt2' is not supported"):
        main([path, str(out)])
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".gguf_to_hf")]


def test_end_of_turn_ids_of_the_metadata_stop_generation(small_llama, tmp_path):
    from ouroboros_jax.generate import default_eos_ids

    path = write_gguf(tmp_path / "eot.gguf", small_llama,
                      extra_keys={"tokenizer.ggml.eot_token_id": ("uint32", 7)})
    m = oj.load_model(path)
    assert m.config.eos_token_id == 2 and default_eos_ids(m) == (2, 7)
    plain = oj.load_model(write_gguf(tmp_path / "plain.gguf", small_llama))
    assert default_eos_ids(plain) == 2


# ------------------------------------------------------------------ the fast read path (gguf_read)
def _all_dequantizable():
    from gguf import quants

    return sorted(quants._type_traits, key=lambda t: t.name)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # random scales: NaN/inf
@pytest.mark.parametrize("qtype", _all_dequantizable(), ids=lambda t: t.name)
def test_chunked_dequantization_is_bit_identical_to_gguf_dequantize(qtype, monkeypatch):
    """Every type the gguf package dequantizes, on random bytes (any bit pattern is a valid
    block): `gguf_read.fill_tensor`, cut into uneven chunks and pieces and transposed on the way,
    gives the bits `gguf.dequantize` gives for the whole tensor."""
    from gguf import GGML_QUANT_SIZES, ReaderTensor, dequantize

    from ouroboros_jax.models import gguf_read

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 13, 3 * block
    data = np.random.default_rng(qtype.value).integers(0, 256, (rows, 3 * size), np.uint8)
    t = ReaderTensor(name="w", tensor_type=qtype, shape=np.array([cols, rows], np.uint64),
                     n_elements=rows * cols, n_bytes=data.nbytes, data_offset=0, data=data,
                     field=None)
    want = np.asarray(dequantize(data, qtype), np.float32).reshape(rows, cols)
    monkeypatch.setattr(gguf_read, "CHUNK_ELEMS", 2 * cols)  # 2-row chunks, a 1-row tail
    plain = np.full((rows, cols), np.nan, np.float32)
    transposed = np.full((cols, rows), np.nan, np.float32)
    for piece in gguf_read.pieces(t, elems=5 * cols):  # 5-row pieces
        gguf_read.fill_tensor(t, plain, False, rows=piece)
        gguf_read.fill_tensor(t, transposed, True, rows=piece)
    np.testing.assert_array_equal(plain.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(transposed.T.view(np.uint32), want.view(np.uint32))


# K-quants and others the gguf package cannot quantize, written as random blocks: the files llama.cpp
# ships (Qwen2.5's Q4_K/Q6_K/Q5_0/Q8_0 mix) exercised in the suite
_RAW_MIX = {"attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.Q5_0, "attn_output": T.Q8_0,
            "ffn_gate": T.Q4_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K, "token_embd": T.Q4_1,
            "output": T.Q3_K}


def _raw_blocks(torch_model, arch, seed=0):
    """{GGUF name: (random uint8 blocks, type)} for every 2-D weight, per `_RAW_MIX`."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    out = {}
    for hf, t in torch_model.state_dict().items():
        if t.dim() != 2 or (hf == "lm_head.weight" and torch_model.config.tie_word_embeddings):
            continue
        name = gguf_name(hf)
        kind = _RAW_MIX[name.split(".")[-2]]
        block, size = GGML_QUANT_SIZES[kind]
        rows, cols = t.shape
        out[name] = (rng.integers(0, 256, (rows, cols // block * size), np.uint8), kind)
    return out


def _reference_params(path, config, dtype):
    """What the loader produced before gguf_read: `gguf.GGUFReader` + `gguf.dequantize` whole
    tensors, llama q/k unpermuted, `Leaf.from_hf`, cast; HF name -> our (slice) array."""
    import jax.numpy as jnp
    from gguf import GGUFReader, dequantize

    from ouroboros_jax.models.gguf import unpermute_qk

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = {}
    for leaf in leaves_of(config):
        for i in range(config.num_layers) if leaf.per_layer else (None,):
            t = tensors[gguf_name(leaf.hf_name(i))]
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
            if config.model_type == "llama" and leaf.name in ("wq", "wk"):
                w = unpermute_qk(w, config.num_heads if leaf.name == "wq" else config.num_kv_heads)
            out[leaf.hf_name(i)] = leaf.from_hf(w, config).astype(jnp.dtype(dtype))
    return out


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                        ("qwen2", "float32")])
def test_quantized_mix_loads_bit_identical_to_whole_tensor_dequantization(
        tiny_llama, tmp_path, monkeypatch, arch, dtype):
    """A file of random K-quant/Q5_0/Q8_0/Q4_1 blocks loads, through chunks and pieces smaller
    than a tensor (and, for llama's permuted q/k, whole heads per chunk), to exactly the bits of
    whole-tensor `gguf.dequantize` + layout + cast."""
    from ouroboros_jax.models import gguf_read

    if arch == "qwen2":
        model = make_hf_model(tmp_path / "qwen_hf", model_type="qwen2", vocab=97, hidden=256,
                              layers=2, heads=4, kv_heads=2, inter=512, seed=7)
    else:
        model = tiny_llama
    path = write_gguf(tmp_path / "mix.gguf", model, arch=arch, raw=_raw_blocks(model, arch))
    monkeypatch.setattr(gguf_read, "CHUNK_ELEMS", 3 * 256)  # 3 rows of 256 (64 for q/k heads)
    monkeypatch.setattr(gguf_read, "PIECE_ELEMS", 7 * 256)
    m = oj.load_model(path, dtype=dtype)
    ref = _reference_params(path, m.config, dtype)
    for leaf in leaves_of(m.config):
        arr = np.asarray(m.params["layers"][leaf.name] if leaf.per_layer else m.params[leaf.name])
        assert arr.dtype == np.dtype(ref[leaf.hf_name(0 if leaf.per_layer else None)].dtype)
        for i in range(m.config.num_layers) if leaf.per_layer else (None,):
            got = arr[i] if leaf.per_layer else arr
            want = np.ascontiguousarray(ref[leaf.hf_name(i)])
            np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                          want.view(np.uint8), err_msg=leaf.hf_name(i))


def test_reader_metadata_equals_gguf_readers(tiny_llama, tmp_path):
    """`gguf_read.GGUFFile` reads every key (scalars, strings, string and number arrays) and every
    tensor's name, type, shape and bytes as `gguf.GGUFReader` does."""
    from gguf import GGUFReader

    from ouroboros_jax.models.gguf import open_gguf

    path = write_gguf(tmp_path / "meta.gguf", tiny_llama, qtype=T.Q8_0, extra_keys={
        "tokenizer.ggml.tokens": ("array", ["a", "b c", "ünï", ""]),
        "tokenizer.ggml.scores": ("array", [0.5, -1.25, 3.0, 0.0]),
        "tokenizer.ggml.model": ("string", "gpt2"),
        "general.flag": ("bool", True),
        "general.big": ("uint64", 2 ** 40 + 3),
    })
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for k in ours.fields:
        a, b = ours.get_field(k), theirs.get_field(k)
        assert a.contents() == b.contents() and a.types == b.types, k
        assert len(a.data) == len(b.data), k
    assert ours.get_field("tokenizer.ggml.tokens").contents()[1] == "b c"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.n_bytes == b.n_bytes, a.name
        assert a.shape.tolist() == b.shape.tolist() and a.data_offset == b.data_offset, a.name
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)


# the tokenizer built from a file's metadata: tests/test_gguf_tokenizer.py


# ------------------------------------------------------------ the C++ dequantizing kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_kernel_dequantizes_the_bits_gguf_does(kind):
    """`gguf_dequant` (rows, and rows written transposed) against gguf's numpy kernel on random
    blocks: every byte random, scales included (subnormal, inf and nan halves among them)."""
    import gguf
    from gguf import quants

    from ouroboros_jax.models import gguf_dequant

    qtype = gguf.GGMLQuantizationType[kind]
    assert gguf_dequant.supports(int(qtype))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, per_row = 37, 3
    blocks = np.random.default_rng(int(qtype)).integers(0, 256, (rows, per_row * block_bytes),
                                                        dtype=np.uint8)
    q = quants._type_traits[qtype]
    with np.errstate(all="ignore"):
        want = q.dequantize_blocks(blocks.reshape(-1, block_bytes)).reshape(rows, -1)
    got = gguf_dequant.dequantize_rows(blocks, int(qtype), per_row * block_values)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    out = np.full((per_row * block_values, rows + 5), 7.0, np.float32)
    assert gguf_dequant.dequantize_into(blocks, int(qtype), per_row * block_values,
                                        out[:, 2:2 + rows], transposed=True)
    np.testing.assert_array_equal(out[:, 2:2 + rows].view(np.uint32), want.T.view(np.uint32))
    assert (out[:, :2] == 7).all() and (out[:, 2 + rows:] == 7).all()  # nothing outside


def test_kernel_widens_every_half_exactly():
    """Q8_0 blocks whose codes are all 1 give their scale: each of the 65,536 halves, as
    gguf's kernel gives it (1 x a signalling nan is a quiet one there too) and, but for the
    nans, the half's own value."""
    import gguf
    from gguf import quants

    from ouroboros_jax.models import gguf_dequant

    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    blocks = np.concatenate([halves.view(np.uint8).reshape(-1, 2),
                             np.ones((1 << 16, 32), np.uint8)], axis=1)
    qtype = gguf.GGMLQuantizationType.Q8_0
    got = gguf_dequant.dequantize_rows(blocks, int(qtype), 32)
    with np.errstate(all="ignore"):
        want = quants._type_traits[qtype].dequantize_blocks(blocks)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    exact = halves.view(np.float16).astype(np.float32)
    real = ~np.isnan(exact)
    assert real.sum() == (1 << 16) - 2046
    np.testing.assert_array_equal(got[real, 0].view(np.uint32), exact[real].view(np.uint32))


def test_loads_with_and_without_the_kernel_are_the_same_bits(smollm2_gguf_path, monkeypatch):
    """SmolLM2's Q4_1 / Q8_0 GGUF through the kernel's one pass and through numpy's chunks."""
    import jax

    from ouroboros_jax.models import gguf_dequant

    fast = oj.load_model(smollm2_gguf_path, dtype="float32")
    monkeypatch.setattr(gguf_dequant, "supports", lambda tensor_type: False)
    slow = oj.load_model(smollm2_gguf_path, dtype="float32")
    for a, b in zip(jax.tree.leaves(fast.params), jax.tree.leaves(slow.params)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
