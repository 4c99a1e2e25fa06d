"""Prompt lookup decoding: candidates are what a brute-force reference finds, greedy equals
vanilla token for token, sampling equals vanilla sampling for the same seed, cut-offs land
inside accepted blocks, and the first two sampled tokens follow the exact distribution."""

import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.decoding.prompt_lookup import (PromptLookupConfig, find_candidates,
                                                  match_lengths, run_prompt_lookup)

from conftest import REPEAT
from test_lookahead import _two_token_probs, assert_two_token_sampling

CFG = PromptLookupConfig(max_ngram=3, candidates=2, length=4)


def test_config_validation():
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookupConfig(max_ngram=0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupConfig(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="candidates"):
        PromptLookupConfig(candidates=0)
    with pytest.raises(ValueError, match="length"):
        PromptLookupConfig(length=True)


def _reference_candidates(row, cfg):
    """Brute force, one row: every earlier end j of a match of the last k tokens (k from
    max_ngram down to min_ngram), ranked by (k, tokens inside the row, j); first tokens
    deduplicated; the best X kept, each as (tokens inside the row)."""
    L, M = len(row), cfg.length
    found = []
    for j in range(L - 1):
        k = 0
        while k < cfg.max_ngram and j - k >= 0 and row[j - k] == row[L - 1 - k]:
            k += 1
        if k >= cfg.min_ngram:
            inside = min(M, L - 1 - j)
            found.append(((k, inside, j), row[j + 1:j + 1 + inside]))
    found.sort(key=lambda f: f[0], reverse=True)
    found = found[:4 * cfg.candidates]  # the ranked pool the device code deduplicates
    out, firsts = [], set()
    for _, cont in found:
        if cont[0] in firsts:
            continue
        firsts.add(cont[0])
        out.append(list(cont))
    return out[:cfg.candidates]


@pytest.mark.parametrize("cfg", [CFG, PromptLookupConfig(max_ngram=2, min_ngram=2, candidates=3,
                                                         length=3),
                                 PromptLookupConfig(max_ngram=1, candidates=1, length=6)])
def test_candidates_match_a_brute_force_reference(cfg):
    rs = np.random.RandomState(0)
    rows = [list(r) for r in REPEAT] + [rs.randint(3, 9, size=n).tolist() for n in (2, 7, 19, 30)]
    rows += [[4], [4, 4], [5, 6, 5, 6, 5]]
    S = 32
    tokens = np.zeros((len(rows), S), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
        tokens[i, len(r):] = r[-1]  # garbage past the row's end that would match: must be ignored
    lengths = np.array([len(r) for r in rows], np.int32)
    cand, valid = find_candidates(jnp.asarray(tokens), jnp.asarray(lengths), cfg)
    cand, valid = np.asarray(cand), np.asarray(valid)
    for i, r in enumerate(rows):
        want = _reference_candidates(r, cfg)
        got = [cand[i, x][valid[i, x]].tolist() for x in range(cfg.candidates)]
        assert [g for g in got if g] == want, (r, got, want)
        for x in range(cfg.candidates):  # valid is a prefix of each candidate
            v = valid[i, x]
            assert not np.any(v[1:] & ~v[:-1])


def test_match_lengths_counts_runs_before_the_last_token():
    row = [7, 1, 2, 3, 9, 2, 3]
    run = np.asarray(match_lengths(jnp.asarray([row + [3, 3]]), jnp.asarray([7]), 4))[0]
    # ends j < 6 only; j = 3 repeats "2 3", j = 0..2 and 4, 5 end in other tokens
    assert run.tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0]


def test_greedy_equals_vanilla_batched(tiny_target, random_prompts):
    prompts = random_prompts[:30] + REPEAT
    kw = dict(max_new_tokens=20, eos_token_id=-1)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    for cfg in (CFG, PromptLookupConfig(max_ngram=2, min_ngram=2, candidates=1, length=6)):
        out = oj.generate(tiny_target, prompts, method="prompt_lookup", config=cfg, **kw)
        assert out.tokens == ref
        s = out.stats
        assert s["new_tokens"] == 20 * len(prompts)
        assert s["new_tokens"] == sum(k * c for k, c in enumerate(s["acceptance_histogram"]))
        assert s["guess_tokens_accepted"] > 0 and s["drafted_tokens"] > 0
        assert s["eta"] > 1.0


@pytest.fixture(scope="module")
def bigram(tiny_target):
    """The tiny target with every attention output and MLP zeroed: its next token depends on
    the last token only, so greedy decoding soon cycles and its output repeats its context,
    as a copying request's does."""
    layers = dict(tiny_target.params["layers"])
    layers["wo"] = jnp.zeros_like(layers["wo"])
    layers["w_down"] = jnp.zeros_like(layers["w_down"])
    return oj.Model(tiny_target.config, {**tiny_target.params, "layers": layers})


def _cycling_prompts(model):
    starts = [[t] for t in (3, 17, 40, 77, 90)]
    orbit = oj.generate(model, starts, max_new_tokens=40, eos_token_id=-1).tokens
    return [s + o for s, o in zip(starts, orbit)]


def test_greedy_on_copying_rows_accepts_long_blocks(bigram):
    prompts = _cycling_prompts(bigram)
    ref = oj.generate(bigram, prompts, max_new_tokens=24, eos_token_id=-1).tokens
    out = oj.generate(bigram, prompts, method="prompt_lookup", config=CFG, max_new_tokens=24,
                      eos_token_id=-1)
    assert out.tokens == ref
    assert out.stats["eta"] > 3.0, out.stats  # M + 1 = 5 at most


def test_max_new_tokens_and_eos_inside_accepted_blocks(bigram):
    prompts = _cycling_prompts(bigram)
    full = oj.generate(bigram, prompts, max_new_tokens=24, eos_token_id=-1).tokens
    for k in (1, 2, 3, 5, 7):
        out = oj.generate(bigram, prompts, method="prompt_lookup", config=CFG,
                          max_new_tokens=k, eos_token_id=-1)
        assert out.tokens == [o[:k] for o in full], k
    n_cut = 0
    for row in range(len(prompts)):
        eos = full[row][6]
        ref = oj.generate(bigram, prompts, max_new_tokens=24, eos_token_id=eos).tokens
        got = oj.generate(bigram, prompts, method="prompt_lookup", config=CFG,
                          max_new_tokens=24, eos_token_id=eos)
        assert got.tokens == ref
        assert got.stats["eta"] > 2.0
        n_cut += sum(len(r) < 24 for r in ref)
    assert n_cut >= len(prompts)


def test_sampling_identical_to_vanilla_same_seed(tiny_target, random_prompts):
    prompts = random_prompts[:12] + REPEAT
    kw = dict(max_new_tokens=20, eos_token_id=-1, temperature=0.8, top_k=20, top_p=0.95,
              seed=77)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    out = oj.generate(tiny_target, prompts, method="prompt_lookup", config=CFG, **kw)
    assert out.tokens == ref


def test_sampling_on_copying_rows_identical_to_vanilla(bigram):
    prompts = _cycling_prompts(bigram)
    kw = dict(max_new_tokens=24, eos_token_id=-1, temperature=0.3, seed=5)
    ref = oj.generate(bigram, prompts, **kw).tokens
    out = oj.generate(bigram, prompts, method="prompt_lookup", config=CFG, **kw)
    assert out.tokens == ref
    assert out.stats["eta"] > 1.5  # sampled candidates really were accepted


def test_first_two_tokens_distribution(small_vocab):
    model, tm = small_vocab
    # the prompt repeats its last token after each likely first token, so candidates exist
    prompt = [1, 5, 3, 6, 0, 6, 1, 6, 2, 6, 3, 6, 4, 6]
    temperature, n = 0.7, 3000
    want = _two_token_probs(tm, prompt, temperature)
    cfg = PromptLookupConfig(max_ngram=1, candidates=4, length=2)
    out = oj.generate(model, [prompt] * n, method="prompt_lookup", config=cfg,
                      max_new_tokens=2, temperature=temperature, seed=99, eos_token_id=-1)
    assert out.stats["guess_tokens_accepted"] > n // 10  # candidates were really taken
    assert_two_token_sampling(tm, prompt, want, out.tokens)


def test_no_recompile_across_prompts_and_auto(tiny_target):
    kw = dict(method="prompt_lookup", config=CFG)
    oj.generate(tiny_target, [[5, 6, 7]], max_new_tokens=10, **kw)
    size = run_prompt_lookup._cache_size()
    oj.generate(tiny_target, [[9, 8, 7, 6, 5, 4, 3, 9, 8]], max_new_tokens=20, eos_token_id=5, **kw)
    oj.generate(tiny_target, [[3] * 16], max_new_tokens=30, **kw)
    assert run_prompt_lookup._cache_size() == size
    ref = oj.generate(tiny_target, REPEAT, max_new_tokens=16, eos_token_id=-1).tokens
    out = oj.generate(tiny_target, REPEAT, method="prompt_lookup", max_new_tokens=16,
                      eos_token_id=-1)  # config="auto"
    assert out.tokens == ref
    assert out.stats["auto"]["asked"] == "prompt_lookup"


def test_replay_predicts_the_rounds_generate_takes(bigram, tiny_target, random_prompts):
    """experiments/lookup_replay's eta, computed from vanilla's output alone, equals what greedy
    prompt lookup measures as tokens per target call, on copying and on random rows."""
    from experiments.lookup_replay import replay_eta

    cases = [(bigram, p) for p in _cycling_prompts(bigram)[:3]]
    cases += [(tiny_target, p) for p in random_prompts[:2]]
    for model, p in cases:
        ref = oj.generate(model, [p], max_new_tokens=20, eos_token_id=-1).tokens[0]
        out = oj.generate(model, [p], method="prompt_lookup", config=CFG, max_new_tokens=20,
                          eos_token_id=-1)
        assert out.tokens[0] == ref
        assert replay_eta(p, ref, CFG) == pytest.approx(
            len(ref) / out.stats["target_calls"]), (p, out.stats)


def test_oracle_eta_by_hand():
    from experiments.lookup_replay import oracle_eta, parse_configs

    assert oracle_eta([1, 2, 3, 4], [1, 2, 3, 4], length=8) == 4.0  # one round copies it all
    # round 1: 9 is new (the target's own token); round 2 copies 5 6 7 and the target adds 8
    assert oracle_eta([5, 6, 7], [9, 5, 6, 7, 8], length=8) == 2.5
    assert oracle_eta([5, 6, 7], [9, 5, 6, 7, 8], length=1) == 5 / 3  # 9 | 5 6 | 7 8
    assert parse_configs("1x4, 2x8") == [(1, 4), (2, 8)]
    for bad in ("2", "0x4", "ax4", "2x"):
        with pytest.raises(SystemExit, match="--configs"):
            parse_configs(bad)
