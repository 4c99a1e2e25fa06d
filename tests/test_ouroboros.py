"""Ouroboros: greedy equals vanilla token for token in every regime (drafts that agree fully,
partly or not at all; batch 1 and 4; EOS and max_new_tokens inside draft and branch; empty,
full and carried pools; each mechanism off alone; the prompt's n-grams in the pool), sampling
equals vanilla sampling for the same seed and follows the exact distribution with branches
taken, and the stats add up."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as sps

import ouroboros_jax as oj
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.pool import PhrasePool, init_pool, insert_many, pool_occupancy

from conftest import REPEAT, TINY_VOCAB, ngram_pool, noisy_copy

CFG = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
G1 = CFG.gamma + 1


def ouro(target, draft, prompts, cfg=CFG, **kw):
    return oj.generate(target, prompts, draft=draft, method="ouroboros", config=cfg, **kw)


def check_stats(s, n_rows):
    """new tokens = sum of tokens accepted per round; the counters agree with each other."""
    hist = s["acceptance_histogram"]
    assert s["new_tokens"] == sum(k * c for k, c in enumerate(hist))
    assert s["new_tokens"] == sum(s["new_tokens_per_row"])
    assert hist[0] == 0  # a live row always gets at least the target's own token
    assert s["draft_calls"] >= sum(hist)  # every live row drafts at least once per round
    assert s["target_calls"] * n_rows >= sum(hist)
    assert s["suffix_tokens_accepted"] <= s["new_tokens"]
    assert 0.0 <= s["pool_hit_rate"] <= 1.0
    assert s["pool_bytes"] > 0 and s["pool_occupancy"] >= 0


@pytest.fixture(scope="module")
def prompts100():
    rs = np.random.RandomState(4321)
    return [rs.randint(3, TINY_VOCAB, size=rs.randint(1, 41)).tolist() for _ in range(94)] + REPEAT


@pytest.fixture(scope="module")
def noisy_draft(tiny_target):
    """The target with 3% noise on every weight: agrees with it often but not always."""
    return noisy_copy(tiny_target)


def test_config_validation():
    assert OuroborosConfig() == OuroborosConfig(gamma=12, window=20, ngram=7, guesses=20,
                                                suffixes=3)
    for field, bad in [("gamma", 0), ("window", 0), ("ngram", 2), ("guesses", 0),
                       ("suffixes", 0), ("pool_rows", 0), ("lengthening", 1), ("history", None),
                       ("confidence", 1.0), ("confidence", -0.1), ("confidence", True)]:
        with pytest.raises(ValueError, match=rf"OuroborosConfig\.{field}"):
            OuroborosConfig(**{field: bad})
    with pytest.raises(ValueError, match="suffixes"):
        OuroborosConfig(guesses=2, suffixes=3)


@pytest.mark.parametrize("which", ["unrelated", "self"])
def test_greedy_equals_vanilla_100_prompts(tiny_pair, prompts100, which):
    target, unrelated, _ = tiny_pair
    draft = unrelated if which == "unrelated" else target
    kw = dict(max_new_tokens=20, eos_token_id=-1)
    ref = oj.generate(target, prompts100, **kw).tokens
    out = ouro(target, draft, prompts100, **kw)
    assert out.tokens == ref
    s = out.stats
    check_stats(s, len(prompts100))
    if which == "self":
        # everything drafted is accepted: every round but a row's last emits >= gamma + 1
        assert sum(s["acceptance_histogram"][:G1]) <= len(prompts100)
        assert s["eta"] > G1 - 0.5
        assert s["c"] > 1.0  # phrase drafting: the draft's own lookahead hits repeats
        assert s["suffix_tokens_accepted"] > 0
    else:
        assert s["eta"] < 1.5


# ----------------------------------------------------------------------------- adaptive drafting


@pytest.mark.parametrize("phrase_drafting", [True, False])
def test_adaptive_greedy_equals_vanilla_and_drafts_less(tiny_target, noisy_draft, random_prompts,
                                                        phrase_drafting):
    """Rows stop drafting below the confidence threshold (random tiny models are rarely sure,
    so chains get cut): the tokens stay vanilla's, the draft drafts fewer tokens, and every
    round still drafts at least one token per live row."""
    prompts = random_prompts[:12] + REPEAT
    kw = dict(max_new_tokens=24, eos_token_id=-1)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    cfg = dataclasses.replace(CFG, phrase_drafting=phrase_drafting)
    fixed = ouro(tiny_target, noisy_draft, prompts, cfg, **kw)
    out = ouro(tiny_target, noisy_draft, prompts, dataclasses.replace(cfg, confidence=0.9), **kw)
    assert fixed.tokens == ref and out.tokens == ref
    check_stats(out.stats, len(prompts))
    s, f = out.stats, fixed.stats
    drafted = round(s["c"] * s["draft_calls"])  # draft tokens (c = tokens per row-forward)
    assert drafted < round(f["c"] * f["draft_calls"])
    assert s["draft_calls"] <= f["draft_calls"]
    assert drafted >= sum(s["acceptance_histogram"])  # >= 1 per live row and round
    assert s["draft_matches"] <= drafted


def test_adaptive_self_draft_keeps_whole_chains(tiny_target):
    """The target as its own draft at a tiny threshold: no chain is cut, so the run is the
    fixed-gamma run, counters and all (branches included)."""
    kw = dict(max_new_tokens=24, eos_token_id=-1)
    fixed = ouro(tiny_target, tiny_target, REPEAT, **kw)
    out = ouro(tiny_target, tiny_target, REPEAT, dataclasses.replace(CFG, confidence=1e-9), **kw)
    assert out.tokens == fixed.tokens
    for k in ("c", "draft_calls", "suffix_tokens_accepted", "acceptance_histogram"):
        assert out.stats[k] == fixed.stats[k], k


def test_adaptive_sampling_identical_to_vanilla_same_seed(tiny_target, noisy_draft):
    """Sampling with cut chains: the target's draw at every position is keyed by (row,
    position), so lossless means the very tokens of vanilla sampling with the same seed."""
    kw = dict(max_new_tokens=32, eos_token_id=-1, temperature=0.7, top_k=30, top_p=0.95,
              seed=5)
    ref = oj.generate(tiny_target, REPEAT, **kw).tokens
    out = ouro(tiny_target, noisy_draft, REPEAT, dataclasses.replace(CFG, confidence=0.5), **kw)
    assert out.tokens == ref


def test_batch4_and_batch1_different_lengths(tiny_target, noisy_draft, random_prompts):
    short = [p for p in random_prompts if len(p) <= 16]
    prompts = [[7], REPEAT[0], short[0], REPEAT[4], short[1], [3, 4], REPEAT[1], short[2],
               short[3], REPEAT[3], [96], short[4]]
    kw = dict(max_new_tokens=24, eos_token_id=-1)
    ref = oj.generate(tiny_target, prompts, **kw).tokens
    for i in range(0, len(prompts), 4):
        out = ouro(tiny_target, noisy_draft, prompts[i:i + 4], **kw)
        assert out.tokens == ref[i:i + 4]
        check_stats(out.stats, 4)
    for p, r in zip(prompts[:8], ref):
        assert ouro(tiny_target, noisy_draft, [p], **kw).tokens[0] == r, p


@pytest.fixture(scope="module")
def repeat_full(tiny_target):
    return oj.generate(tiny_target, REPEAT, max_new_tokens=32, eos_token_id=-1).tokens


def test_eos_and_max_new_tokens_inside_draft_and_branch(tiny_target, repeat_full):
    # draft == target and a pool of vanilla's own n-grams: every round accepts the whole chain
    # and a whole branch (gamma + N tokens), so cut-offs land in both draft and branch parts
    full = repeat_full
    pool = ngram_pool(TINY_VOCAB, [p + o for p, o in zip(REPEAT, full)], CFG.ngram, CFG.guesses)
    per_round = CFG.gamma + CFG.ngram
    for k in range(1, 2 * per_round + 1):
        out = ouro(tiny_target, tiny_target, REPEAT, pool=pool, max_new_tokens=k,
                   eos_token_id=-1)
        assert out.tokens == [o[:k] for o in full], k
    assert out.stats["suffix_tokens_accepted"] > 0
    assert out.stats["acceptance_histogram"][per_round] > 0  # full chain + full branch + bonus
    n_cut = 0
    for pos in range(1, per_round + 3):
        eos = full[pos % len(REPEAT)][pos]
        ref = oj.generate(tiny_target, REPEAT, max_new_tokens=32, eos_token_id=eos).tokens
        got = ouro(tiny_target, tiny_target, REPEAT, pool=pool, max_new_tokens=32,
                   eos_token_id=eos)
        assert got.tokens == ref, pos
        check_stats(got.stats, len(REPEAT))
        # the draft's cache stays in step (catch-up prefix up to N tokens after a full branch):
        # draft == target accepts its whole chain in every round but a row's last
        assert sum(got.stats["acceptance_histogram"][:G1]) <= len(REPEAT)
        n_cut += sum(len(r) < 32 for r in ref)
    assert n_cut >= per_round


def test_full_pool_and_carried_pool(tiny_target, noisy_draft, random_prompts, repeat_full):
    kw = dict(max_new_tokens=32, eos_token_id=-1)
    # full: every slot of every key holds a random phrase
    rs = np.random.RandomState(0)
    g, m = CFG.guesses, CFG.ngram - 1
    keys = np.repeat(np.arange(TINY_VOCAB), g)
    full = insert_many(init_pool(TINY_VOCAB, g, m), jnp.asarray(keys, jnp.int32),
                       jnp.asarray(rs.randint(3, TINY_VOCAB, (len(keys), m)), jnp.int32))
    assert int(pool_occupancy(full)) == TINY_VOCAB * g
    for draft in (noisy_draft, tiny_target):
        out = ouro(tiny_target, draft, REPEAT, pool=full, **kw)
        assert out.tokens == repeat_full
        assert out.stats["pool_occupancy"] == TINY_VOCAB * g
        assert out.stats["pool_hit_rate"] == 1.0
    # carried over from unrelated prompts (history), then the same with history off
    other = ouro(tiny_target, noisy_draft, random_prompts[50:56], **kw)
    assert isinstance(other.pool, PhrasePool) and other.stats["pool_occupancy"] > 0
    carried = ouro(tiny_target, noisy_draft, REPEAT, pool=other.pool, **kw)
    assert carried.tokens == repeat_full
    fresh = ouro(tiny_target, noisy_draft, REPEAT, **kw)
    off = ouro(tiny_target, noisy_draft, REPEAT, dataclasses.replace(CFG, history=False),
               pool=other.pool, **kw)
    assert fresh.tokens == off.tokens == repeat_full
    assert off.stats["pool_occupancy"] == fresh.stats["pool_occupancy"]
    assert carried.stats["pool_occupancy"] > fresh.stats["pool_occupancy"]
    with pytest.raises(ValueError, match="pool"):
        ouro(tiny_target, noisy_draft, REPEAT, pool=init_pool(TINY_VOCAB, 4, 5), **kw)


# "all": every mechanism off, the SD step that config="auto" runs where none pays
ALL_OFF = ("phrase_drafting", "lengthening", "recycling", "context_phrases")


@pytest.mark.parametrize("switch", list(ALL_OFF) + ["all"])
def test_each_mechanism_off_alone(tiny_target, noisy_draft, random_prompts, repeat_full,
                                  switch):
    cfg = dataclasses.replace(CFG, **{s: False for s in (ALL_OFF if switch == "all"
                                                           else (switch,))})
    prompts = REPEAT + random_prompts[:2]
    kw = dict(max_new_tokens=32, eos_token_id=-1)
    ref = repeat_full + oj.generate(tiny_target, random_prompts[:2], **kw).tokens
    for draft in (noisy_draft, tiny_target):
        out = ouro(tiny_target, draft, prompts, cfg, **kw)
        assert out.tokens == ref, draft is tiny_target
        s = out.stats
        check_stats(s, len(prompts))
        if switch in ("phrase_drafting", "all"):
            assert s["c"] == 1.0
        if switch == "all":
            assert s["suffix_tokens_accepted"] == 0 and s["pool_hit_rate"] == 0.0
        if switch == "lengthening":
            assert s["suffix_tokens_accepted"] == 0 and s["pool_hit_rate"] == 0.0
            if draft is tiny_target:
                assert sum(s["acceptance_histogram"][:G1]) <= len(prompts)
                assert not any(s["acceptance_histogram"][G1 + 1:])  # no branch, no more
        elif switch == "recycling" and draft is tiny_target:
            assert s["suffix_tokens_accepted"] > 0  # the draft's n-grams alone feed branches


def test_sampling_identical_to_vanilla_same_seed(tiny_target, noisy_draft):
    kw = dict(max_new_tokens=32, eos_token_id=-1, temperature=0.7, top_k=30, top_p=0.95,
              seed=5)
    ref = oj.generate(tiny_target, REPEAT, **kw).tokens
    pool = ngram_pool(TINY_VOCAB, [p + o for p, o in zip(REPEAT, ref)], CFG.ngram, CFG.guesses)
    for draft, pl in ((noisy_draft, None), (tiny_target, pool)):
        out = ouro(tiny_target, draft, REPEAT, pool=pl, **kw)
        assert out.tokens == ref
    assert out.stats["suffix_tokens_accepted"] > 0 and out.stats["eta"] > 2


# context phrases: gamma 2, so that branches (keyed by d_gamma) are reached often on the
# 8-token model's copy prompts
CTX = {on: dataclasses.replace(CFG, gamma=2, context_phrases=on) for on in (True, False)}


def test_context_phrases_raise_eta_when_the_output_copies_the_prompt(small_vocab, copy_prompts):
    model = small_vocab[0]
    prompts, want = copy_prompts
    draft = noisy_copy(model)
    on, off = (ouro(model, draft, prompts, CTX[c], max_new_tokens=16, eos_token_id=-1)
               for c in (True, False))
    assert on.tokens == off.tokens == want
    check_stats(on.stats, len(prompts))
    assert on.stats["eta"] > off.stats["eta"]  # measured 3.28 against 2.98
    assert on.stats["suffix_tokens_accepted"] > off.stats["suffix_tokens_accepted"]


def test_context_phrases_sampling_identical_to_vanilla_same_seed(small_vocab, copy_prompts):
    model, prompts = small_vocab[0], copy_prompts[0]
    kw = dict(max_new_tokens=16, eos_token_id=-1, temperature=0.5, top_k=6, seed=3)
    ref = oj.generate(model, prompts, **kw).tokens
    out = ouro(model, noisy_copy(model), prompts, CTX[True], **kw)
    assert out.tokens == ref and out.stats["suffix_tokens_accepted"] > 0


def _three_token_probs(tm, prompt, temperature):
    """Exact P(t1, t2, t3) under temperature sampling, from transformers: [8, 8, 8]."""
    with torch.no_grad():
        def nxt(seqs):
            return torch.softmax(tm(torch.tensor(seqs)).logits[:, -1] / temperature, -1)
        p1 = nxt([prompt])[0]
        p2 = nxt([prompt + [a] for a in range(8)])  # [8, 8]
        p3 = nxt([prompt + [a, b] for a in range(8) for b in range(8)]).reshape(8, 8, 8)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy().astype(np.float64)


def _chi2_p(counts, probs):
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_first_three_tokens_distribution_with_branches(small_vocab):
    """gamma = 1: token 1 from the root, token 2 at d_1, token 3 at a branch head, so a branch
    taken decides whether the third token comes from this round."""
    model, tm = small_vocab
    prompt, temperature, n = [1, 5, 3, 6], 0.7, 4000
    want = _three_token_probs(tm, prompt, temperature)
    cfg = OuroborosConfig(gamma=1, window=3, ngram=3, guesses=4, suffixes=3)
    d1 = int(np.argmax(want.sum((1, 2))))  # the (greedy) draft's first token
    top = np.argsort(want[d1].ravel())[::-1][:3]  # likeliest (t2, t3) after d1
    pool = insert_many(init_pool(8, 4, 2), jnp.full((3,), d1, jnp.int32),
                       jnp.asarray([[t // 8, t % 8] for t in top], jnp.int32))
    out = ouro(model, model, [prompt] * n, cfg, pool=pool, max_new_tokens=3,
               temperature=temperature, seed=31, eos_token_id=-1)
    assert out.stats["suffix_tokens_accepted"] > n // 10  # branches really were taken
    counts = np.zeros(512)
    for t in out.tokens:
        counts[t[0] * 64 + t[1] * 8 + t[2]] += 1
    assert _chi2_p(counts, want.ravel()) > 1e-3
    wrong = _three_token_probs(tm, prompt, 1.0)
    assert _chi2_p(counts, wrong.ravel()) < 1e-6


def test_no_recompile_and_prompt_near_cache_limit(tiny_target, noisy_draft):
    from ouroboros_jax.decoding.ouroboros import run_ouroboros

    kw = dict(max_new_tokens=10, eos_token_id=-1)
    ouro(tiny_target, noisy_draft, [[5, 6, 7]], **kw)
    size = run_ouroboros._cache_size()
    a = ouro(tiny_target, noisy_draft, [[9, 8, 7, 6, 5, 4, 3, 9, 8]], max_new_tokens=20,
             eos_token_id=5)
    ouro(tiny_target, noisy_draft, [[3] * 16], dataclasses.replace(CFG, history=False),
         pool=a.pool, max_new_tokens=30, eos_token_id=-1)
    assert run_ouroboros._cache_size() == size
    rs = np.random.RandomState(9)
    long_prompt = rs.randint(3, TINY_VOCAB, size=1000).tolist()  # 1000 + 24 = the 1024 limit
    ref = oj.generate(tiny_target, [long_prompt], max_new_tokens=24, eos_token_id=-1).tokens
    assert ouro(tiny_target, tiny_target, [long_prompt], max_new_tokens=24,
                eos_token_id=-1).tokens == ref


def test_mesh_gives_same_tokens(tiny_target, noisy_draft, random_prompts):
    from ouroboros_jax.sharding import make_mesh

    prompts = random_prompts[:4] + REPEAT[:4]
    kw = dict(max_new_tokens=16, eos_token_id=-1)
    ref = ouro(tiny_target, noisy_draft, prompts, **kw).tokens
    got = ouro(tiny_target, noisy_draft, prompts, mesh=make_mesh(2, 4), **kw).tokens
    assert got == ref


def test_caches_are_placed_on_the_mesh(tiny_target, noisy_draft):
    """Under a mesh every method's empty caches take `sharding.cache_spec`'s layout (rows over
    "data", kv heads over "model"), not whatever XLA gives a buffer of zeros."""
    import jax
    from jax.sharding import NamedSharding

    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.common import make_pair
    from ouroboros_jax.sharding import cache_spec, make_mesh, shard_model

    mesh = make_mesh(2, 2)
    pair = make_pair(shard_model(tiny_target, mesh), shard_model(noisy_draft, mesh))
    assert pair.mesh is mesh
    for name in ("vanilla", "speculative", "lookahead", "ouroboros"):
        spec = METHODS[name]
        cfg = spec.quick_config() if spec.quick_config else None
        loop_cfg, pool = spec.prepare(cfg, None, tiny_target.config.vocab_size) \
            if spec.prepare else (cfg, None)
        state = jax.jit(spec.init, static_argnums=(1, 2, 3))(pair, loop_cfg, 4, 64, pool)
        for attr, cfg_m in (("cache", pair.tconfig), ("tcache", pair.tconfig),
                            ("dcache", pair.dconfig)):
            if hasattr(state, attr):
                k = getattr(state, attr).k
                want = NamedSharding(mesh, cache_spec(cfg_m, 4, 64, mesh))
                assert k.sharding.is_equivalent_to(want, k.ndim), (name, attr, k.sharding)


# -- per-mechanism accounting: a round traces exactly the forwards its cost model prices

def _traced_forwards(monkeypatch, pair, round_fn, state):
    """[(model, tokens, logits rows)] of every forward one traced round contains, in order
    (a forward inside a loop body counts once)."""
    import jax

    from ouroboros_jax.decoding import common, jacobi, ouroboros, speculative
    from ouroboros_jax.models import llama

    seen = []

    def recording(params, config, tokens, positions, mask, cache=None, select=None):
        n = tokens.shape[1]
        seen.append(("target" if config == pair.tconfig else "draft", n,
                     n if select is None else select.shape[1]))
        return llama.forward(params, config, tokens, positions, mask, cache, select)

    for mod in (common, jacobi, ouroboros, speculative):
        monkeypatch.setattr(mod, "forward", recording)
    jax.eval_shape(round_fn, state)
    return seen


def _round(method, pair, cfg, greedy=True):
    """(round_fn(state) -> state, an empty state of 2 rows) of a method's seam."""
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.common import Limits
    from ouroboros_jax.pool import prepare_pool
    from ouroboros_jax.sampling import SamplingParams

    spec = METHODS[method]
    pool = None
    if method == "ouroboros":
        pool = prepare_pool(None, pair.tconfig.vocab_size, cfg.guesses, cfg.ngram - 1, None, True)
    state = spec.init(pair, cfg, 2, 64, pool)
    limits = Limits(max_new_tokens=jnp.int32(8), eos_token_id=jnp.array([-1], jnp.int32))
    sp = SamplingParams(temperature=jnp.float32(0.7), top_k=jnp.int32(0), top_p=jnp.float32(1.0),
                        seed=jnp.uint32(0))
    return (lambda st: spec.round(pair, cfg, greedy, sp, limits, st)), state


@pytest.mark.parametrize("gamma", [1, 3])
def test_mechanisms_off_traces_speculative_forwards(monkeypatch, tiny_pair, gamma):
    """Every mechanism off, an Ouroboros round is speculative decoding's round: the same
    forwards of the same sizes (draft: the loop's 1-token forward, which also catches up;
    target: the gamma + 1 chain), nothing else."""
    from ouroboros_jax.decoding.common import make_pair

    pair = make_pair(tiny_pair[0], tiny_pair[1])
    off = OuroborosConfig(gamma=gamma, window=2, ngram=3, guesses=2, suffixes=1,
                          **{s: False for s in ALL_OFF})
    spec = _traced_forwards(monkeypatch, pair, *_round("speculative", pair,
                                                       oj.SpeculativeConfig(gamma=gamma)))
    ours = _traced_forwards(monkeypatch, pair, *_round("ouroboros", pair, off))
    assert spec == [("draft", 1, 1), ("target", gamma + 1, gamma + 1)]
    assert ours == spec


@pytest.mark.parametrize("on", ALL_OFF + ("all",))
def test_each_mechanism_traces_the_forwards_its_cost_model_prices(monkeypatch, tiny_pair, on):
    """One mechanism on (or all): the round traces the first draft forward (but where token
    drafting's loop catches up itself), the loop's draft forward and the target forward at
    exactly the sizes `forward_sizes` gives the cost model (and the lookahead step's logits
    rows), and no other forward."""
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.common import make_pair

    pair = make_pair(tiny_pair[0], tiny_pair[1])
    cfg = CFG if on == "all" else dataclasses.replace(
        CFG, **{s: s == on for s in ALL_OFF})
    n_t, n_s, n_first = METHODS["ouroboros"].forward_sizes(cfg)
    q = 1 + cfg.window + cfg.guesses * (cfg.ngram - 1) if cfg.phrase_drafting else 1
    # token drafting without branches: the loop's one-token forward catches up too (no first
    # forward of its own, n_first = 1)
    own_first = cfg.phrase_drafting or cfg.lengthening
    assert own_first or n_first == n_s == 1
    want = [("draft", n_first, q)] * own_first + [("draft", n_s, q), ("target", n_t, n_t)]
    assert _traced_forwards(monkeypatch, pair, *_round("ouroboros", pair, cfg)) == want
    assert _traced_forwards(monkeypatch, pair, *_round("ouroboros", pair, cfg, False)) == want


def test_mechanisms_off_runs_speculative_forward_counts(tiny_target, noisy_draft,
                                                        random_prompts):
    """At run time too: the same rounds, the same draft forwards, the same tokens."""
    off = OuroborosConfig(gamma=3, window=2, ngram=3, guesses=2, suffixes=1,
                          **{s: False for s in ALL_OFF})
    prompts = random_prompts[:3]
    kw = dict(max_new_tokens=24, eos_token_id=-1)
    spec = oj.generate(tiny_target, prompts, draft=noisy_draft, method="speculative",
                       config=oj.SpeculativeConfig(gamma=3), **kw)
    ours = ouro(tiny_target, noisy_draft, prompts, off, **kw)
    assert ours.tokens == spec.tokens
    assert ours.stats["target_calls"] == spec.stats["target_calls"]
    # γ a round, and one more catching up where the last round accepted a whole chain
    assert ours.stats["draft_forwards"] == spec.stats["draft_calls"] <= 4 * spec.stats[
        "target_calls"]
    assert ours.stats["acceptance_histogram"][:5] == spec.stats["acceptance_histogram"][:5]
