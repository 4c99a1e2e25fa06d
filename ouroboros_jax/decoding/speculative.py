"""Token-level speculative decoding (Leviathan et al. 2023, Chen et al. 2023), the whole loop on
device.

One round per row of length n (pending token x at position n-1, both caches holding n-1 or,
for the draft, possibly n-2 tokens):

  1. the draft proposes d1..dγ, one forward each (the first forward also catches up on the one
     token the draft has not processed yet, if any: see below);
  2. the target scores the chain [x, d1..dγ] in one forward (mask and positions from the tree
     primitive over `chain_parents(γ+1)`);
  3. acceptance: greedy, the shared accept walk over the chain (exactly vanilla's tokens);
     sampling, the Leviathan/Chen rule: accept d_i with probability min(1, p_i(d_i)/q_i(d_i)),
     at the first rejection draw from norm(max(p - q, 0)), and if all γ pass draw a bonus
     token from the target's last distribution. The output is distributed as vanilla sampling;
  4. `emit` applies EOS / max_new_tokens cut-offs; the target cache commits the accepted chain
     prefix; the draft cache is rolled back to the accepted length (no re-forward).

The draft's KV: after γ forwards the draft has processed x, d1..d(γ-1). When every draft token is
accepted (plus a bonus b), dγ is accepted but unprocessed, so the draft cache holds n'-2 tokens
of the new length n'; otherwise it holds n'-1. The next round's first draft forward therefore
takes the two tokens at positions [draft_len, draft_len+1] as a causal chain and reads the
logits at the pending token (for rows already caught up, the second token is ignored).

Random keys (sampling): `token_key(seed, stream, position)` folded with a purpose constant, so
the draft's draws, the uniform accept tests and the target's residual/bonus draw never share a
key. In a sampling loop, rows marked greedy (`SamplingParams.greedy_rows`, the serving engine's
greedy requests) draft their argmax and take the greedy accept walk.

Seam functions (decoding/spec.py): `speculative_init`, `speculative_insert`, `speculative_step`
(one round), `speculative_plain` (a round without drafting: the engine's "speculation off" load
level), `speculative_finish`; `run_speculative` is generate's loop over them.

Letters (package glossary): B rows, γ (`gamma`) draft tokens per round, V vocab, S cache slots.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache, partial
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from ..bounds import MAX_TREE_TOKENS
from ..models import forward
from ..models.kv_cache import KVCache, commit_prefix, rollback, settle
from ..sampling import (SamplingParams, greedy_where, process_logits, token_keys,
                        token_probability)
from ..tree import chain_parents, tree_depths, tree_mask
from .common import (Limits, Pair, Sequences, Stats, chain_may_grow, check_fraction, check_int,
                     count_round, counter, counters_dict, emit, empty_cache, empty_sequences,
                     follow_draft, init_stats, insert_sequences, make_runner, plain_step,
                     proposing, prefill_rows, source_labels, whole_counted)
from . import constrained
from .cost import (ROUND_OVERHEAD, RoundModel, agreement_from_eta,
                   depth_counts, expected_tokens)
from .knobs import GAMMA, KnobSpace
from .logprobs import walk_logprobs
from .spec import MethodSpec
from .verify import Accepted, accept_walk, commit_path

# Purposes folded into token_key(seed, row, position) for the Leviathan rule.
DRAFT_KEY, ACCEPT_KEY, TARGET_KEY = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """gamma: most tokens the draft proposes per round (docs/algorithm.md: 4-6 for text, 10-12 code).

    confidence: adaptive drafting. A row stops extending its chain after a draft token whose
    probability under the draft (its processed distribution when sampling, its softmax when
    greedy) is below `confidence`; the round's draft forwards end when every row has stopped.
    The target still scores a fixed gamma + 1 chain (static shape); undrafted slots are masked
    out of acceptance. 0 (default) drafts gamma tokens every round. The stopping rule looks only
    at the draft's own probabilities, so greedy output stays vanilla's and sampling stays
    lossless (the Leviathan/Chen rule over a chain of any length fixed before verification).
    """

    gamma: int = 4
    confidence: float = 0.0

    KNOBS: ClassVar[KnobSpace] = KnobSpace(knobs=(GAMMA,))

    def __post_init__(self):
        # the target scores gamma + 1 tokens a round
        check_int(self, "gamma", 1, MAX_TREE_TOKENS - 1)
        check_fraction(self, "confidence")


@struct.dataclass
class SpeculativeCounters:
    """Speculative decoding's own counters. drafted_tokens: int32[], tokens proposed (adaptive
    drafting proposes fewer than gamma). whole_histogram: int32[γ + 2], the rounds whose chain
    the draft offered whole (all γ tokens) by tokens kept, as `acceptance_histogram` bins
    them: what auto reads the pair's agreement from (`chain_lesson`). A chain the row's end
    stopped early (an EOS drafted, the row's budget) would read as a rejection at the depth
    where it stopped: on short answers (30-token JSON objects) one round in four ended so, and
    the real pair's agreement by depth read 0.92-0.96 where its whole chains keep nearly
    every token."""

    drafted_tokens: jax.Array
    whole_histogram: jax.Array

    def to_dict(self) -> dict:
        return counters_dict(self)


@struct.dataclass
class SpeculativeState:
    """The carry of speculative decoding's while_loop.

    Attributes:
        seq: the token buffer; its last token per row is pending (in neither cache).
        tcache: the target's KV cache (lengths - 1 tokens).
        dcache: the draft's KV cache (lengths - 1, or lengths - 2 after a fully accepted round:
            the draft then catches up on one token in its next first forward).
        stats: the on-device counters (`common.Stats`), own = `SpeculativeCounters`.
    """

    seq: Sequences
    tcache: KVCache  # target: lengths - 1 tokens
    dcache: KVCache  # draft: lengths - 1 or lengths - 2 tokens (see the module docstring)
    stats: Stats


def _fold(keys: jax.Array, purpose: int) -> jax.Array:
    return jax.vmap(jax.vmap(lambda k: jax.random.fold_in(k, purpose)))(keys)


def _draw(logits: jax.Array, keys, sp: SamplingParams, greedy: bool):
    """Draft's token: logits [B,T,V], keys [B,T] (None when greedy) -> (tokens int32[B,T],
    logq [B,T,V] or None when greedy). logq is the processed distribution drawn from."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    logq = process_logits(logits, sp)
    draw = jax.vmap(jax.vmap(jax.random.categorical))
    tok = draw(_fold(keys, DRAFT_KEY), logq).astype(jnp.int32)
    return greedy_where(sp, jnp.argmax(logits, axis=-1).astype(jnp.int32), tok), logq


def _confidence(logits: jax.Array, drafts: jax.Array, logq, greedy: bool,
                sp: SamplingParams = None) -> jax.Array:
    """Probability the draft gave its own token: logits [B,T,V], drafts int32[B,T] -> f32[B,T]
    (from logq, the distribution drawn from, when sampling; the plain softmax when greedy, and
    for the greedy rows of a sampling loop)."""
    if greedy:
        return token_probability(logits, drafts)
    sampled = jnp.exp(jnp.take_along_axis(logq, drafts[..., None], -1)[..., 0])
    if sp is None or sp.greedy_rows is None:
        return sampled
    return greedy_where(sp, token_probability(logits, drafts), sampled)


def draft_propose(params, model_config, gamma: int, greedy: bool, sp: SamplingParams,
                  keys, seq: Sequences, cache: KVCache, confidence: float = 0.0,
                  catch_up: int = 2, guard=None, limits=None):
    """Up to γ draft forwards -> (drafts int32[B,γ], logq f32[B,γ,V] or None, drafted int32[B],
    forwards int32[], cache).

    keys [B,≥γ]: the round's token keys for positions n .. n+γ-1 (None when greedy).
    drafted[b]: tokens row b proposes (γ unless `confidence` stopped it earlier: the first
    token whose draft probability is below `confidence` is the row's last; or `limits` did:
    `common.chain_may_grow`, an end-of-sequence token is the last, and no more than the row
    can still receive); forwards: draft forwards run, which end when every row has stopped.
    Slots past `drafted` hold garbage.

    On return the cache holds every token the draft processed: positions < lengths - 1 +
    forwards, the draft's own chain (rolled back by the caller to what was accepted).
    catch_up (static): tokens of the first forward, the pending one and up to catch_up - 1
    the draft has not processed before it (Ouroboros' lengthening leaves up to N); 1: every
    forward takes one token, a row behind catching up through the loop's own forwards
    (`_draft_in_loop`, speculative decoding's: its program holds one draft forward fewer).
    guard (`constrained.DraftGuard`, None: none): the draft drafts inside the rows'
    constraints too (its logits masked by the state along its own chain), so its chain never
    leaves the language and forced tokens come out as they are; sampling draws from the
    masked, renormalised q, which the accept rule is given, so it stays lossless.
    """
    if catch_up == 1:
        return _draft_in_loop(params, model_config, gamma, greedy, sp, keys, seq, cache,
                              confidence, guard, limits)
    B, S = seq.tokens.shape
    n = seq.lengths
    lag = n - 1 - cache.lengths  # tokens the draft has not processed before the pending
    pos2 = cache.lengths[:, None] + jnp.arange(catch_up, dtype=jnp.int32)[None]
    tok2 = jnp.take_along_axis(seq.tokens, jnp.minimum(pos2, S - 1), 1)
    mask2 = jnp.broadcast_to(tree_mask(chain_parents(catch_up)), (B, catch_up, catch_up))
    logits, new = forward(params, model_config, tok2, pos2, mask2, cache, select=lag[:, None])
    cache = commit_prefix(cache, new, lag + 1)
    state = jnp.zeros((B,), jnp.int32) if guard is None else guard.root
    if guard is not None:
        logits = guard.mask(logits, state)
    d, logq = _draw(logits, None if greedy else keys[:, :1], sp, greedy)
    if guard is not None:
        state = guard.advance(state, d[:, 0])
    V = logits.shape[-1]
    drafts = jnp.zeros((B, gamma), jnp.int32).at[:, 0].set(d[:, 0])
    logqs = None if greedy else jnp.zeros((B, gamma, V), jnp.float32).at[:, 0].set(logq[:, 0])
    drafted = jnp.ones((B,), jnp.int32)
    active = chain_may_grow(limits, seq, d[:, 0], drafted)
    if confidence > 0:
        active = active & (_confidence(logits, d, logq, greedy, sp)[:, 0] >= confidence)

    def cond(c):
        i, _, _, _, active, _, _ = c
        return (i < gamma) & jnp.any(active)

    def body(c):
        i, drafts, logqs, cache, active, drafted, state = c
        tok = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)
        pos = (n - 1 + i)[:, None]
        logits, new = forward(params, model_config, tok, pos, jnp.ones((B, 1, 1), bool), cache)
        cache = commit_prefix(cache, new, jnp.ones((B,), jnp.int32))
        k = None if greedy else jax.lax.dynamic_slice_in_dim(keys, i, 1, axis=1)
        if guard is not None:
            logits = guard.mask(logits, state)
        d, logq = _draw(logits, k, sp, greedy)
        if guard is not None:
            state = guard.advance(state, d[:, 0])
        drafts = jax.lax.dynamic_update_slice_in_dim(drafts, d, i, axis=1)
        if not greedy:
            logqs = jax.lax.dynamic_update_slice_in_dim(logqs, logq, i, axis=1)
        drafted = drafted + active.astype(jnp.int32)
        active = active & chain_may_grow(limits, seq, d[:, 0], drafted)
        if confidence > 0:
            active = active & (_confidence(logits, d, logq, greedy, sp)[:, 0] >= confidence)
        return i + 1, drafts, logqs, cache, active, drafted, state

    i, drafts, logqs, cache, _, drafted, _ = jax.lax.while_loop(
        cond, body, (jnp.ones((), jnp.int32), drafts, logqs, cache, active, drafted, state))
    return drafts, logqs, drafted, i, cache


def _draft_in_loop(params, model_config, gamma: int, greedy: bool, sp: SamplingParams, keys,
                   seq: Sequences, cache: KVCache, confidence: float, guard, limits):
    """`draft_propose` with catch_up = 1: one one-token forward per step, the step j of row b
    feeding position cache.lengths[b] + j (a token of the sequence up to the pending one, then
    the row's own drafts) and drawing once it has fed the pending token. A row the draft is a
    token behind (its whole chain was accepted last round) takes one forward more than the
    T = 2 catch-up would (on the real 0.5B draft 20 + 20 ms against 30); the program holds
    one forward of the draft fewer (a first call compiled 1.97 s against ~2.8 on the demo
    pair)."""
    B, S = seq.tokens.shape
    n, start = seq.lengths, cache.lengths
    slot = jnp.arange(gamma, dtype=jnp.int32)[None]
    drafts = jnp.zeros((B, gamma), jnp.int32)
    logqs = None if greedy else jnp.zeros((B, gamma, model_config.vocab_size), jnp.float32)
    state = jnp.zeros((B,), jnp.int32) if guard is None else guard.root

    def body(c):
        j, drafts, logqs, cache, active, drafted, state = c
        p = start + j  # [B]: the position this step feeds
        known = jnp.take_along_axis(seq.tokens, jnp.clip(p, 0, S - 1)[:, None], 1)
        own = jnp.take_along_axis(drafts, jnp.clip(p - n, 0, gamma - 1)[:, None], 1)
        tok = jnp.where((p <= n - 1)[:, None], known, own)
        logits, new = forward(params, model_config, tok, p[:, None], jnp.ones((B, 1, 1), bool),
                              cache)
        cache = commit_prefix(cache, new, jnp.ones((B,), jnp.int32))
        idx = p - n + 1  # the draft drawn after position p (0-based), < 0 while catching up
        draws = active & (idx >= 0)
        k = None if greedy else jax.vmap(lambda r, i: r[i])(
            keys, jnp.clip(idx, 0, gamma - 1))[:, None]
        if guard is not None:
            logits = guard.mask(logits, state)
        d, logq = _draw(logits, k, sp, greedy)
        if guard is not None:
            state = jnp.where(draws, guard.advance(state, d[:, 0]), state)
        at = (slot == idx[:, None]) & draws[:, None]
        drafts = jnp.where(at, d, drafts)
        if not greedy:  # each drawing row's q into its slot (one [V] row each, in place)
            rows, col = jnp.arange(B), jnp.clip(idx, 0, gamma - 1)
            logqs = logqs.at[rows, col].set(
                jnp.where(draws[:, None], logq[:, 0], logqs[rows, col]))
        drafted = drafted + draws.astype(jnp.int32)
        grow = chain_may_grow(limits, seq, d[:, 0], drafted) & (drafted < gamma)
        if confidence > 0:
            grow = grow & (_confidence(logits, d, logq, greedy, sp)[:, 0] >= confidence)
        return j + 1, drafts, logqs, cache, active & (~draws | grow), drafted, state

    j, drafts, logqs, cache, _, drafted, _ = jax.lax.while_loop(
        lambda c: jnp.any(c[4]), body,
        (jnp.zeros((), jnp.int32), drafts, logqs, cache, jnp.ones((B,), bool),
         jnp.zeros((B,), jnp.int32), state))
    return drafts, logqs, drafted, j, cache


def lag_catch_up(pair) -> int:
    """draft_propose's catch_up for token drafting whose draft lags by at most one token: 1 (the
    lag fed through the one-token loop, `_draft_in_loop`: a program with one draft forward
    fewer, what a first call compiles) on one device; 2 (a two-token first forward) where the
    pair lives on a mesh of several devices: there the in-loop form's executable, read back
    from the persistent compile cache, left an all-reduce of the 8-device CPU mesh waiting for
    its peers until XLA aborted the process (`xla::internal::AwaitAndLogIfStuck` in
    `InProcessCommunicator::AllReduce`; tests/test_mesh_exact.py's 2x1 vanilla call, then its
    speculative one, with a warm cache: freshly compiled, or either call alone, it passed)."""
    mesh = getattr(pair, "mesh", None)
    return 1 if mesh is None or mesh.size == 1 else 2


def leviathan_accept(logp: jax.Array, logq: jax.Array, drafts: jax.Array,
                     keys: jax.Array, drafted=None) -> Accepted:
    """The Leviathan/Chen rule over one chain.

    logp f32[B,γ+1,V]: target's processed log-probs after [x, d1..dγ]; logq f32[B,γ,V]: the
    draft's, from which d1..dγ (drafts int32[B,γ]) were drawn; keys [B,γ+1]: the token keys
    of the positions chosen after each node (n .. n+γ); drafted int32[B] (None: γ): the
    chain's length per row (adaptive drafting). Returns Accepted over the chain:
    tokens = [d1..da, y], count = a+1, where a = accepted drafts and y the residual
    (a < drafted) or bonus (a = drafted) draw.
    """
    B, gamma = drafts.shape
    slot_d = jnp.arange(gamma, dtype=jnp.int32)[None]
    proposed = jnp.ones((B, gamma), bool) if drafted is None else slot_d < drafted[:, None]
    logp_d = jnp.take_along_axis(logp[:, :gamma], drafts[..., None], -1)[..., 0]
    logq_d = jnp.take_along_axis(logq, drafts[..., None], -1)[..., 0]
    u = jax.vmap(jax.vmap(jax.random.uniform))(_fold(keys[:, :gamma], ACCEPT_KEY))
    accept = (jnp.log(u) < logp_d - logq_d) & proposed  # u < p/q; p >= q always accepts
    a = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    # residual max(p - q, 0) at the first rejection; q = 0 after the last draft gives the bonus
    p_a = jnp.exp(jnp.take_along_axis(logp, a[:, None, None], 1)[:, 0])
    q = jnp.where(proposed[..., None], jnp.exp(logq), 0.0)
    q_pad = jnp.concatenate([q, jnp.zeros_like(logq[:, :1])], axis=1)
    q_a = jnp.take_along_axis(q_pad, a[:, None, None], 1)[:, 0]
    r = jnp.maximum(p_a - q_a, 0.0)
    # p == q up to rounding leaves no residual mass; rejection then has probability ~0 anyway
    r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_a)
    logr = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), -jnp.inf)
    key_a = _fold(jnp.take_along_axis(keys, a[:, None], 1), TARGET_KEY)[:, 0]
    y = jax.vmap(jax.random.categorical)(key_a, logr).astype(jnp.int32)
    slot = jnp.arange(gamma + 1, dtype=jnp.int32)[None]
    drafts_pad = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(slot == a[:, None], y[:, None], drafts_pad)
    path = jnp.broadcast_to(slot, (B, gamma + 1))
    return Accepted(path=path, tokens=tokens, count=a + 1)


def speculative_init(pair: Pair, cfg: SpeculativeConfig, rows: int, slots: int, pool=None
                     ) -> SpeculativeState:
    """B = rows empty rows (done) of S = slots."""
    return SpeculativeState(
        empty_sequences(rows, slots),
        empty_cache(pair, "target", rows, slots),
        empty_cache(pair, "draft", rows, slots),
        init_stats(rows, cfg.gamma + 2, SpeculativeCounters(
            drafted_tokens=counter(), whole_histogram=jnp.zeros((cfg.gamma + 2,), jnp.int32))))


def speculative_insert(pair: Pair, cfg: SpeculativeConfig, state: SpeculativeState, rows,
                       prompt, prompt_lengths) -> SpeculativeState:
    """Rows int32[R] start prompt int32[R,P]: both caches prefilled with all but its last token."""
    return state.replace(
        seq=insert_sequences(state.seq, rows, prompt, prompt_lengths),
        tcache=prefill_rows(pair.tparams, pair.tconfig, state.tcache, rows, prompt,
                            prompt_lengths),
        dcache=prefill_rows(pair.dparams, pair.dconfig, state.dcache, rows, prompt,
                            prompt_lengths))


def speculative_step(pair: Pair, cfg: SpeculativeConfig, greedy: bool, sp: SamplingParams,
                     limits: Limits, state: SpeculativeState,
                     accept_rule=None) -> SpeculativeState:
    """One round: up to γ draft forwards, one target forward over the chain, accept, commit.

    accept_rule: the sampling acceptance function (None: `leviathan_accept`); tests pass
    deliberately wrong rules to show the distribution test has the power to reject them."""
    accept_rule = leviathan_accept if accept_rule is None else accept_rule
    gamma, confidence = cfg.gamma, float(cfg.confidence)
    seq = state.seq
    B = seq.tokens.shape[0]
    parents = chain_parents(gamma + 1)
    positions = (seq.lengths - 1)[:, None] + tree_depths(parents)[None]  # [B, γ+1]
    keys = None if greedy else token_keys(sp, positions + 1)
    drafts, logq, drafted, forwards, dcache = draft_propose(
        pair.dparams, pair.dconfig, gamma, greedy, sp, keys, seq, state.dcache, confidence,
        catch_up=lag_catch_up(pair), guard=constrained.draft_guard(limits, seq), limits=limits)
    drafted = proposing(limits, drafted)  # rows with speculation off offer no chain
    # (before a constraint cuts it: a cut is the draft's token refused, which the agreement counts)
    whole = drafted == gamma
    chain = jnp.concatenate([seq.last[:, None], drafts], axis=1)
    states = constrained.tree_states(limits, seq, parents, chain)
    if states is not None:  # the chain is cut where it leaves the language
        drafted = jnp.minimum(drafted, jnp.sum(jnp.cumprod(states[:, 1:] >= 0, axis=1),
                                               axis=1, dtype=jnp.int32))
    mask = jnp.broadcast_to(tree_mask(parents), (B, gamma + 1, gamma + 1))
    tcache = settle(state.tcache)
    logits, new = forward(pair.tparams, pair.tconfig, chain, positions, mask, tcache)
    logits = constrained.masked(limits, states, logits)

    def walk():
        choices = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        valid = jnp.arange(gamma + 1, dtype=jnp.int32)[None] <= drafted[:, None]
        return accept_walk(parents, chain, valid, choices)

    if greedy:
        acc = walk()
    else:
        # drafted: the chain may end before γ (EOS, the row's budget, confidence, a constraint)
        acc = accept_rule(process_logits(logits, sp), logq, drafts, keys, drafted)
        if sp.greedy_rows is not None:  # greedy rows of a mixed batch: the greedy walk
            g = walk()
            acc = jax.tree_util.tree_map(lambda a, b: greedy_where(sp, a, b), g, acc)

    live = ~seq.done
    lp = walk_logprobs(logits, acc.path, acc.tokens, sp, greedy)
    seq, kept = emit(seq, acc.tokens, acc.count, limits, lp)
    tcache = commit_path(tcache, new, acc, kept)
    # The draft processed positions < n-1+γ, all equal to accepted tokens up to the first
    # rejected one, which is never before the new pending token: keep up to n'-1.
    dcache = rollback(dcache, seq.lengths - 1)
    stats = count_round(state.stats, live, kept, drafted,
                        (acc.path, source_labels(gamma + 1, draft_chain=range(1, gamma + 1))))
    stats = stats.replace(draft_calls=stats.draft_calls + forwards,
                          draft_tokens=stats.draft_tokens + forwards,
                          own=SpeculativeCounters(
                              drafted_tokens=stats.own.drafted_tokens
                              + jnp.sum(jnp.where(live, drafted, 0)),
                              whole_histogram=whole_counted(stats.own.whole_histogram,
                                                            live & whole, kept)))
    return SpeculativeState(seq, tcache, dcache, stats)


def speculative_plain(pair: Pair, cfg: SpeculativeConfig, greedy: bool, sp: SamplingParams,
                      limits: Limits, state: SpeculativeState) -> SpeculativeState:
    """A round without drafting (one target token per row); the draft's cache follows, so its
    lag (0 or 1, see the module docstring) is the same after it."""
    seq, tcache, live, kept = plain_step(pair.tparams, pair.tconfig, greedy, sp, limits,
                                         state.seq, state.tcache)
    dcache = follow_draft(pair.dparams, pair.dconfig, state.seq, state.dcache, kept)
    return SpeculativeState(seq, tcache, dcache, count_round(state.stats, live, kept))


def speculative_finish(state: SpeculativeState) -> Stats:
    return state.stats


_run_speculative = make_runner(speculative_init, speculative_insert, speculative_step,
                               speculative_finish)


def run_speculative(pair: Pair, prompt, prompt_lengths, limits: Limits, sp: SamplingParams,
                    pool=None, *, cfg: SpeculativeConfig, slots: int, greedy: bool,
                    accept_rule=None):
    """generate's loop (`common.make_runner`): prompt int32[B,P] right-padded -> (Sequences with
    S = slots, Stats, None). slots must leave γ+1 slots past prompt + max_new_tokens.
    accept_rule: a test hook, see `speculative_step`."""
    if accept_rule is None:
        return _run_speculative(pair, prompt, prompt_lengths, limits, sp, pool, cfg=cfg,
                                slots=slots, greedy=greedy)
    return _rule_runner(accept_rule)(pair, prompt, prompt_lengths, limits, sp, pool, cfg=cfg,
                                     slots=slots, greedy=greedy)


@lru_cache(maxsize=None)
def _rule_runner(accept_rule):
    """The loop of a test hook's accept rule, built once per rule (so it compiles once)."""
    return make_runner(speculative_init, speculative_insert,
                       partial(_step_with_rule, accept_rule), speculative_finish)


def _step_with_rule(rule, pair, cfg, greedy, sp, limits, state):
    return speculative_step(pair, cfg, greedy, sp, limits, state, accept_rule=rule)


def chain_lesson(gamma: int, confidence: float, histogram, greedy: bool):
    """What `config="auto"` learns from a call whose rounds draft one chain of `gamma` tokens:
    a greedy call drafting a fixed gamma (confidence 0) realises an agreement (the a whose
    expected tokens per round equal its eta) over its rounds, and its acceptance by depth
    (`cost.depth_counts`) -> (agreement, rounds, depth counts), or None when the call says
    nothing about it (sampled, adaptive, or no rounds). histogram: the call's rounds whose
    chain was offered whole, by tokens kept (`whole_counted`: a chain the row's end cut short
    says nothing of the depths past it)."""
    h = [int(x) for x in histogram]
    rounds = sum(h)
    if not greedy or confidence != 0 or rounds <= 0:
        return None
    eta = sum(k * n for k, n in enumerate(h)) / rounds
    return agreement_from_eta(eta, gamma), rounds, depth_counts(h, gamma)


def _learn(cfg: SpeculativeConfig, stats: dict, greedy: bool):
    return chain_lesson(cfg.gamma, cfg.confidence, stats.get("whole_histogram", ()), greedy)


def _round_model(cfg: SpeculativeConfig, a: float) -> RoundModel:
    # gamma one-token draft forwards (their sampling and cache commits within their price)
    return RoundModel(tokens=expected_tokens(a, cfg.gamma), draft_forwards=cfg.gamma,
                      overhead=ROUND_OVERHEAD)


SPEC = MethodSpec(runner=_run_speculative, needs_draft=True, config_type=SpeculativeConfig,
                  default_config=SpeculativeConfig, margin=lambda cfg: cfg.gamma + 1,
                  init=speculative_init, insert=speculative_insert, round=speculative_step,
                  plain_round=speculative_plain, finish=speculative_finish,
                  sources=("draft_chain",),
                  max_emit=lambda cfg: cfg.gamma + 1, family=lambda cfg: (),
                  learn=_learn,
                  forward_sizes=lambda cfg: (cfg.gamma + 1, 1, 1),
                  quick_config=lambda: SpeculativeConfig(gamma=4),
                  round_model=_round_model)
