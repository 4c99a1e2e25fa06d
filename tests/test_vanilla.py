"""Vanilla decoding: equal to transformers' greedy generate, exact sampling, fixed shapes,
meshes, and clear errors on bad input."""

import numpy as np
import pytest
import torch
from scipy import stats as sps

import ouroboros_jax as oj
from ouroboros_jax.decoding.vanilla import run_vanilla
from ouroboros_jax.sharding import make_mesh

from conftest import make_hf_model


def _hf_greedy(torch_model, prompt, n, eos):
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                   eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_batched_and_unbatched(tiny_pair, random_prompts):
    target, _, torch_target = tiny_pair
    prompts = random_prompts[:20]
    # pick as EOS a token that vanilla emits mid-sequence for some prompts, so EOS cuts matter
    probe = oj.generate(target, prompts, max_new_tokens=24, eos_token_id=-1).tokens
    eos = max(set(t for o in probe for t in o[3:20]), key=lambda t: sum(t in o for o in probe))
    batched = oj.generate(target, prompts, max_new_tokens=24, eos_token_id=eos).tokens
    n_cut = 0
    for p, got in zip(prompts, batched):
        ref = _hf_greedy(torch_target, p, 24, eos)
        assert got == ref
        n_cut += len(ref) < 24
    assert n_cut >= 2, "the EOS cut-off was not exercised"
    for p, got in zip(prompts[:6], batched[:6]):
        assert oj.generate(target, [p], max_new_tokens=24, eos_token_id=eos).tokens[0] == got


def test_prompt_of_length_one_and_long_prompt(tiny_pair):
    target, _, torch_target = tiny_pair
    rs = np.random.RandomState(5)
    long_prompt = rs.randint(3, 97, size=700).tolist()
    for p in ([7], long_prompt):
        got = oj.generate(target, [p], max_new_tokens=12, eos_token_id=-1).tokens[0]
        assert got == _hf_greedy(torch_target, p, 12, None)


def test_prompts_pad_to_half_steps_from_128_and_stay_exact(tiny_pair):
    """From 128 tokens on a prompt is padded to the 1.5x step where it fits (a prefill scores
    every padded row); every method's greedy tokens at such a width stay transformers'."""
    from ouroboros_jax.request import pad_prompts, prompt_bucket

    widths = (1, 16, 17, 100, 128, 129, 192, 193, 256, 257, 384, 385, 700)
    assert [prompt_bucket(n) for n in widths] == [16, 16, 32, 128, 128, 192, 192, 256, 256,
                                                  384, 384, 512, 768]
    target, draft, torch_target = tiny_pair
    p = np.random.RandomState(9).randint(3, 97, size=150).tolist()
    assert pad_prompts([p])[0].shape == (1, 192)
    ref = _hf_greedy(torch_target, p, 12, None)
    for method in ("vanilla", "speculative", "ouroboros", "prompt_lookup", "lookahead"):
        got = oj.generate(target, [p], draft=draft if method in ("speculative", "ouroboros")
                          else None, method=method, config=None, max_new_tokens=12,
                          eos_token_id=-1).tokens[0]
        assert got == ref, method


def test_no_recompile_within_bucket(tiny_target):
    kw = dict(temperature=0.8, top_p=0.9)
    oj.generate(tiny_target, [[5, 6, 7, 8, 9]], max_new_tokens=10, seed=0, **kw)
    size = run_vanilla._cache_size()
    oj.generate(tiny_target, [[5, 6, 7, 8, 9, 10, 11, 12, 13]], max_new_tokens=20, seed=7,
                top_k=5, temperature=1.3, top_p=0.5)
    oj.generate(tiny_target, [[3] * 14], max_new_tokens=33, seed=123, **kw)
    assert run_vanilla._cache_size() == size


def test_sampling_reproducible_per_seed(tiny_target, random_prompts):
    kw = dict(max_new_tokens=16, temperature=1.0, eos_token_id=-1)
    a = oj.generate(tiny_target, random_prompts[:4], seed=11, **kw).tokens
    b = oj.generate(tiny_target, random_prompts[:4], seed=11, **kw).tokens
    c = oj.generate(tiny_target, random_prompts[:4], seed=12, **kw).tokens
    assert a == b and a != c
    # keys depend on (row, position), not on batch composition
    solo = oj.generate(tiny_target, [random_prompts[0]], seed=11, **kw).tokens[0]
    assert solo == a[0]


def _reference_probs(torch_model, prompt, temperature, top_k, top_p):
    """transformers' own warpers: an implementation independent of ours."""
    from transformers import (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    with torch.no_grad():
        logits = torch_model(torch.tensor([prompt])).logits[:, -1]
    ids = torch.tensor([prompt])
    logits = TemperatureLogitsWarper(temperature)(ids, logits)
    if top_k:
        logits = TopKLogitsWarper(top_k)(ids, logits)
    if top_p < 1:
        logits = TopPLogitsWarper(top_p)(ids, logits)
    return torch.softmax(logits, -1)[0].numpy().astype(np.float64)


def _chi2_p(counts, probs):
    support = probs > 0
    if np.any(counts[~support] > 0):
        return 0.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return sps.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 0, 0.8),
                                                     (1.3, 3, 1.0)])
def test_sampling_distribution_matches_processed_softmax(small_vocab, temperature, top_k, top_p):
    model, tm = small_vocab
    prompt = [1, 5, 3, 6]
    n = 4000
    out = oj.generate(model, [prompt] * n, max_new_tokens=1, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=2024, eos_token_id=-1)
    counts = np.bincount([t[0] for t in out.tokens], minlength=8).astype(float)
    want = _reference_probs(tm, prompt, temperature, top_k, top_p)
    assert _chi2_p(counts, want) > 1e-3
    # the same test rejects a wrong rule: plain softmax without the processing
    wrong = _reference_probs(tm, prompt, 1.0, 0, 1.0)
    assert _chi2_p(counts, wrong) < 1e-6


def test_mesh_gives_same_tokens(tmp_path, random_prompts):
    make_hf_model(tmp_path, heads=8, kv_heads=4, hidden=64)
    m = oj.load_model(str(tmp_path))
    prompts = random_prompts[:8]
    ref = oj.generate(m, prompts, max_new_tokens=16).tokens
    for data, model in ((1, 8), (2, 4)):
        got = oj.generate(m, prompts, max_new_tokens=16, mesh=make_mesh(data, model)).tokens
        assert got == ref, (data, model)


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[]]), r"prompts\[0\] is empty"),
    (dict(prompts=[[1, 2, 500]]), r"prompts\[0\] holds token id 500"),
    (dict(prompts=[[1] * 1000]), "prompts: the longest prompt has 1000 tokens"),
    (dict(method="beam"), "method must be one of"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer"),
    (dict(prompts="hello"), "prompts must be a list"),
])
def test_bad_input_raises_naming_parameter(tiny_target, kwargs, match):
    args = dict(prompts=[[1, 2, 3]])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        oj.generate(tiny_target, **args)


def test_draft_with_other_vocabulary_is_refused(tiny_target, tmp_path):
    make_hf_model(tmp_path, vocab=50, layers=1)
    other = oj.load_model(str(tmp_path))
    with pytest.raises(ValueError, match="draft vocabulary"):
        oj.generate(tiny_target, [[1, 2]], draft=other, method="vanilla")


def test_text_prompts_use_the_tokenizer(tmp_path):
    from ouroboros_jax.training.tokenizer import save_hf_tokenizer, train_tokenizer

    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
             "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 20
    tok = train_tokenizer(texts, vocab_size=300)
    make_hf_model(tmp_path, vocab=tok.get_vocab_size(), layers=1)
    save_hf_tokenizer(tok, tmp_path)
    m = oj.load_model(str(tmp_path))
    assert m.tokenizer is not None
    prompt = "def add(a, b):\n"
    by_text = oj.generate(m, [prompt], max_new_tokens=8, eos_token_id=-1)
    ids = m.tokenizer(prompt)["input_ids"]
    by_ids = oj.generate(m, [ids], max_new_tokens=8, eos_token_id=-1)
    assert by_text.tokens == by_ids.tokens
    assert by_text.texts[0] == m.tokenizer.decode(by_text.tokens[0], skip_special_tokens=True)
