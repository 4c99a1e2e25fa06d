"""Tests for method="speculative": greedy tokens equal vanilla's token for token (batched and
not, EOS inside a draft, max_new_tokens inside an accepted block, length-1 prompts, prompts at
the cache limit, draft == target and an unrelated draft), the stats, and the sampled
distribution of the first generated tokens against the exact one (chi-square), with a wrong
acceptance rule shown to fail the same test.

Compiled loops are shared: every greedy call has B = 8 rows (or 1), prompt bucket 64 and 128
cache slots; max_new_tokens and EOS are arrays, so changing them never recompiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import ouroboros_jax as oj
from ouroboros_jax.decoding import speculative
from ouroboros_jax.decoding.common import (Limits, Pair, counter, init_sequences, init_stats,
                                          make_pair, prefill)
from ouroboros_jax.decoding.speculative import SpeculativeConfig, leviathan_accept
from ouroboros_jax.models import forward
from ouroboros_jax.models.llama import causal_mask
from ouroboros_jax.sampling import SamplingParams, process_logits

from conftest import make_hf_model

GAMMA = 4
CFG = SpeculativeConfig(gamma=GAMMA)
B = 8
NEW = 40  # 8 full rounds of γ+1 when everything is accepted
NO_EOS = -1


@pytest.fixture(scope="module")
def chunks(random_prompts):
    """64 prompts (the 60 random ones + 4 of length 1) in 8 batches of 8, each batch holding
    one of the 8 longest prompts so every batch lands in the same prompt bucket (64)."""
    prompts = sorted(random_prompts + [[5], [17], [42], [96]], key=len, reverse=True)
    out = [prompts[i::B] for i in range(B)]
    assert all(len(c) == B and 32 < max(map(len, c)) <= 64 for c in out)
    return out


@pytest.fixture(scope="module")
def vanilla_out(tiny_target, chunks):
    """Vanilla greedy tokens of every batch, no EOS."""
    return [oj.generate(tiny_target, c, max_new_tokens=NEW, eos_token_id=NO_EOS).tokens
            for c in chunks]


def spec(target, draft, prompts, **kw):
    return oj.generate(target, prompts, draft=draft, method="speculative", config=CFG, **kw)


def pick_draft(tiny_pair, kind):
    target, draft, _ = tiny_pair
    return target if kind == "self" else draft


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("kind", ["self", "unrelated"])
def test_greedy_batched_equals_vanilla(tiny_pair, chunks, vanilla_out, kind):
    target, draft = tiny_pair[0], pick_draft(tiny_pair, kind)
    rounds, hist = 0, np.zeros(GAMMA + 2, int)
    for c, want in zip(chunks, vanilla_out):
        out = spec(target, draft, c, max_new_tokens=NEW, eos_token_id=NO_EOS)
        assert out.tokens == want
        s = out.stats
        # γ a round but where a row's budget ends the chain sooner (`chain_may_grow`), and one
        # more where the draft is a token behind (its whole chain was accepted: `_draft_in_loop`)
        assert s["draft_calls"] <= (GAMMA + 1) * s["target_calls"] and s["c"] == 1.0
        if kind == "self":  # every round but the first follows a whole chain accepted
            assert s["draft_calls"] == GAMMA * s["target_calls"] + s["target_calls"] - 1
        h = np.array(s["acceptance_histogram"])
        assert h @ np.arange(GAMMA + 2) == s["new_tokens"] == B * NEW
        assert h.sum() <= B * s["target_calls"] and h[0] == 0  # live rows always gain a token
        rounds += s["target_calls"]
        hist += np.array(s["acceptance_histogram"])
    if kind == "self":
        # everything accepted: γ+1 tokens in every round of every row, η = γ+1 exactly
        assert rounds == len(chunks) * NEW // (GAMMA + 1)
        assert hist.tolist() == [0] * (GAMMA + 1) + [len(chunks) * B * NEW // (GAMMA + 1)]
    else:
        eta = len(chunks) * B * NEW / hist.sum()
        assert eta < 1.2 and hist[1] > 0.8 * hist.sum()


@pytest.mark.parametrize("kind", ["self", "unrelated"])
@pytest.mark.parametrize("new", [1, 7, 13])
def test_max_new_tokens_inside_a_block(tiny_pair, chunks, vanilla_out, kind, new):
    target, draft = tiny_pair[0], pick_draft(tiny_pair, kind)
    out = spec(target, draft, chunks[0], max_new_tokens=new, eos_token_id=NO_EOS)
    assert out.tokens == [t[:new] for t in vanilla_out[0]]  # greedy: a prefix, never more
    if kind == "self":
        full, rest = divmod(new, GAMMA + 1)
        hist = [0] * (GAMMA + 2)
        hist[GAMMA + 1] += full * B
        hist[rest] += B if rest else 0
        assert out.stats["acceptance_histogram"] == hist
        # the last round drafts only what can be emitted: rest - 1 tokens, the target's own
        # last (its first draft forward always runs); every round after the first catches up on
        # the last round's last draft first (one forward: `_draft_in_loop`)
        rounds = full + (1 if rest else 0)
        assert out.stats["draft_calls"] == (full * GAMMA + (max(1, rest - 1) if rest else 0)
                                            + rounds - 1)


def test_draft_chain_ends_at_an_eos(tiny_target, chunks, vanilla_out):
    """A self-draft drafts vanilla's tokens; once it drafts the EOS id its chain ends there
    (nothing after an EOS is ever emitted), so the last round runs k % (γ+1) + 1 draft forwards
    (and one catching up, after a first round) where an EOS at output index k lies inside a
    chain."""
    row = vanilla_out[1][0]
    k = next(i for i in range(1, NEW) if i % (GAMMA + 1) in (1, 2) and row[i] not in row[:i])
    out = spec(tiny_target, tiny_target, [chunks[1][0]], max_new_tokens=NEW, eos_token_id=row[k])
    assert out.tokens == [row[:k + 1]]
    assert out.stats["target_calls"] == k // (GAMMA + 1) + 1
    # (and a catch-up forward in each round after the first: `_draft_in_loop`)
    assert out.stats["draft_calls"] == (GAMMA + 1) * (k // (GAMMA + 1)) + k % (GAMMA + 1) + 1


@pytest.mark.parametrize("kind", ["self", "unrelated"])
def test_eos_inside_a_draft(tiny_pair, chunks, vanilla_out, kind):
    target, draft = tiny_pair[0], pick_draft(tiny_pair, kind)
    # the token vanilla emits most often strictly inside a block of γ+1 (not at its end)
    toks = np.array(vanilla_out[1])
    inside = toks[:, [i for i in range(NEW) if (i + 1) % (GAMMA + 1)]]
    eos = int(np.bincount(inside.ravel()).argmax())
    want = oj.generate(target, chunks[1], max_new_tokens=NEW, eos_token_id=eos).tokens
    cut = [row.index(eos) + 1 for row in vanilla_out[1] if eos in row]
    assert any(k % (GAMMA + 1) for k in cut) and len(cut) >= 2
    assert want == [row[:row.index(eos) + 1] if eos in row else row for row in vanilla_out[1]]
    out = spec(target, draft, chunks[1], max_new_tokens=NEW, eos_token_id=eos)
    assert out.tokens == want


@pytest.mark.parametrize("kind", ["self", "unrelated"])
def test_prompts_at_the_cache_limit(tiny_pair, chunks, kind):
    # longest prompt fills the 64 bucket and prompt + max_new_tokens + γ+1 = 128 slots exactly
    target, draft = tiny_pair[0], pick_draft(tiny_pair, kind)
    rs = np.random.RandomState(7)
    prompts = [rs.randint(3, 97, size=64).tolist()] + chunks[2][1:]
    new = 128 - 64 - (GAMMA + 1)
    kw = dict(max_new_tokens=new, eos_token_id=NO_EOS, max_cache_len=64 + new)
    want = oj.generate(target, prompts, **kw).tokens
    out = spec(target, draft, prompts, **kw)
    assert out.tokens == want and all(len(t) == new for t in out.tokens)
    with pytest.raises(ValueError, match="cache limit"):
        spec(target, draft, prompts, **{**kw, "max_cache_len": 63 + new})


def test_greedy_batch_1_equals_vanilla(tiny_pair, chunks, vanilla_out):
    target, draft, _ = tiny_pair
    for i in range(4):  # batch 1 against the batched vanilla rows
        out = spec(target, draft, [chunks[i][0]], max_new_tokens=NEW, eos_token_id=NO_EOS)
        assert out.tokens == [vanilla_out[i][0]]
        assert out.stats["target_calls"] == sum(out.stats["acceptance_histogram"])


def test_draft_kv_stays_in_step_without_reforward(tiny_pair):
    """Rounds by hand, draft == target: after a fully accepted round the draft holds every
    token but the last two (dγ is accepted but unprocessed; the bonus is pending), after a cut
    round all but the pending one; its K/V equal the target's, so nothing is recomputed and
    nothing is stale."""
    target = tiny_pair[0]
    params, config = target.params, target.config
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10], [11, 12, 0, 0, 0, 0]], jnp.int32)
    plens = jnp.asarray([6, 2], jnp.int32)
    slots = 32
    state = speculative.SpeculativeState(
        init_sequences(prompt, plens, slots),
        prefill(params, config, prompt, plens, slots, jnp.float32),
        prefill(params, config, prompt, plens, slots, jnp.float32),
        init_stats(2, GAMMA + 2, speculative.SpeculativeCounters(
                drafted_tokens=counter(), whole_histogram=jnp.zeros((GAMMA + 2,), jnp.int32))))
    limits = Limits(max_new_tokens=jnp.asarray(2 * (GAMMA + 1) + 2, jnp.int32),
                    eos_token_id=jnp.asarray(-1, jnp.int32))
    step = jax.jit(speculative.speculative_step, static_argnums=(1, 2))
    pair = Pair(tparams=params, dparams=params, tconfig=config, dconfig=config)
    # 5, 5, then 2 tokens: the budget ends the last chain at one draft (`chain_may_grow`),
    # accepted but unprocessed like a full chain's last
    for r, lag in ((1, 1), (2, 1), (3, 1)):
        state = step(pair, SpeculativeConfig(gamma=GAMMA), True, SamplingParams.make(), limits,
                     state)
        n = np.asarray(state.seq.lengths)
        np.testing.assert_array_equal(n, np.asarray(plens) + min(r * (GAMMA + 1), 12))
        np.testing.assert_array_equal(np.asarray(state.tcache.lengths), n - 1)
        np.testing.assert_array_equal(np.asarray(state.dcache.lengths), n - 1 - lag)
        for b in range(2):
            d = n[b] - 1 - lag
            np.testing.assert_allclose(np.asarray(state.dcache.k[:, b, :d]),
                                       np.asarray(state.tcache.k[:, b, :d]), atol=1e-4)
    assert bool(state.seq.done.all())


def test_config_validation(tiny_target):
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="gamma"):
            SpeculativeConfig(gamma=bad)
    with pytest.raises(ValueError, match="draft"):
        oj.generate(tiny_target, [[5, 6]], method="speculative")
    assert speculative.SPEC.margin(SpeculativeConfig(gamma=6)) == 7


# ----------------------------------------------------------------------------- sampling

SV = 6  # tiny vocabulary: 6**3 = 216 outcomes of the first 3 tokens
S_GAMMA = 2  # 3 tokens cross a rejection at depth 1 or 2, a bonus, and the draft catching up
S_ROWS, S_SEEDS = 3000, (11, 12)
S_KW = dict(temperature=0.8, top_k=5, top_p=0.97)
S_PROMPT = [3, 5, 4, 1]
S_NEW = 3


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    td, dd = tmp_path_factory.mktemp("small_t"), tmp_path_factory.mktemp("small_d")
    # small weight noise: flat enough that ~125 of the 216 outcomes have mass, and the
    # draft's distribution far from the target's (total variation ~0.6)
    make_hf_model(td, vocab=SV, seed=5, scale=0.05)
    make_hf_model(dd, vocab=SV, layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=6,
                  scale=0.05)
    return oj.load_model(str(td)), oj.load_model(str(dd))


def exact_distribution(model):
    """P(t1, t2, t3 | prompt) under vanilla sampling's processed distribution: [SV]*3."""
    sp = SamplingParams.make(**S_KW)
    pre = np.array([S_PROMPT + [a, b] for a in range(SV) for b in range(SV)], np.int32)
    n, T = pre.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (n, T))
    logits, _ = forward(model.params, model.config, jnp.asarray(pre), pos, causal_mask(n, T))
    p = np.exp(np.asarray(process_logits(logits[:, -3:], sp), np.float64))  # [n, 3, SV]
    p = p.reshape(SV, SV, 3, SV)
    return p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]


def counts_of(outputs):
    counts = np.zeros((SV,) * S_NEW, int)
    for toks in outputs:
        toks = np.asarray(toks)
        assert toks.shape == (S_ROWS, S_NEW)
        np.add.at(counts, tuple(toks.T), 1)
    return counts


def generated(target, draft, seed, confidence=0.0):
    """The public path: S_ROWS copies of the prompt in one call (rows draw with their own
    keys)."""
    out = oj.generate(target, [S_PROMPT] * S_ROWS, draft=draft, method="speculative",
                      config=SpeculativeConfig(gamma=S_GAMMA, confidence=confidence),
                      max_new_tokens=S_NEW, eos_token_id=NO_EOS, seed=seed, **S_KW)
    if confidence == 0:  # a chain of S_NEW - 1 drafts at most: more could never be emitted
        assert out.stats["draft_calls"] <= S_GAMMA * out.stats["target_calls"]
    else:  # some rows stop after their first draft token
        assert out.stats["drafted_tokens"] < S_GAMMA * S_ROWS * out.stats["target_calls"]
    return out.tokens


def generated_with_rule(target, draft, seed, accept_rule):
    """The same loop with another (static) acceptance rule, called below `generate`."""
    prompt = jnp.asarray([S_PROMPT] * S_ROWS, jnp.int32)
    plens = jnp.full((S_ROWS,), len(S_PROMPT), jnp.int32)
    limits = Limits(max_new_tokens=jnp.asarray(S_NEW, jnp.int32),
                    eos_token_id=jnp.asarray(NO_EOS, jnp.int32))
    seq, _, _ = speculative.run_speculative(
        make_pair(target, draft), prompt, plens, limits, SamplingParams.make(**S_KW, seed=seed),
        None, cfg=SpeculativeConfig(gamma=S_GAMMA), slots=16, greedy=False,
        accept_rule=accept_rule)
    assert (np.asarray(seq.lengths) == len(S_PROMPT) + S_NEW).all()
    return np.asarray(seq.tokens)[:, len(S_PROMPT):len(S_PROMPT) + S_NEW]


def chi2_pvalue(counts, probs):
    """Chi-square goodness of fit; outcomes of expected count < 5 pooled into one cell.
    An outcome of probability 0 that was sampled fails outright."""
    n = counts.sum()
    counts, probs = counts.ravel(), probs.ravel() / probs.sum()
    if counts[probs == 0].sum():
        return 0.0
    small = probs * n < 5
    obs, exp = counts[~small], probs[~small] * n
    if probs[small].sum() > 0:
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, probs[small].sum() * n)
    return sps.chisquare(obs, exp).pvalue


def always_accept(logp, logq, drafts, keys, drafted=None):
    """A wrong rule: p replaced by q at the draft positions, so every draft token passes."""
    G = drafts.shape[1]
    return leviathan_accept(logp.at[:, :G].set(logq), logq, drafts, keys, drafted)


def test_sampling_matches_vanilla_distribution(small_pair):
    target, draft = small_pair
    probs = exact_distribution(target)
    assert (probs == 0).any()  # top-k / top-p cut something: zero cells are checked too
    runs = [generated(target, draft, seed) for seed in S_SEEDS]
    assert generated(target, draft, S_SEEDS[0]) == runs[0]  # reproducible for a seed
    assert runs[0] != runs[1]
    p_right = chi2_pvalue(counts_of(runs), probs)
    p_wrong = chi2_pvalue(counts_of(
        [generated_with_rule(target, draft, seed, always_accept) for seed in S_SEEDS]), probs)
    print(f"chi-square p-values: leviathan {p_right:.3g}, always-accept {p_wrong:.3g}")
    assert p_right > 1e-3, p_right
    assert p_wrong < 1e-6, p_wrong


# ----------------------------------------------------------------------------- adaptive drafting


@pytest.mark.parametrize("confidence", [0.3, 0.6, 0.95])
def test_adaptive_greedy_equals_vanilla_and_drafts_less(tiny_pair, chunks, vanilla_out, confidence):
    target, draft, _ = tiny_pair
    cfg = SpeculativeConfig(gamma=GAMMA, confidence=confidence)
    fixed = oj.generate(target, chunks[0], draft=draft, method="speculative", config=CFG,
                        max_new_tokens=NEW, eos_token_id=NO_EOS)
    out = oj.generate(target, chunks[0], draft=draft, method="speculative", config=cfg,
                      max_new_tokens=NEW, eos_token_id=NO_EOS)
    assert out.tokens == vanilla_out[0]
    s = out.stats
    # every row proposes at least one token a round, at most gamma
    assert s["drafted_tokens"] <= GAMMA * B * s["target_calls"]
    assert s["draft_calls"] <= (GAMMA + 1) * s["target_calls"]
    if confidence >= 0.6:  # random tiny models are rarely that sure: chains get cut
        assert s["draft_calls"] < fixed.stats["draft_calls"]
        assert s["drafted_tokens"] < fixed.stats["drafted_tokens"]


def test_adaptive_self_draft_never_stops_early(tiny_target, chunks, vanilla_out):
    """A draft equal to the target at confidence 1e-6 keeps every chain whole: the cut happens
    only below the threshold, and every token is accepted."""
    cfg = SpeculativeConfig(gamma=GAMMA, confidence=1e-6)
    out = oj.generate(tiny_target, chunks[1], draft=tiny_target, method="speculative", config=cfg,
                      max_new_tokens=NEW, eos_token_id=NO_EOS)
    assert out.tokens == vanilla_out[1]
    # γ drafts a round, and a catch-up forward in each round after the first
    assert out.stats["draft_calls"] == (GAMMA + 1) * out.stats["target_calls"] - 1
    assert out.stats["drafted_tokens"] == GAMMA * B * out.stats["target_calls"]
    assert out.stats["eta"] == pytest.approx(GAMMA + 1)


def test_adaptive_sampling_matches_vanilla_distribution(small_pair):
    """Adaptive chains (the draft stops below confidence 0.3, so rows verify chains of 1 or 2)
    keep the Leviathan/Chen rule lossless."""
    target, draft = small_pair
    probs = exact_distribution(target)
    runs = [generated(target, draft, seed, confidence=0.3) for seed in S_SEEDS]
    p = chi2_pvalue(counts_of(runs), probs)
    print(f"chi-square p-value, adaptive: {p:.3g}")
    assert p > 1e-3, p


def test_confidence_validation():
    for bad in (-0.1, 1.0, "0.5", True, None):
        with pytest.raises(ValueError, match="confidence"):
            SpeculativeConfig(gamma=2, confidence=bad)


def test_the_lag_rides_the_one_token_loop_on_one_device_only():
    """`lag_catch_up`: the draft's one-token lag is fed through its one-token loop (catch_up 1)
    where the pair is on one device, and by a two-token first forward where it is on a mesh of
    several (the in-loop program, read back from the persistent compile cache, left an
    8-device CPU all-reduce stuck until XLA aborted; tests/test_mesh_exact.py decodes there)."""
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    assert speculative.lag_catch_up(Pair(tparams=None)) == 1
    assert speculative.lag_catch_up(Pair(tparams=None, mesh=Mesh(devs[:1], ("data",)))) == 1
    assert speculative.lag_catch_up(Pair(tparams=None, mesh=Mesh(devs[:2], ("data",)))) == 2
