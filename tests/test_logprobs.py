"""Logprobs of emitted tokens (`generate(..., logprobs=True)`, decoding/logprobs.py): every
method reports vanilla's for the same tokens, taken from the forward that accepted them, and
vanilla's equal the log-softmax of one full forward of transformers' model over prompt + output
(an independent reference computed here). Also: the accepted draft tokens counted by source
add up (the greedy runs are at hand)."""

import numpy as np
import pytest
import torch

import ouroboros_jax as oj
from ouroboros_jax.decoding import METHODS

from conftest import REPEAT, noisy_copy

METHOD_NAMES = ("vanilla", "speculative", "lookahead", "prompt_lookup", "ouroboros")
PROMPTS = [REPEAT[0], REPEAT[1], [11, 40, 7, 3, 60, 12, 9], REPEAT[3]]
N = 16


@pytest.fixture(scope="module")
def close_draft(tiny_target):
    """A draft that agrees with the target often, so rounds accept several tokens."""
    return noisy_copy(tiny_target)


def _gen(target, draft, method, **kw):
    spec = METHODS[method]
    cfg = spec.quick_config() if spec.quick_config else None
    return oj.generate(target, PROMPTS, draft=draft if spec.needs_draft else None,
                       method=method, config=cfg, max_new_tokens=N, eos_token_id=-1, **kw)


def _reference(torch_model, prompt, out, temperature=1.0, top_k=0):
    """log-probs [n, V] of the processed distribution (temperature, top-k) after each
    position of prompt + out that chose a token of out: one full forward of the torch model."""
    ids = torch.tensor([list(prompt) + list(out)])
    with torch.no_grad():
        logits = torch_model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(out)]
    logits = logits.double() / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = torch.where(logits < kth, torch.tensor(-torch.inf, dtype=logits.dtype), logits)
    return torch.log_softmax(logits, dim=-1).numpy()


def _at(ref, out):
    return ref[np.arange(len(out)), out]


@pytest.fixture(scope="module")
def greedy_runs(tiny_pair, close_draft):
    target = tiny_pair[0]
    return {m: _gen(target, close_draft, m, logprobs=True, top_logprobs=3)
            for m in METHOD_NAMES}


def test_vanilla_greedy_logprobs_equal_a_full_forward_of_transformers(tiny_pair, greedy_runs):
    torch_target = tiny_pair[2]
    out = greedy_runs["vanilla"]
    for p, toks, lps, tops in zip(PROMPTS, out.tokens, out.logprobs, out.top_logprobs):
        ref = _reference(torch_target, p, toks)
        assert len(lps) == len(toks) == N
        np.testing.assert_allclose(lps, _at(ref, toks), atol=2e-4)
        for j, top in enumerate(tops):
            want = np.argsort(-ref[j])[:3]
            assert [t for t, _ in top] == want.tolist()
            np.testing.assert_allclose([lp for _, lp in top], ref[j, want], atol=2e-4)
            assert top[0][0] == toks[j]  # greedy: the emitted token is the most likely one


@pytest.mark.parametrize("method", METHOD_NAMES[1:])
def test_greedy_logprobs_equal_vanillas_for_every_method(greedy_runs, method):
    van, got = greedy_runs["vanilla"], greedy_runs[method]
    assert got.tokens == van.tokens
    for a, b in zip(got.logprobs, van.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-5)
    for a, b in zip(got.top_logprobs, van.top_logprobs):
        assert [[t for t, _ in pos] for pos in a] == [[t for t, _ in pos] for pos in b]
        np.testing.assert_allclose([[v for _, v in pos] for pos in a],
                                   [[v for _, v in pos] for pos in b], rtol=1e-5, atol=5e-5)
    # the speculative path was exercised: some round kept more than one token
    assert sum(got.stats["acceptance_histogram"][2:]) > 0, got.stats["acceptance_histogram"]


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_sampled_logprobs_are_the_processed_distributions(tiny_pair, close_draft, method):
    """Sampled: every method's logprobs are those of the tokens it drew under the processed
    distribution (temperature, top-k), whichever node of its tree accepted them."""
    target, _, torch_target = tiny_pair
    out = _gen(target, close_draft, method, logprobs=True, temperature=0.8, top_k=20, seed=3)
    for p, toks, lps in zip(PROMPTS, out.tokens, out.logprobs):
        ref = _reference(torch_target, p, toks, temperature=0.8, top_k=20)
        assert np.all(np.isfinite(lps))
        np.testing.assert_allclose(lps, _at(ref, toks), atol=2e-4)
    assert out.top_logprobs is None  # top_logprobs=0: none asked for


def test_logprobs_change_no_token_and_are_absent_by_default(tiny_pair, close_draft,
                                                            greedy_runs):
    target = tiny_pair[0]
    for method in ("vanilla", "ouroboros"):
        off = _gen(target, close_draft, method)
        assert off.logprobs is None and off.top_logprobs is None
        assert off.tokens == greedy_runs[method].tokens
    sampled = dict(temperature=1.0, top_p=0.9, seed=5)
    assert (_gen(target, close_draft, "lookahead", **sampled).tokens
            == _gen(target, close_draft, "lookahead", logprobs=True, **sampled).tokens)


@pytest.mark.parametrize("kwargs, match", [
    (dict(logprobs=1), "logprobs must be a bool"),
    (dict(logprobs=True, top_logprobs=21), r"top_logprobs must be an integer in \[0, 20\]"),
    (dict(top_logprobs=2), "top_logprobs=2 needs logprobs=True"),
])
def test_bad_logprob_arguments_name_the_argument(tiny_target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        oj.generate(tiny_target, [[5, 6]], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_accepted_tokens_by_source_add_up(greedy_runs, method):
    """Every accepted draft token (kept past the target's own one per round) is counted under
    exactly one of the method's sources (decoding/common.py SOURCES), and only those."""
    s = greedy_runs[method].stats
    accepted = sum(max(j - 1, 0) * n for j, n in enumerate(s["acceptance_histogram"]))
    by = {k: v for k, v in s.items() if k.startswith("accepted_from_")}
    assert set(by) == {f"accepted_from_{n}" for n in METHODS[method].sources}
    assert sum(by.values()) == accepted
    if method != "vanilla":
        assert accepted > 0
    if method == "ouroboros":  # both sources of Ouroboros' tree took part
        assert by["accepted_from_draft_chain"] > 0 and by["accepted_from_pool_phrases"] > 0, by
        assert by["accepted_from_prompt_lookup"] == 0  # free drafts (off) copy the context
