"""Ouroboros (arXiv 2402.13720; docs/algorithm.md section 2): the draft drafts phrase by phrase with
lookahead steps, the draft is lengthened by pool phrases as tree branches, one target forward
verifies everything, verified phrases are recycled into the pool, and the pool is kept across
calls. One jitted `lax.while_loop` per call; each row accepts its own count.

One round (one target forward), rows b of the batch:

 1. Draft (mechanism 1). The draft's cache holds a prefix of the sequence; the tokens it has not
    processed (accepted/corrected by the target last round, at most N of them) ride as a causal
    prefix of its first forward of the round: a fixed U = N slot, `prefix_count[b]` valid, the
    rest masked invalid. The draft then runs lookahead steps (`jacobi.jacobi_step`, its window
    and the pool persist across rounds) until every live row holds γ new tokens d_1..d_γ
    (overshoot truncated). With phrase_drafting off it drafts one token per forward with
    speculative decoding's own draft loop (`speculative.draft_propose`), so a round with every
    mechanism off runs exactly speculative decoding's forwards and nothing else.
 2. Lengthen (mechanism 2). Up to X pool phrases keyed by d_γ become X branches after the chain
    `last, d_1 .. d_γ` (`tree.chain_with_branches(1+γ, X, N-1)`); missing ones are masked.
 3. One target forward over the tree; `accept_walk` (exact for greedy; for sampling every
    candidate is deterministic, keys fold (row, position)); `commit_path` writes the accepted
    path's K/V. The draft's cache is rolled back (by length) to what the target confirmed.
 4. Recycle (mechanism 3), with v_i = the target's token after chain node i:
    - rejected tail: for each key d_i past the first mismatch, the phrase (v_i .. v_{i+M-1}),
      stored only when every step of it is backed by the draft (d_{t+1} == v_t for t = i ..
      i+M-2), i.e. it reaches M = N-1 target tokens inside the chain;
    - unused branches, when the whole chain was accepted (their prefix valid for the target):
      branch o's T-corrected version (v at d_γ, v at its first M-1 nodes) is inserted under
      d_γ. The pool has no delete, so "replace" = insert as newest; the stale phrase ages out
      (the lookup of X newest sees the corrected versions first).
 5. History (mechanism 4): `pool=` in, `out.pool` back; history=False starts empty.

Free drafts (`free_drafts`, issue 52; not in the paper): before step 1, each row's best
continuation from its context or the pool (`free_drafts.free_proposal`) is scored by its match
length; rows at or above `free_threshold` skip step 1 and put that proposal where d_1..d_γ
would be (steps 2-4 unchanged: the same tree, walk, commit and recycling). When no live row
drafts, a `lax.cond` skips the draft's forwards altogether. The draft's cache then lags by the
tokens those rounds committed; its next drafting round first feeds it them (`_catch_up`), so
the prefix slot's bound holds again.

Stats (docs/algorithm.md section 4; draft counters are per row: `draft_calls` = sum over rows of
draft forwards the row took part in, `draft_tokens` = tokens they produced (overshoot
excluded), so c = draft_tokens / draft_calls; `draft_forwards` counts batch forwards).

Seam functions (decoding/spec.py): `ouroboros_init`, `ouroboros_insert`, `ouroboros_round`,
`ouroboros_plain` (a round without drafting, the draft's cache following), `ouroboros_finish`;
`run_ouroboros` is generate's loop over them. `key_offset` (per row, None in generate) moves a
row's pool keys into its own range: the engine's per-request pools.

Letters (package glossary): B rows, γ gamma (`gamma` in code), W window, N n-gram, M = N-1,
G guesses, X suffixes (`x` in code), U prefix slot, T tree nodes.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..models import forward
from ..models.kv_cache import KVCache, commit_prefix, settle
from ..pool import PhrasePool, insert_many, lookup, prepare_pool
from ..sampling import SamplingParams, choose_tokens
from ..tree import chain_parents, chain_with_branches, jacobi_tree, tree_mask
from .common import (Limits, Pair, Sequences, Stats, count_round, count_sources, counter,
                     emit, empty_cache, empty_sequences, follow_draft, init_stats,
                     insert_sequences, loop_config, make_runner, plain_step, pool_summary,
                     pool_with_context, prefill_rows, proposing, set_rows, source_labels,
                     whole_counted)
from .free_drafts import FreeDraft, free_proposal
from .ouroboros_config import (OuroborosConfig, OuroborosCounters, OuroborosState,
                               forward_sizes)
from .jacobi import (commit_with_prefix, empty_window, init_window, jacobi_step)
from .cost import (FREE_PRIOR, POOL_OVERHEAD, ROUND_OVERHEAD, FreeProfile, RoundModel,
                   branch_gain, expected_tokens, free_round_model, phrase_gain)
from .spec import MethodSpec
from .speculative import chain_lesson, draft_propose, lag_catch_up
from . import constrained
from .logprobs import walk_logprobs
from .verify import Accepted, accept_walk, commit_path


def _greedy(logits, positions):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _draft_tokens(dparams, dconfig, cfg: OuroborosConfig, state: OuroborosState, live,
                  guard=None, limits=None, lag: int = 1):
    """Token-by-token drafting (phrase drafting off): speculative decoding's own draft loop
    (`speculative.draft_propose`, greedy), so the round runs exactly its forwards: without
    lengthening one-token forwards, the first feeding the token the draft lags by after a whole
    chain was accepted (on one device; a two-token first forward on a mesh, `lag`); with it,
    one forward catching up on the (at most N) tokens the draft has not processed and reading
    the pending token's logits, then γ - 1 one-token forwards. The window and the pool are not
    touched.
    -> (d int32[B,γ], drafted int32[B], dcache, window, pool, stats) as `_draft_phase`."""
    U = _prefix_slot(cfg)
    # without lengthening the draft lags by at most one token, which speculative's loop feeds
    # through its own one-token forwards (catch_up 1); with it, up to N ride one forward
    d, _, drafted, forwards, dcache = draft_propose(dparams, dconfig, cfg.gamma, True, None,
                                                    None, state.seq, state.dcache,
                                                    cfg.confidence,
                                                    catch_up=lag if U == 1 else U + 1,
                                                    guard=guard, limits=limits)
    rows = jnp.sum(jnp.where(live, drafted, 0), dtype=jnp.int32)  # row forwards = row tokens
    stats = state.stats
    stats = stats.replace(draft_calls=stats.draft_calls + rows,
                          draft_tokens=stats.draft_tokens + rows,
                          own=stats.own.replace(draft_forwards=stats.own.draft_forwards
                                                + forwards))
    return d, drafted, dcache, state.window, state.pool, stats


def _prefix_slot(cfg: OuroborosConfig) -> int:
    """U, the tokens the draft may lag behind the pending one at a round's first draft forward
    (its prefix slot): a fully accepted chain + branch leaves at most 1 + (N-1) tokens the
    draft has not processed; without branches at most the target's bonus token. Free rounds
    leave more, which `_catch_up` feeds it first."""
    return cfg.ngram if cfg.lengthening else 1


def _catch_up_chunk(cfg: OuroborosConfig) -> int:
    """C, the tokens of one catch-up forward: the most one round emits (1 + γ + M), so one
    forward per free round since the draft last drafted brings it back within its slot."""
    return 1 + cfg.gamma + (cfg.ngram - 1 if cfg.lengthening else 0)


def _catch_up(dparams, dconfig, cfg: OuroborosConfig, seq: Sequences, dcache: KVCache, live,
              stats: Stats) -> tuple[KVCache, Stats]:
    """Feeds the draft the tokens free rounds committed without it: while a live row's draft
    lags more than U (`_prefix_slot`) tokens behind its pending token, one causal forward of
    C (`_catch_up_chunk`) tokens from each row's cache length, committing up to lag - U of
    them (rows within U commit none; the last U ride in the first draft forward's prefix
    slot as after any round). Without free rounds the lag is never past U and no
    forward runs. -> (dcache, stats) with the forwards counted (draft_forwards,
    catch_up_forwards); they draft nothing, so draft_calls and draft_tokens stay."""
    U, C = _prefix_slot(cfg), _catch_up_chunk(cfg)
    B, S = seq.tokens.shape
    mask = jnp.broadcast_to(tree_mask(chain_parents(C)), (B, C, C))

    def behind(cache):  # int32[B]: tokens past the prefix slot the row must still feed
        return jnp.where(live, seq.lengths - 1 - cache.lengths - U, 0)

    def feed(carry):
        cache, n = carry
        pos = cache.lengths[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
        tok = jnp.take_along_axis(seq.tokens, jnp.minimum(pos, S - 1), 1)
        _, new = forward(dparams, dconfig, tok, pos, mask, cache,
                         select=jnp.zeros((B, 1), jnp.int32))
        return commit_prefix(cache, new, jnp.clip(behind(cache), 0, C)), n + 1

    dcache, n = jax.lax.while_loop(lambda c: jnp.any(behind(c[0]) > 0), feed,
                                   (dcache, jnp.zeros((), jnp.int32)))
    own = stats.own
    return dcache, stats.replace(own=own.replace(draft_forwards=own.draft_forwards + n,
                                                 catch_up_forwards=own.catch_up_forwards + n))


def _draft_or_free(pair: Pair, cfg: OuroborosConfig, limits: Limits, state: OuroborosState,
                   live, run=None) -> tuple:
    """Free drafts' choice per row: rows whose free proposal (`free_drafts.free_proposal`)
    matches at least `free_threshold` tokens take it as their chain; the others draft as
    usual (`_draft_phase` over them alone: free rows are inactive there), after `_catch_up`
    of every live row (token-by-token drafting's first forward assumes each row within U).
    When no live row drafts, `lax.cond` skips the draft entirely: no forward, window, pool
    and draft cache untouched. In a batch where some rows draft, the draft's forwards run at
    full batch shape anyway (masking rows does not shrink a fixed-shape forward), so the
    saving there is only the draft loop ending once the drafting rows hold γ tokens.
    -> (d int32[B,γ], drafted int32[B], dcache, window, pool, stats, free bool[B], FreeDraft)
    as `_draft_phase`, plus which rows took the free path."""
    seq = state.seq
    B = seq.tokens.shape[0]
    if cfg.free_drafts:
        prop = free_proposal(seq, state.pool, cfg.gamma, state.key_offset)
        free = live & proposing(limits, (prop.run >= cfg.free_threshold) & (prop.count > 0))
    else:  # a constraint's forced runs (run) alone take the free path
        prop, free = None, jnp.zeros((B,), bool)
    if run is not None:  # issue 55: a row's forced run is certain, it goes first
        prop, free = constrained.take_forced(prop, free, run)
    need = live & ~free

    def drafting(_):
        dcache, stats = _catch_up(pair.dparams, pair.dconfig, cfg, seq, state.dcache, live,
                                  state.stats)
        return _draft_phase(pair.dparams, pair.dconfig, cfg,
                            state.replace(dcache=dcache, stats=stats), need,
                            constrained.draft_guard(limits, seq), limits, lag_catch_up(pair))

    def skipping(_):
        return (jnp.zeros((B, cfg.gamma), jnp.int32), jnp.zeros((B,), jnp.int32), state.dcache,
                state.window, state.pool, state.stats)

    d, drafted, dcache, window, pool, stats = jax.lax.cond(jnp.any(need), drafting, skipping,
                                                           None)
    d = jnp.where(free[:, None], prop.tokens, d)
    drafted = jnp.where(free, prop.count, drafted)
    return d, drafted, dcache, window, pool, stats, free, prop if cfg.free_drafts else None


def _draft_phase(dparams, dconfig, cfg: OuroborosConfig, state: OuroborosState, live,
                 guard=None, limits=None, lag: int = 1):
    """Mechanism 1: -> (d int32[B,γ], drafted int32[B] (γ unless adaptive drafting stopped the
    row earlier; slots past it hold garbage), dcache, window, pool, stats). guard
    (`constrained.DraftGuard`, None: none): the draft's choices are masked by the rows'
    constraints along its own chain, so its phrases stay in the language. lag: token drafting's
    catch_up for a lag of one token (`speculative.lag_catch_up`)."""
    if not cfg.phrase_drafting:
        return _draft_tokens(dparams, dconfig, cfg, state, live, guard, limits, lag)
    seq, dcache = state.seq, state.dcache
    B, S = seq.tokens.shape
    gamma, n = cfg.gamma, cfg.ngram
    U = _prefix_slot(cfg)
    buf = gamma + n - 1
    dlen = dcache.lengths
    pc = jnp.clip(seq.lengths - 1 - dlen, 0, U)
    pidx = jnp.clip(dlen[:, None] + jnp.arange(U, dtype=jnp.int32)[None], 0, S - 1)
    prefix = jnp.take_along_axis(seq.tokens, pidx, axis=1)
    rows = jnp.arange(B)[:, None]
    layout = jacobi_tree(cfg.window, cfg.ngram, cfg.guesses)
    adaptive = cfg.confidence > 0

    def step(carry, first: bool):
        dcache, window, pool, dbuf, nd, last, going, stats, fsm = carry
        active = live & (nd < gamma) & going
        res = jacobi_step(dparams, dconfig, layout, dcache, window, pool, last, active, _greedy,
                          prefix=prefix if first else None, prefix_count=pc if first else None,
                          with_confidence=adaptive, key_offset=state.key_offset,
                          constrain=None if guard is None else partial(guard.tree, fsm))
        acc, window, pool, conf = res.acc, res.window, res.pool, res.confidence
        cnt = jnp.where(active, acc.count, 0)
        if conf is not None:  # adaptive: keep up to the first token below the threshold
            a = jnp.arange(conf.shape[1], dtype=jnp.int32)[None]
            low = (conf < cfg.confidence) & (a < cnt[:, None])
            first_low = jnp.min(jnp.where(low, a, conf.shape[1]), axis=1)
            cnt = jnp.minimum(cnt, first_low + 1)
            going = going & ~jnp.any(low, axis=1)
        dcache = commit_with_prefix(dcache, res.new, U if first else 0,
                                    pc if first else jnp.zeros_like(cnt), acc.path, cnt)
        q = jnp.arange(acc.tokens.shape[1], dtype=jnp.int32)[None]
        slot = jnp.where(q < cnt[:, None], nd[:, None] + q, buf)
        dbuf = dbuf.at[rows, slot].set(acc.tokens, mode="drop")
        newest = jnp.take_along_axis(acc.tokens, jnp.maximum(cnt - 1, 0)[:, None], 1)[:, 0]
        last = jnp.where(active, newest, last)
        stats = stats.replace(
            draft_calls=stats.draft_calls + jnp.sum(active, dtype=jnp.int32),
            draft_tokens=stats.draft_tokens + jnp.sum(jnp.minimum(cnt, gamma - nd)),
            own=stats.own.replace(draft_forwards=stats.own.draft_forwards + 1))
        fsm = fsm if guard is None else guard.follow(fsm, acc.tokens, cnt)
        return dcache, window, pool, dbuf, nd + cnt, last, going, stats, fsm

    carry = (dcache, state.window, state.pool, jnp.zeros((B, buf), jnp.int32),
             jnp.zeros((B,), jnp.int32), seq.last, jnp.ones((B,), bool), state.stats,
             jnp.zeros((B,), jnp.int32) if guard is None else guard.root)
    carry = step(carry, True)
    carry = jax.lax.while_loop(lambda c: jnp.any(live & (c[4] < gamma) & c[6]),
                               lambda c: step(c, False), carry)
    dcache, window, pool, dbuf, nd, _, _, stats, _ = carry
    return dbuf[:, :gamma], jnp.minimum(nd, gamma), dcache, window, pool, stats


def _recycle(cfg: OuroborosConfig, pool, tokens, choices, found, acc: Accepted, matched, live,
             drafted, key_offset=None):
    """Mechanism 3 (see module docstring). tokens/choices int32[B,T] of the target tree,
    found bool[B,X] branch validity, matched int32[B] chain draft tokens accepted, drafted
    int32[B] chain slots the draft filled (γ unless adaptive drafting stopped it)."""
    gamma, m = cfg.gamma, cfg.ngram - 1
    B = tokens.shape[0]
    keys, phrases, valid = [], [], []
    ok = tokens[:, 1:1 + gamma] == choices[:, :gamma]  # ok[:, t]: d_{t+1} == v_t
    n_keys = gamma - m + 1  # keys d_1 .. d_{γ-M+1}: their M-token phrase stays inside the chain
    if n_keys > 0:
        i = np.arange(1, n_keys + 1)
        keys.append(tokens[:, i])
        phrases.append(choices[:, i[:, None] + np.arange(m)[None]])  # [B, n_keys, M]
        backed = jnp.all(ok[:, i[:, None] + np.arange(m - 1)[None]], axis=2) if m > 1 else \
            jnp.ones((B, n_keys), bool)
        # the phrase's last target token follows chain node i + M - 1, which must be drafted
        inside = jnp.asarray(i + m - 1)[None] <= drafted[:, None]
        valid.append(backed & inside & (jnp.asarray(i)[None] > matched[:, None]) & live[:, None])
    if cfg.lengthening:
        x = cfg.suffixes
        lay = chain_with_branches(1 + gamma, x, m)
        bi = lay.branch_index
        corrected = jnp.concatenate(
            [jnp.broadcast_to(choices[:, gamma][:, None, None], (B, x, 1)),
             choices[:, bi[:, :m - 1].reshape(-1)].reshape(B, x, m - 1)], axis=2)
        entered = acc.count - 1 > gamma
        first_past = acc.path[:, min(gamma + 1, acc.path.shape[1] - 1)]  # first node past the chain
        used = jnp.where(entered, (first_past - (1 + gamma)) // m, -1)
        unused = jnp.arange(x)[None] != used[:, None]
        keys.append(jnp.broadcast_to(tokens[:, gamma][:, None], (B, x)))
        phrases.append(corrected)
        valid.append(found & unused & (matched == gamma)[:, None] & live[:, None])
    if not keys:
        return pool
    keys = jnp.concatenate(keys, 1)
    if key_offset is not None:
        keys = keys + key_offset[:, None]
    keys = keys.reshape(-1)
    phrases = jnp.concatenate(phrases, 1).reshape(-1, m)
    valid = jnp.concatenate(valid, 1).reshape(-1)
    return insert_many(pool, keys, phrases, valid)


def ouroboros_round(pair: Pair, cfg: OuroborosConfig, greedy: bool, sp: SamplingParams,
                    limits: Limits, state: OuroborosState) -> OuroborosState:
    """One Ouroboros round (docs/algorithm.md section 2), one target forward.

    The draft drafts γ tokens phrase by phrase (`_draft_phase`); the chain [last, d_1..d_γ] is
    lengthened with up to X pool phrases keyed by d_γ (T = 1 + γ + X*M nodes); one target
    forward scores the tree; the accept walk picks the path; the target cache commits it, the
    draft cache is rolled back to what the target confirmed and the pool recycles verified
    phrases. Rows already done take part in the shapes but change nothing.

    Args:
        pair: the target's and the draft's params and (static) configs.
        cfg: the (static) OuroborosConfig: γ, W, N, G, X and the mechanism switches.
        greedy: static; True takes the target's argmax, False draws with `sp`.
        sp: SamplingParams (temperature, top-k, top-p, seed); keys fold (row, position).
        limits: Limits (max_new_tokens, EOS ids) applied by `emit`.
        state: the loop carry before the round.

    Returns:
        The OuroborosState after the round: seq with up to γ + 1 (+ M from a branch) new tokens
        per row, tcache/dcache/window/pool updated, stats counting the round.
    """
    tparams, tconfig = pair.tparams, pair.tconfig
    seq = state.seq
    B = seq.tokens.shape[0]
    gamma, m = cfg.gamma, cfg.ngram - 1
    live = ~seq.done
    L = seq.lengths

    run = constrained.forced_run(limits, seq, gamma, live)  # None without a constraint
    if cfg.free_drafts or run is not None:
        d, drafted, dcache, window, pool, stats, free, prop = _draft_or_free(pair, cfg, limits,
                                                                            state, live, run)
    else:
        d, drafted, dcache, window, pool, stats = _draft_phase(pair.dparams, pair.dconfig, cfg,
                                                               state, live, None, limits,
                                                               lag_catch_up(pair))
        free, prop = jnp.zeros((B,), bool), None
    drafted = proposing(limits, drafted)  # rows with speculation off offer no chain
    # chain slots the draft filled (all of them unless adaptive drafting stopped the row)
    in_chain = jnp.arange(gamma, dtype=jnp.int32)[None] < drafted[:, None]  # [B,γ]

    # -- lengthen: chain (last, d_1..d_γ) + X branches keyed by d_γ
    x = cfg.suffixes if cfg.lengthening else 0
    lay = chain_with_branches(1 + gamma, x, m)
    chain = jnp.concatenate([seq.last[:, None], d], axis=1)
    chain_valid = jnp.concatenate([jnp.ones((B, 1), bool), in_chain], axis=1)
    if x:
        key = d[:, gamma - 1] if state.key_offset is None else d[:, gamma - 1] + state.key_offset
        branches, found = lookup(pool, key, x)  # [B,X,M], [B,X]
        found = found & (drafted == gamma)[:, None]  # branches hang after d_γ
        tokens = jnp.concatenate([chain, branches.reshape(B, -1)], axis=1)
        valid = jnp.concatenate([chain_valid, jnp.repeat(found, m, axis=1)], 1)
    else:
        found = jnp.zeros((B, 0), bool)
        tokens, valid = chain, chain_valid

    # -- one target forward, accept, commit (a constraint cuts the tree and masks the logits)
    states = constrained.tree_states(limits, seq, lay.parents, tokens)
    valid = constrained.cut(states, valid)
    tcache = settle(state.tcache)
    pos = tcache.lengths[:, None] + jnp.asarray(lay.depths)[None]
    logits, new = forward(tparams, tconfig, tokens, pos, tree_mask(lay.parents, valid), tcache)
    logits = constrained.masked(limits, states, logits)
    choices = choose_tokens(logits, pos + 1, sp, greedy)
    acc = accept_walk(lay.parents, tokens, valid, choices)
    seq, kept = emit(seq, acc.tokens, acc.count, limits,
                     walk_logprobs(logits, acc.path, acc.tokens, sp, greedy))
    tcache = commit_path(tcache, new, acc, kept)
    seq = constrained.count_proposed(seq, run, free)

    # -- the draft keeps only what the target confirmed (rollback = a length); a free row's
    # accepted chain is not the draft's, which keeps at most the pending token
    matched = jnp.minimum(acc.count - 1, gamma)  # chain tokens accepted
    kept_draft = L + jnp.where(free, 0, matched)
    dcache = dcache.replace(lengths=jnp.minimum(dcache.lengths,
                                                jnp.minimum(kept_draft, seq.lengths - 1)))

    if cfg.recycling:
        pool = _recycle(cfg, pool, tokens, choices, found, acc, matched, live, drafted,
                        state.key_offset)

    # -- stats
    T = len(lay.parents)
    stats = _count_sources(count_round(stats, live, kept, drafted), cfg, T, live, kept, acc.path,
                           free, prop)
    q = jnp.arange(acc.path.shape[1] - 1)[None]
    from_branch = (q < kept[:, None]) & (q + 1 < acc.count[:, None]) & (acc.path[:, 1:] > gamma)
    lv = live.astype(jnp.int32)
    dv = (live & ~free).astype(jnp.int32)  # rows whose chain the draft drafted
    fv = lv - dv
    own = stats.own
    stats = stats.replace(own=own.replace(
        suffix_tokens_accepted=own.suffix_tokens_accepted
        + jnp.sum(from_branch, dtype=jnp.int32),
        pool_hits=own.pool_hits + jnp.sum(lv * jnp.any(found, axis=1)),
        draft_matches=own.draft_matches
        + jnp.sum(dv[:, None] * ((tokens[:, 1:1 + gamma] == choices[:, :gamma]) & in_chain)),
        draft_accepted=own.draft_accepted + jnp.sum(dv * matched),
        draft_rounds=own.draft_rounds + jnp.sum(dv),
        # whole chains only: one the row's end cut short says nothing of the depths past it
        draft_histogram=whole_counted(own.draft_histogram, live & ~free & (drafted == gamma),
                                      kept),
        free_rounds=own.free_rounds + jnp.sum(fv),
        # kept, not walked: a cut-off (EOS, max_new_tokens) inside the chain keeps fewer
        free_tokens_accepted=own.free_tokens_accepted
        + jnp.sum(fv * jnp.minimum(matched, jnp.maximum(kept - 1, 0)))))
    if prop is not None:
        stats = _count_offers(stats, live, prop, acc.tokens, kept, free)
    return state.replace(seq=seq, tcache=tcache, dcache=dcache, window=window, pool=pool,
                         stats=stats)


def shadow_accepted(prop: FreeDraft, emitted, kept, free) -> jax.Array:
    """int32[B]: the free proposal's tokens the round kept: its leading agreement with the
    round's emitted tokens (emitted int32[B,A], the first kept int32[B] of them real), at most
    its count. In a free row (free bool[B]) these are its accepted tokens as
    free_tokens_accepted counts them (a cut-off keeps the last kept token as the round's
    own); in a drafted row, what verifying it would have kept up to the round's end (a lower
    bound: the round may end before the proposal disagrees)."""
    n = min(prop.tokens.shape[1], emitted.shape[1])
    i = jnp.arange(n, dtype=jnp.int32)[None]
    upto = jnp.where(free, kept - 1, kept)
    agree = (prop.tokens[:, :n] == emitted[:, :n]) & (i < prop.count[:, None]) \
        & (i < upto[:, None])
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def _count_offers(stats: Stats, live, prop: FreeDraft, emitted, kept, free) -> Stats:
    """Adds every live row round to free_offered and free_would_accept at its proposal's
    match length (0 where no source offered one), free or drafted alike."""
    r = jnp.where(prop.count > 0, prop.run, 0)
    w = jnp.where(live, shadow_accepted(prop, emitted, kept, free), 0)
    own = stats.own
    return stats.replace(own=own.replace(
        free_offered=own.free_offered.at[r].add(live.astype(jnp.int32)),
        free_would_accept=own.free_would_accept.at[r].add(w)))


def _count_sources(stats: Stats, cfg: OuroborosConfig, size: int, live, kept, path,
                   free, prop: Optional[FreeDraft]) -> Stats:
    """A round's accepted tokens by source over its tree of `size` nodes: branches are pool
    phrases; the chain is the draft's, or in a free row its proposal's source (a span of the
    context is prompt lookup's source, a pool phrase the pool's)."""
    gamma = cfg.gamma
    chain, branches = range(1, 1 + gamma), range(1 + gamma, size)
    drafted = source_labels(size, draft_chain=chain, pool_phrases=branches)
    if prop is None:
        return count_sources(stats, live, kept, path, drafted)
    copied = source_labels(size, prompt_lookup=chain, pool_phrases=branches)
    pooled = source_labels(size, pool_phrases=range(1, size))
    stats = count_sources(stats, live & ~free, kept, path, drafted)
    stats = count_sources(stats, live & free & prop.from_context, kept, path, copied)
    return count_sources(stats, live & free & ~prop.from_context, kept, path, pooled)


def ouroboros_init(pair: Pair, cfg: OuroborosConfig, rows: int, slots: int, pool: PhrasePool
                   ) -> OuroborosState:
    """B = rows empty rows (done) of S = slots, around `pool`."""
    own = OuroborosCounters(draft_forwards=counter(), suffix_tokens_accepted=counter(),
                            pool_hits=counter(), draft_matches=counter(),
                            draft_accepted=counter(), catch_up_forwards=counter(),
                            draft_rounds=counter(), free_rounds=counter(),
                            free_tokens_accepted=counter(),
                            draft_histogram=jnp.zeros((_bins(cfg),), jnp.int32),
                            free_offered=jnp.zeros((cfg.ngram,), jnp.int32),
                            free_would_accept=jnp.zeros((cfg.ngram,), jnp.int32))
    return OuroborosState(
        empty_sequences(rows, slots),
        empty_cache(pair, "target", rows, slots),
        empty_cache(pair, "draft", rows, slots),
        empty_window(jacobi_tree(cfg.window, cfg.ngram, cfg.guesses), rows), pool,
        init_stats(rows, _bins(cfg), own))


def _bins(cfg: OuroborosConfig) -> int:
    # acceptance histogram bins: 0 .. the most tokens a round keeps (1 + gamma + M)
    return 2 + cfg.gamma + (cfg.ngram - 1 if cfg.lengthening else 0)


def ouroboros_insert(pair: Pair, cfg: OuroborosConfig, state: OuroborosState, rows, prompt,
                     prompt_lengths) -> OuroborosState:
    """Rows int32[R] start prompt int32[R,P]: both caches prefilled, the draft's window
    started from the prompt, its n-grams in the pool (context_phrases)."""
    layout = jacobi_tree(cfg.window, cfg.ngram, cfg.guesses)
    return state.replace(
        seq=insert_sequences(state.seq, rows, prompt, prompt_lengths),
        tcache=prefill_rows(pair.tparams, pair.tconfig, state.tcache, rows, prompt,
                            prompt_lengths),
        dcache=prefill_rows(pair.dparams, pair.dconfig, state.dcache, rows, prompt,
                            prompt_lengths),
        window=set_rows(state.window, rows, init_window(layout, prompt, prompt_lengths)),
        pool=pool_with_context(state, rows, prompt, prompt_lengths, cfg.context_phrases))


def ouroboros_plain(pair: Pair, cfg: OuroborosConfig, greedy: bool, sp: SamplingParams,
                    limits: Limits, state: OuroborosState) -> OuroborosState:
    """A round without drafting (one target token per row). The draft's cache follows, so its
    lag behind the pending token (which the next round's prefix slot catches up on) is
    unchanged; window and pool are left as they were (only candidates)."""
    seq, tcache, live, kept = plain_step(pair.tparams, pair.tconfig, greedy, sp, limits,
                                         state.seq, state.tcache)
    dcache = follow_draft(pair.dparams, pair.dconfig, state.seq, state.dcache, kept)
    return state.replace(seq=seq, tcache=tcache, dcache=dcache,
                         stats=count_round(state.stats, live, kept))


def ouroboros_finish(state: OuroborosState) -> Stats:
    """The loop's stats with its summaries: pool hit rate and occupancy, and paper Table 1's
    draft tokens agreeing with the target's own choice vs accepted, per round."""
    stats = state.stats
    rounds = jnp.maximum(jnp.sum(stats.rounds), 1)
    mva = jnp.stack([stats.own.draft_matches / rounds, stats.own.draft_accepted / rounds])
    return stats.replace(summary={**pool_summary(stats, state.pool), "match_vs_accept": mva})


run_ouroboros = make_runner(ouroboros_init, ouroboros_insert, ouroboros_round, ouroboros_finish)


def _prepare(cfg: OuroborosConfig, pool, vocab: int):
    """(the config the compiled loop sees, the pool a call starts from)."""
    return loop_config(cfg), prepare_pool(pool, vocab, cfg.guesses, cfg.ngram - 1,
                                          cfg.pool_rows, cfg.history)


def _margin(cfg: OuroborosConfig) -> int:
    # The draft's cache runs ahead of the sequence by up to gamma + N - 1 slots in a round.
    return cfg.gamma + cfg.ngram + 1


def _family(cfg: OuroborosConfig):
    # what shapes the state: the draft's window and the pool (gamma and suffixes may differ)
    # free drafts too: a config without them assumes the draft never lags past its prefix
    # slot, which free rounds break
    return (cfg.window, cfg.ngram, cfg.guesses, cfg.pool_rows, cfg.phrase_drafting,
            cfg.lengthening, cfg.free_drafts)


def _round_model(cfg: OuroborosConfig, a: float) -> RoundModel:
    # draft tokens per draft forward: phrase drafting yields 1 to N-1 tokens a forward,
    # token-by-token drafting one
    c = 1 + phrase_gain(cfg.guesses, cfg.ngram) * a if cfg.phrase_drafting else 1.0
    draft_forwards = cfg.gamma / c
    gain = branch_gain(a, cfg.gamma, cfg.suffixes, cfg.ngram) if cfg.lengthening else 0.0
    # the pool is read by phrase drafting and lengthening and written by recycling; with all
    # three off a round is speculative decoding's (the ablation's SD step)
    pool = POOL_OVERHEAD if (cfg.phrase_drafting or cfg.lengthening or cfg.recycling) else 0.0
    return RoundModel(
        tokens=expected_tokens(a, cfg.gamma) + gain, draft_forwards=draft_forwards,
        overhead=ROUND_OVERHEAD + pool)


def _free_model(cfg: OuroborosConfig, model: RoundModel, profile: Optional[FreeProfile]
                ) -> RoundModel:
    # free drafts: the rounds whose proposal reaches the threshold verify it with no draft
    # forward, priced from what the pair's proposals kept (FREE_PRIOR before any)
    if not cfg.free_drafts:
        return model
    return free_round_model(model, profile or FREE_PRIOR, cfg.free_threshold,
                            _catch_up_chunk(cfg), cfg.gamma)


def _learn(cfg: OuroborosConfig, stats: dict, greedy: bool):
    # A round without phrase drafting or lengthening drafts one chain of gamma tokens token by
    # token and verifies it alone, as speculative decoding does (the ablation's SD step, which
    # auto runs where wide forwards cost more than they bring): its acceptance is the pair's
    # agreement by depth. With lengthening a round keeps pool tokens past the chain, and with
    # phrase drafting the chain is drafted phrase by phrase: neither call is read as one.
    # The drafted rounds' own histogram is read (free chains are not the draft's), of the
    # chains the draft offered whole (`common.whole_counted`).
    if cfg.phrase_drafting or cfg.lengthening:
        return None
    return chain_lesson(cfg.gamma, cfg.confidence, stats.get("draft_histogram", ()), greedy)


SPEC = MethodSpec(runner=run_ouroboros, needs_draft=True, config_type=OuroborosConfig,
                  default_config=OuroborosConfig, margin=_margin, forward_sizes=forward_sizes,
                  init=ouroboros_init, insert=ouroboros_insert, round=ouroboros_round,
                  plain_round=ouroboros_plain, finish=ouroboros_finish, prepare=_prepare,
                  # prompt_lookup: free drafts' spans of the context
                  sources=("draft_chain", "pool_phrases", "prompt_lookup"),
                  keeps_pool=True,
                  max_emit=lambda cfg: 1 + cfg.gamma + (cfg.ngram - 1 if cfg.lengthening else 0),
                  family=_family,
                  quick_config=lambda: OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4,
                                                       suffixes=2),
                  learn=_learn,
                  round_model=_round_model,
                  free_model=_free_model)
