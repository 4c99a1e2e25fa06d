"""A hostile but realistic user of `generate` and `load_model`: bf16 numerics as documented,
loading that cannot pick the wrong weights, EOS lists, pools and meshes that cannot poison or
leak, no recompilation on max_new_tokens with a fixed cache, clear errors for bad arguments."""

import gc
import json
import os
import shutil
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ouroboros_jax as oj
from ouroboros_jax.decoding.lookahead import LookaheadConfig
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig
from ouroboros_jax.models import causal_mask, forward
from ouroboros_jax.pool import PhrasePool, init_pool, insert_many, load_pool, save_pool

from conftest import REPEAT, copy_dir as _copy, edit_config as _edit_config, make_hf_model

LA = LookaheadConfig(window=3, ngram=3, guesses=3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf15")
    make_hf_model(d, layers=1)
    return str(d)


# ------------------------------------------------------------------ 1. bf16: what holds
def _teacher_forced_margins(model, ids):
    """(two best tokens, top1 - top2, max |logit|) per position of one causal forward."""
    x = jnp.asarray([ids], jnp.int32)
    T = len(ids)
    logits, _ = forward(model.params, model.config, x, jnp.arange(T, dtype=jnp.int32)[None],
                        causal_mask(1, T))
    lg = np.asarray(logits[0], np.float32)
    s = np.sort(lg, -1)
    return np.argsort(lg, -1)[:, -2:], s[:, -1] - s[:, -2], np.abs(lg).max(-1)


def test_bf16_methods_depart_from_vanilla_only_at_rounding_level_ties(tiny_pair, random_prompts):
    """docs/exactness.md: in bf16 a method may leave vanilla's tokens only where
    vanilla's two best logits are within 2% of the largest logit (a bf16 rounding-level tie),
    and there both outputs hold one of those two best tokens, never an arbitrary one."""
    target = oj.load_model(tiny_pair[0].path, dtype="bfloat16")
    draft = oj.load_model(tiny_pair[1].path, dtype="bfloat16")
    prompts = random_prompts[:6] + REPEAT[:2]
    kw = dict(max_new_tokens=24, eos_token_id=-1)
    van = oj.generate(target, prompts, **kw).tokens
    runs = {"speculative": dict(draft=draft, config=SpeculativeConfig(gamma=3)),
            "lookahead": dict(config=LA),
            "ouroboros": dict(draft=draft, config=OuroborosConfig(
                gamma=3, window=3, ngram=3, guesses=3, suffixes=2))}
    for m, extra in runs.items():
        out = oj.generate(target, prompts, method=m, **kw, **extra).tokens
        for p, a, b in zip(prompts, van, out):
            if a == b:
                continue
            k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            top2, margin, scale = _teacher_forced_margins(target, p + a[:k])
            i = len(p) + k - 1
            assert margin[i] <= 0.02 * scale[i], (m, k, margin[i], scale[i])
            assert b[k] in top2[i] and a[k] in top2[i], (m, k)


# ------------------------------------------------------------------ 2. loading
def test_single_file_wins_over_a_sharded_index_like_transformers(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    save_file({k: v * 2 for k, v in tensors.items()}, os.path.join(d, "shard-1.safetensors"))
    json.dump({"metadata": {}, "weight_map": {k: "shard-1.safetensors" for k in tensors}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    m = oj.load_model(d)
    np.testing.assert_array_equal(np.asarray(m.params["embed"]),
                                  tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", [np.int8, np.bool_])
def test_integer_and_bool_tensors_are_refused(tmp_path, hf_dir, dtype):
    d = _copy(hf_dir, tmp_path / "m")
    fn = os.path.join(d, "model.safetensors")
    tensors = load_file(fn)
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = (tensors[key] > 0).astype(dtype)
    save_file(tensors, fn)
    with pytest.raises(ValueError, match=f"{key} has dtype"):
        oj.load_model(d)


@pytest.mark.parametrize("change,match", [
    (dict(rms_norm_eps=0), "rms_norm_eps"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (dict(vocab_size="ninety-seven"), "'vocab_size' must be an integer"),
    (dict(hidden_size=64.5), "'hidden_size' must be an integer"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling of type linear lacks field "
                                                 "'factor'"),
    (dict(eos_token_id=[2, "x"]), "eos_token_id"),
])
def test_bad_config_values_name_file_and_field(tmp_path, hf_dir, change, match):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, **change)
    with pytest.raises(ValueError, match=match) as e:
        oj.load_model(d)
    assert "config.json" in str(e.value)


def test_config_json_that_is_a_list_is_refused_naming_the_file(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    json.dump([1, 2], open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="config.json: must hold a JSON object"):
        oj.load_model(d)


def test_index_with_a_list_weight_map_is_refused_naming_the_file(tmp_path, hf_dir):
    d = _copy(hf_dir, tmp_path / "m")
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "shard-1.safetensors"))
    json.dump({"weight_map": ["shard-1.safetensors"]},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(ValueError, match="model.safetensors.index.json: field 'weight_map'"):
        oj.load_model(d)


def test_truncated_tokenizer_json_is_refused_naming_the_file(tmp_path, hf_dir):
    from ouroboros_jax.training.assets import DEMO_DIR

    d = _copy(hf_dir, tmp_path / "m")
    for n in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "draft" / n, os.path.join(d, n))
    text = open(os.path.join(d, "tokenizer.json")).read()
    open(os.path.join(d, "tokenizer.json"), "w").write(text[:len(text) // 2])
    with pytest.raises(ValueError, match="tokenizer.json is not valid JSON"):
        oj.load_model(d)


# ------------------------------------------------------------------ 3. EOS lists
@pytest.fixture(scope="module")
def probe(tiny_target):
    """A prompt and its 24 greedy tokens without EOS, plus two ids that occur in them."""
    prompt = [5, 6, 7, 8, 9, 10]
    toks = oj.generate(tiny_target, [prompt], max_new_tokens=24, eos_token_id=-1).tokens[0]
    near, far = toks[4], toks[12]
    assert near not in toks[:4] and far not in toks[:4] and near != far
    return prompt, toks, near, far


def _cut(toks, ids):
    i = min(toks.index(e) for e in ids if e in toks)
    return toks[:i + 1]


def test_generate_accepts_an_eos_list_for_every_method(tiny_pair, probe):
    target, draft, _ = tiny_pair
    prompt, toks, near, far = probe
    want = _cut(toks, [far, near])
    for m, extra in (("vanilla", {}), ("speculative", dict(draft=draft)),
                     ("lookahead", dict(config=LA))):
        out = oj.generate(target, [prompt], method=m, max_new_tokens=24,
                          eos_token_id=[far, near], **extra)
        assert out.tokens[0] == want, m
    with pytest.raises(ValueError, match="eos_token_id"):
        oj.generate(target, [prompt], eos_token_id=[near, -5])


def test_eos_lists_from_config_and_generation_config(tmp_path, tiny_target, probe):
    prompt, toks, near, far = probe
    d = _copy(tiny_target.path, tmp_path / "m")
    _edit_config(d, eos_token_id=[far, near])
    gen = os.path.join(d, "generation_config.json")  # save_pretrained wrote eos 2 there
    if os.path.exists(gen):
        os.remove(gen)
    m = oj.load_model(d)
    assert m.config.eos_token_id == (far, near)
    assert oj.generate(m, [prompt], max_new_tokens=24).tokens[0] == _cut(toks, [far, near])
    # generation_config.json, when present, decides (as in transformers)
    json.dump({"eos_token_id": [far]}, open(gen, "w"))
    m = oj.load_model(d)
    assert oj.generate(m, [prompt], max_new_tokens=24).tokens[0] == _cut(toks, [far])
    # and the list survives a save/reload through transformers' format
    out = tmp_path / "saved"
    oj.save_hf_checkpoint(str(out), m.config, m.params)
    assert json.load(open(out / "config.json"))["eos_token_id"] == [far, near]


# ------------------------------------------------------------------ 4. pools
def test_pool_phrase_outside_the_vocabulary_is_never_offered(tiny_target, probe):
    V = tiny_target.config.vocab_size
    prompt, toks, _, _ = probe
    keys = jnp.arange(V, dtype=jnp.int32)
    bad = init_pool(V, LA.guesses, LA.ngram - 1)
    bad = insert_many(bad, keys, jnp.full((V, LA.ngram - 1), V + 3, jnp.int32))
    out = oj.generate(tiny_target, [prompt], method="lookahead", config=LA, pool=bad,
                      max_new_tokens=24, eos_token_id=-1)
    assert out.tokens[0] == toks


def _pool_file(path, **override):
    pool = init_pool(11, 2, 2, rows=5)
    pool = insert_many(pool, jnp.array([1, 6], jnp.int32), jnp.array([[2, 3], [4, 5]], jnp.int32))
    d = dict(keys=np.asarray(pool.keys), phrases=np.asarray(pool.phrases),
             stamps=np.asarray(pool.stamps), clock=np.asarray(pool.clock),
             vocab_size=np.int64(11), policy=np.array("lru"), format=np.int64(1))
    d.update(override)
    np.savez(path, **d)
    return d


@pytest.mark.parametrize("case,match", [
    ("phrase_id", "outside the vocabulary"),
    ("key_id", "keys must be"),
    ("phrases_2d", "inconsistent pool shapes"),
    ("float_keys", "keys must hold integers"),
    ("clock_vector", "clock must be an integer scalar"),
])
def test_load_pool_refuses_bad_contents_and_shapes(tmp_path, case, match):
    base = _pool_file(tmp_path / "ok.npz")
    load_pool(tmp_path / "ok.npz")
    phrases, keys = base["phrases"].copy(), base["keys"].copy()
    override = {
        "phrase_id": lambda: dict(phrases=np.where(phrases == 5, 50, phrases)),
        "key_id": lambda: dict(keys=np.where(keys == 6, 16, keys)),
        "phrases_2d": lambda: dict(phrases=phrases[..., 0]),
        "float_keys": lambda: dict(keys=keys.astype(np.float32)),
        "clock_vector": lambda: dict(clock=np.array([2, 2])),
    }[case]()
    _pool_file(tmp_path / "bad.npz", **override)
    with pytest.raises(ValueError, match=match):
        load_pool(tmp_path / "bad.npz")


def test_hand_made_pool_with_wrong_shapes_is_refused_before_the_loop(tiny_target):
    V = tiny_target.config.vocab_size
    p = init_pool(V, LA.guesses, LA.ngram - 1)
    bad = PhrasePool(keys=p.keys, phrases=p.phrases, stamps=p.stamps[:, :1], clock=p.clock,
                     vocab_size=V)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        oj.generate(tiny_target, [[5, 6, 7]], method="lookahead", config=LA, pool=bad)


def test_save_pool_leaves_no_temp_file_when_it_fails(tmp_path):
    target = tmp_path / "pool.npz"
    target.mkdir()  # the final rename onto a directory fails
    with pytest.raises(OSError):
        save_pool(target, init_pool(11, 2, 2))
    assert sorted(os.listdir(tmp_path)) == ["pool.npz"]


# ------------------------------------------------------------------ 5. meshes
def test_sharded_copy_is_freed_with_its_model(tiny_target):
    from ouroboros_jax.sharding import make_mesh, shard_model

    mesh = make_mesh(1, 2)
    m = oj.Model(tiny_target.config, {k: v for k, v in tiny_target.params.items()})
    sharded = shard_model(m, mesh)
    assert shard_model(m, make_mesh(1, 2)) is sharded  # an equal mesh reuses the placement
    ref = weakref.ref(sharded)
    del sharded, m
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------------ 6. recompilation
def test_max_new_tokens_never_recompiles_with_a_fixed_cache(tiny_target):
    from ouroboros_jax.decoding.lookahead import run_lookahead
    from ouroboros_jax.decoding.vanilla import run_vanilla

    prompts = [[5, 6, 7, 8, 9]]
    for method, fn, extra in (("vanilla", run_vanilla, {}),
                              ("lookahead", run_lookahead, dict(config=LA))):
        kw = dict(method=method, max_cache_len=256, eos_token_id=-1, **extra)
        first = oj.generate(tiny_target, prompts, max_new_tokens=40, **kw)
        size = fn._cache_size()
        outs = {n: oj.generate(tiny_target, prompts, max_new_tokens=n, **kw).tokens[0]
                for n in (50, 100, 200)}
        assert fn._cache_size() == size, method
        assert outs[200][:40] == first.tokens[0] and len(outs[200]) == 200


# ------------------------------------------------------------------ 7. clear errors
def test_a_draft_without_a_method_runs_ouroboros(tiny_pair, random_prompts):
    """A call that passes a draft and names no method runs Ouroboros, as `serve` does
    (`request.default_method`); without a draft, vanilla. An Ouroboros config is taken with no
    method named, which a vanilla default would refuse."""
    from ouroboros_jax.request import default_method

    target, draft, _ = tiny_pair
    cfg = OuroborosConfig(gamma=2, window=2, ngram=3, guesses=2, suffixes=1)
    out = oj.generate(target, random_prompts[:1], draft=draft, config=cfg, max_new_tokens=8)
    ref = oj.generate(target, random_prompts[:1], max_new_tokens=8)
    assert out.tokens == ref.tokens
    assert "pool_hit_rate" in out.stats and "pool_hit_rate" not in ref.stats
    with pytest.raises(ValueError, match="config"):
        oj.generate(target, random_prompts[:1], config=cfg, max_new_tokens=8)
    assert [default_method(m, d) for m, d in ((None, True), (None, False), ("speculative", True),
                                              ("vanilla", True))] == [
        "ouroboros", "vanilla", "speculative", "vanilla"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[1.0, 2.0, 3.0]]), r"prompts\[0\] holds 1.0"),
    (dict(prompts=[["1", "2"]]), r"prompts\[0\] holds '1'"),
    (dict(prompts=[[True, 2]]), r"prompts\[0\] holds True"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_p="1"), "top_p"),
    (dict(max_cache_len=0), "max_cache_len"),
    (dict(eos_token_id=10**30), "eos_token_id"),
    (dict(eos_token_id=True), "eos_token_id"),
])
def test_bad_arguments_raise_value_errors_naming_them(tiny_target, kwargs, match):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        oj.generate(tiny_target, **args)


def test_model_given_as_a_path_is_refused_with_a_hint(tiny_target):
    with pytest.raises(ValueError, match="target must be a model returned by oj.load_model"):
        oj.generate(tiny_target.path, [[1, 2, 3]])
    with pytest.raises(ValueError, match="draft must be a model"):
        oj.generate(tiny_target, [[1, 2, 3]], draft=tiny_target.path, method="speculative")


def test_huge_top_k_means_no_filtering(tiny_target):
    kw = dict(max_new_tokens=6, temperature=0.9, seed=3, eos_token_id=-1)
    assert (oj.generate(tiny_target, [[1, 2, 3]], top_k=10**30, **kw).tokens
            == oj.generate(tiny_target, [[1, 2, 3]], top_k=0, **kw).tokens)


@pytest.mark.parametrize("argv,match", [
    (["memory", "--mesh", "0x8"], "--mesh sizes must be >= 1"),
    (["memory", "--mesh", "1x0"], "--mesh sizes must be >= 1"),
    (["memory", "--mesh=-1x8"], "--mesh sizes must be >= 1"),
    (["memory", "--batch", "-1"], "--batch must be >= 1"),
    (["memory", "--cache-len", "-4096"], "--cache-len must be >= 1"),
])
def test_cli_refuses_bad_sizes(argv, match, capsys):
    from ouroboros_jax.cli import main

    with pytest.raises(SystemExit, match=match):
        main(argv)
    assert "GiB" not in capsys.readouterr().out


def test_demo_refuses_nonpositive_prompt_count_before_loading(monkeypatch):
    import ouroboros_jax.demo as demo

    def boom():
        raise RuntimeError("the demo loaded models before checking its arguments")

    monkeypatch.setattr(demo, "load_pair", boom)
    for n in (-1, 0):
        with pytest.raises(ValueError, match="num_prompts must be an integer >= 1"):
            demo.run_demo(num_prompts=n)


def test_make_mesh_refuses_nonpositive_axes():
    from ouroboros_jax.sharding import make_mesh

    with pytest.raises(ValueError, match="mesh data axis size"):
        make_mesh(0, 8)
    with pytest.raises(ValueError, match="mesh model axis size"):
        make_mesh(1, -1)
