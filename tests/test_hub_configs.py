"""Hub-style config.json: the real texts of public checkpoints (tests/data/hub_configs, see its
PROVENANCE.md) parse into the config they describe; the numerics-neutral fields they carry
are accepted; every field that would change the numerics and is not implemented is refused by
name; and a directory with such a config (SmolLM2's, as published) loads and runs."""

import glob
import json
import os

import pytest

import ouroboros_jax as oj
from ouroboros_jax.models.config import NUMERICS_NEUTRAL_FIELDS, ModelConfig

from conftest import copy_dir, edit_config

DATA = os.path.join(os.path.dirname(__file__), "data", "hub_configs")
FILES = sorted(glob.glob(os.path.join(DATA, "*.json")))


def _load(name):
    with open(os.path.join(DATA, name + ".json")) as f:
        return json.load(f)


def test_the_collection_is_there():
    names = {os.path.basename(f)[:-5] for f in FILES}
    for want in ("meta-llama--Llama-2-7b-hf", "meta-llama--Meta-Llama-3-8B",
                 "meta-llama--Llama-3.1-8B", "meta-llama--Llama-3.2-1B-Instruct",
                 "codellama--CodeLlama-7b-hf", "mistralai--Mistral-7B-v0.1",
                 "mistralai--Mistral-7B-v0.3", "Qwen--Qwen2-7B-Instruct", "Qwen--Qwen2.5-7B",
                 "Qwen--Qwen2.5-Coder-0.5B-Instruct", "01-ai--Yi-6B",
                 "deepseek-ai--deepseek-coder-1.3b-instruct",
                 "HuggingFaceTB--SmolLM2-135M-Instruct"):
        assert want in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.basename(p)[:-5])
def test_every_public_config_parses(path):
    with open(path) as f:
        d = json.load(f)
    c = ModelConfig.from_hf_dict(d, source=path)
    assert c.vocab_size == d["vocab_size"] and c.num_layers == d["num_hidden_layers"]
    assert c.num_kv_heads == d.get("num_key_value_heads", d["num_attention_heads"])
    assert c.head_dim == d.get("head_dim", d["hidden_size"] // d["num_attention_heads"])
    assert c.qkv_bias == (d["model_type"] == "qwen2")


# what each checkpoint's text says, read off the files by hand
EXPECTED = {
    "meta-llama--Llama-2-7b-hf": dict(num_heads=32, num_kv_heads=32, rope_theta=10000.0,
                                      rms_norm_eps=1e-5, rope_scaling=None),
    "codellama--CodeLlama-7b-hf": dict(vocab_size=32016, rope_theta=1e6,
                                       max_position_embeddings=16384),
    "meta-llama--Meta-Llama-3-8B": dict(num_kv_heads=8, rope_theta=5e5, eos_token_id=128001),
    "meta-llama--Llama-3.1-8B-Instruct": dict(
        rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), eos_token_id=(128001, 128008, 128009)),
    "meta-llama--Llama-3.2-1B-Instruct": dict(head_dim=64, tie_word_embeddings=True,
                                              rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192)),
    "mistralai--Mistral-7B-v0.1": dict(model_type="mistral", sliding_window=4096),
    "mistralai--Mistral-7B-v0.3": dict(model_type="mistral", sliding_window=None,
                                       vocab_size=32768, rope_theta=1e6),
    "Qwen--Qwen2-7B-Instruct": dict(model_type="qwen2", qkv_bias=True, num_kv_heads=4,
                                    sliding_window=None, rms_norm_eps=1e-6),
    "Qwen--Qwen2.5-3B": dict(tie_word_embeddings=True, num_kv_heads=2),
    "deepseek-ai--deepseek-coder-1.3b-instruct": dict(rope_scaling=("linear", 4.0),
                                                      rope_theta=100000.0, pad_token_id=32014),
    "01-ai--Yi-6B": dict(rope_theta=5e6, num_kv_heads=4, vocab_size=64000),
    "HuggingFaceTB--SmolLM2-135M-Instruct": dict(num_heads=9, num_kv_heads=3, head_dim=64,
                                                 tie_word_embeddings=True, eos_token_id=2),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_values_as_published(name):
    c = ModelConfig.from_hf_dict(_load(name), source=name)
    for field, want in EXPECTED[name].items():
        assert getattr(c, field) == want, (name, field)


def test_the_neutral_fields_are_documented_in_the_docs():
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "real-models.md")).read()
    section = page[page.index("## Hugging Face directories"):page.index("## GGUF files")]
    missing = [f for f in NUMERICS_NEUTRAL_FIELDS if f"`{f}`" not in section]
    assert not missing
    for f in ("is_llama_config", "rope_interleaved", "transformers.js_config", "unk_token_id"):
        assert f in NUMERICS_NEUTRAL_FIELDS  # the fields the published SmolLM2 texts carry


BASE = "HuggingFaceTB--SmolLM2-135M-Instruct"


@pytest.mark.parametrize("change, match", [
    (dict(rope_interleaved=True), "rope_interleaved=True is unsupported"),
    (dict(use_mrope=True), "use_mrope=True is unsupported"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is unsupported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' unsupported"),
    (dict(attention_bias=True), "attention_bias=true is unsupported"),
    (dict(mlp_bias=True), "mlp_bias=true is unsupported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling type 'dynamic'"),
    (dict(quantization_config={"quant_method": "gptq"}), r"\['quantization_config'\]"),
    (dict(attn_logit_softcapping=50.0), r"\['attn_logit_softcapping'\]"),
    (dict(model_type="yi"), "unsupported model_type 'yi'"),
])
def test_numerics_changing_fields_are_refused_by_name(change, match):
    d = {**_load(BASE), **change}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d, source="config.json")


def test_qwen2_sliding_window_refused():
    d = {**_load("Qwen--Qwen2-7B-Instruct"), "use_sliding_window": True}
    with pytest.raises(ValueError, match="use_sliding_window=true is unsupported"):
        ModelConfig.from_hf_dict(d)


def test_a_directory_with_the_published_smollm2_config_loads(tiny_pair, tmp_path):
    """A tiny checkpoint whose config.json carries every field of SmolLM2-135M-Instruct's
    published text that is not a shape: it loads, and generates as the plain one does."""
    target = tiny_pair[0]
    d = copy_dir(target.path, tmp_path / "hub")
    hub = _load(BASE)
    shapes = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
              "rope_theta", "rms_norm_eps"}
    edit_config(d, **{k: v for k, v in hub.items() if k not in shapes},
                _model_name_or_path="Smollm2 135M", unk_token_id=0)
    m = oj.load_model(d)
    prompts = [[5, 6, 7, 8, 9]]
    assert (oj.generate(m, prompts, max_new_tokens=6).tokens
            == oj.generate(target, prompts, max_new_tokens=6).tokens)
