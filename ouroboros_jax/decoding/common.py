"""What every decoding method shares: the sequence buffer, emitting tokens with EOS and
`max_new_tokens` cut-offs, prefill, the on-device stats counters, and the drivers that run a
method's seam functions (`decoding/spec.py`): `make_runner` (generate: init, insert every row,
one while_loop of rounds) and `run_rounds` (the serving engine: k rounds, then read).

Convention used by every method: a row's sequence holds `lengths[b]` tokens (prompt, then new
tokens); its KV cache holds the first `lengths[b] - 1` of them. The last token is "pending": it
is the root of the next forward, whose K/V are computed then. Vanilla decoding is the one-node
case of the same rule.

Empty rows (the engine's free slots) are done rows of one pending token at position 0; every
round masks done rows, so they change nothing but take part in the shapes.

Letters (package glossary): B rows, R rows inserted at once, P prompt width, S buffer slots
(= cache slots), A tokens offered to `emit` at once, E tokens one read returns per row.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from ..models import causal_mask, forward
from ..models.config import ModelConfig
from ..models.kv_cache import (PENDING_SLOTS, KVCache, commit_prefix, init_cache, settle,
                               with_empty_pending)
from ..models.layout import decode_params
from ..sharding import cache_spec
from ..pool import insert_context, pool_occupancy
from ..sampling import choose_tokens
from . import constrained, logprobs


@struct.dataclass
class Sequences:
    """The token buffer every method's loop carries.

    Attributes:
        tokens: int32[B,S], the prompt then the generated tokens; garbage past lengths.
        lengths: int32[B], tokens held per row; the last one is pending (not in the cache).
        prompt_lengths: int32[B], the prompt's share of lengths.
        done: bool[B], the row stopped (EOS emitted or max_new_tokens reached).
        logprobs, top_tokens, top_logprobs: f32[B,S], int32[B,S,K], f32[B,S,K]: each
            emitted token's log-probability and the K most likely tokens' at its position,
            at its slot (`decoding/logprobs.py`); None when the loop computes none.
        fsm: int32[B], each row's automaton state after its generated tokens (local to its
            automaton, `constrain.device`; 0 at the start), None when the loop has no
            constraint (`Limits.constraint`).
        forced: int32[B], generated tokens that were the only one their state allowed (None
            without a constraint).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    done: jax.Array
    logprobs: Optional[jax.Array] = None
    top_tokens: Optional[jax.Array] = None
    top_logprobs: Optional[jax.Array] = None
    fsm: Optional[jax.Array] = None
    forced: Optional[jax.Array] = None

    @property
    def last(self) -> jax.Array:
        """int32[B]: the pending token of each row."""
        return jnp.take_along_axis(self.tokens, (self.lengths - 1)[:, None], 1)[:, 0]

    @property
    def generated(self) -> jax.Array:
        return self.lengths - self.prompt_lengths


@struct.dataclass
class Limits:
    """Dynamic stopping rules (arrays: changing them never recompiles), for the batch or per row.

    Attributes:
        max_new_tokens: int32[] or int32[B], the most tokens a row generates.
        eos_token_id: int32[n_eos], int32[] or int32[B, n_eos] (per row): a row stops after any
            of these ids; -1 pads.
        speculate: bool[B] or None (every row): rows that may be offered draft tokens; a row
            without proposes nothing (its draft length is 0), so each round gives it the one
            token plain decoding would (the serving engine's per-request "speculation off").
        constraint: `constrain.RowConstraints` or None (no row constrained): each row's
            automaton; the target's logits are masked at every verified node by the state
            there (`decoding/constrained.py`), proposals leaving the language are cut, and
            `emit` advances the rows' states.
    """

    max_new_tokens: jax.Array
    eos_token_id: jax.Array
    speculate: Optional[jax.Array] = None
    constraint: Any = None


def proposing(limits: Limits, offered: jax.Array) -> jax.Array:
    """offered [B, ...] (a row's draft length, or its candidates' valid flags) with the rows
    that may not speculate (`Limits.speculate`) offering nothing (0 / False)."""
    if limits.speculate is None:
        return offered
    on = limits.speculate.reshape(limits.speculate.shape + (1,) * (offered.ndim - 1))
    return jnp.where(on, offered, jnp.zeros_like(offered))


@struct.dataclass
class Pair:
    """The models a method runs, as one jit argument: params are traced, configs static.

    Attributes:
        tparams, tconfig: the target's params and ModelConfig.
        dparams, dconfig: the draft's (None for methods without one).
    """

    tparams: Any
    dparams: Any = None
    tconfig: ModelConfig = struct.field(pytree_node=False, default=None)
    dconfig: Optional[ModelConfig] = struct.field(pytree_node=False, default=None)
    mesh: Optional[Mesh] = struct.field(pytree_node=False, default=None)


def make_pair(target, draft=None) -> Pair:
    """A Pair from `Model`s (draft None: no draft), each model's params in the layout decoding
    runs on (`layout.decode_params`: packed on a CPU, as given on a mesh). When the target's
    params live on a mesh (`sharding.shard_model`), the pair carries it, so caches are placed
    on it too."""
    sharding = getattr(target.params["embed"], "sharding", None)
    return Pair(tparams=decode_params(target), tconfig=target.config,
                dparams=None if draft is None else decode_params(draft),
                dconfig=None if draft is None else draft.config,
                mesh=sharding.mesh if isinstance(sharding, NamedSharding) else None)


def empty_cache(pair: Pair, which: str, rows: int, slots: int) -> KVCache:
    """An empty KV cache for the pair's "target" or "draft" (B = rows, S = slots), in the
    model's dtype. The target's defers its writes (`kv_cache.settle`: its one commit a round
    then comes before the next round's reads, and XLA updates it in place instead of copying
    it); the draft's, committed between its forwards within a round, writes at once. On a
    mesh it is placed as `sharding.cache_spec` says (rows over "data", kv heads over "model"),
    so every method's caches are laid out like the K/V the sharded forward computes instead
    of wherever XLA's propagation puts a buffer of zeros."""
    model_config, params = ((pair.tconfig, pair.tparams) if which == "target"
                            else (pair.dconfig, pair.dparams))
    cache = init_cache(model_config, rows, slots, params["embed"].dtype,
                       PENDING_SLOTS if which == "target" else 0)
    if pair.mesh is None:
        return cache

    def placed(x):  # x [L, B, S or pending slots, K, D]
        spec = cache_spec(model_config, rows, x.shape[2], pair.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(pair.mesh, spec))

    cache = cache.replace(k=placed(cache.k), v=placed(cache.v))
    if cache.pending is None:
        return cache
    return cache.replace(pending=cache.pending.replace(k=placed(cache.pending.k),
                                                       v=placed(cache.pending.v)))


def init_sequences(prompt: jax.Array, prompt_lengths: jax.Array, slots: int) -> Sequences:
    """prompt int32[B,P] right-padded, prompt_lengths int32[B] -> Sequences with S = slots."""
    B, P = prompt.shape
    tokens = jnp.zeros((B, slots), jnp.int32).at[:, :P].set(prompt)
    return Sequences(tokens=tokens, lengths=prompt_lengths.astype(jnp.int32),
                     prompt_lengths=prompt_lengths.astype(jnp.int32),
                     done=jnp.zeros((B,), bool))


def empty_sequences(rows: int, slots: int) -> Sequences:
    """B = rows empty rows (done, one pending token 0 at position 0) of S = slots."""
    one = jnp.ones((rows,), jnp.int32)
    return Sequences(tokens=jnp.zeros((rows, slots), jnp.int32), lengths=one, prompt_lengths=one,
                     done=jnp.ones((rows,), bool))


def set_rows(tree, rows: jax.Array, values):
    """Every leaf x [B, ...] of tree with x[rows] = the matching leaf of values [R, ...]."""
    return jax.tree_util.tree_map(lambda x, v: x.at[rows].set(v.astype(x.dtype)), tree, values)


def insert_sequences(seq: Sequences, rows: jax.Array, prompt: jax.Array,
                     prompt_lengths: jax.Array) -> Sequences:
    """Rows int32[R] of seq restart with prompt int32[R,P] (right-padded), prompt_lengths
    int32[R]: live, nothing generated yet (logprob buffers zeroed, when seq has them)."""
    fresh = logprobs.buffers_like(seq, init_sequences(prompt, prompt_lengths,
                                                      seq.tokens.shape[1]))
    return set_rows(seq, rows, constrained.buffers_like(seq, fresh))


def set_cache_rows(cache: KVCache, rows: jax.Array, fresh: KVCache) -> KVCache:
    """cache [L, B, S, ...] with rows int32[R] replaced by fresh [L, R, S, ...] (a settled
    cache: the other rows' pending writes are written first)."""
    cache = settle(cache)
    return with_empty_pending(cache.replace(
        k=cache.k.at[:, rows].set(fresh.k), v=cache.v.at[:, rows].set(fresh.v),
        lengths=cache.lengths.at[rows].set(fresh.lengths)))


def prefill_rows(params, model_config, cache: KVCache, rows: jax.Array, prompt: jax.Array,
                 prompt_lengths: jax.Array) -> KVCache:
    """The rows int32[R] of cache refilled from prompt int32[R,P] (`prefill` of those rows)."""
    fresh = prefill(params, model_config, prompt, prompt_lengths, cache.num_slots, cache.k.dtype)
    return set_cache_rows(cache, rows, fresh)


def read_emitted(seq: Sequences, since: jax.Array, width: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The tokens each row received after position since int32[B]: -> (tokens int32[B,E=width],
    counts int32[B]); slots past counts hold garbage. The engine reads what a step emitted."""
    S = seq.tokens.shape[1]
    idx = jnp.clip(since[:, None] + jnp.arange(width, dtype=jnp.int32)[None], 0, S - 1)
    return jnp.take_along_axis(seq.tokens, idx, 1), jnp.minimum(seq.lengths - since, width)


def end_ids(limits: Limits, tokens: jax.Array) -> jax.Array:
    """bool, tokens' shape int32[B,A]: which tokens are one of their row's end-of-sequence ids
    (`Limits.eos_token_id`, shared or per row)."""
    eos = jnp.atleast_1d(limits.eos_token_id)
    eos = eos[:, None, :] if eos.ndim == 2 else eos  # per row: [B, 1, n_eos]
    return jnp.any(tokens[..., None] == eos, axis=-1)


def chain_may_grow(limits: Optional[Limits], seq: Sequences, last: jax.Array,
                   drafted: jax.Array) -> jax.Array:
    """bool[B]: rows whose draft chain of `drafted` tokens (int32[B]), the last of them `last`
    (int32[B]), is worth another draft forward. Not after an end-of-sequence id (nothing past it
    is ever emitted), nor once the chain holds every token but one that the row may still
    receive (`max_new_tokens` less those generated): the round's own target token is the last;
    nor in a finished row (a batch's draft forwards end once its live rows stop). Each stop
    depends only on the chain and the limits, so a sampled round stays lossless as with
    adaptive drafting (the accept rule reads `drafted`). limits None: always."""
    if limits is None:
        return jnp.ones(drafted.shape, bool)
    room = limits.max_new_tokens - seq.generated
    return (drafted < room - 1) & ~end_ids(limits, last[:, None])[:, 0] & ~seq.done


def emit(seq: Sequences, new: jax.Array, counts: jax.Array, limits: Limits,
         lp: Optional[logprobs.TokenLogprobs] = None) -> tuple[Sequences, jax.Array]:
    """Appends new[b, :counts[b]] to each live row, cut after an EOS and at max_new_tokens.

    new int32[B,A], counts int32[B]; lp: their logprobs, written beside them (None: none
    computed, `logprobs.walk_logprobs`). Returns (sequences, kept int32[B]): how many tokens each
    row really received (0 for finished rows). The kept tokens are always a prefix of `new`.
    """
    B, A = new.shape
    a = jnp.arange(A, dtype=jnp.int32)[None, :]
    room = limits.max_new_tokens - seq.generated
    valid = (a < counts[:, None]) & (a < room[:, None]) & ~seq.done[:, None]
    is_eos = end_ids(limits, new) & valid
    first_eos = jnp.min(jnp.where(is_eos, a, A), axis=1)
    valid = valid & (a <= first_eos[:, None])
    kept = jnp.sum(valid, axis=1).astype(jnp.int32)
    S = seq.tokens.shape[1]
    slot = jnp.where(valid, seq.lengths[:, None] + a, S)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
    tokens = seq.tokens.at[rows, slot].set(new, mode="drop")
    seq = logprobs.write(seq, rows, slot, lp)
    seq = constrained.advance_rows(limits.constraint, seq, new, kept)
    lengths = seq.lengths + kept
    done = seq.done | (first_eos < A) | (lengths - seq.prompt_lengths >= limits.max_new_tokens)
    return seq.replace(tokens=tokens, lengths=lengths, done=done), kept


def prefill(params, model_config, prompt: jax.Array, prompt_lengths: jax.Array, slots: int,
            cache_dtype) -> KVCache:
    """Fills a fresh cache with every prompt token but the pending last one.

    prompt int32[B,P] right-padded. One causal forward; padding and the last token are computed
    but not committed, and the LM head is skipped (no logits are needed here).
    """
    B, P = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    mask = causal_mask(B, P)
    _, new = forward(params, model_config, prompt, positions, mask, cache=None,
                     select=jnp.zeros((B, 1), jnp.int32))
    # The empty cache is built from the prompt's K/V directly rather than committed into a
    # cache of zeros: that commit gathers from a constant with constant indices, which XLA
    # constant-folds at compile time (2-4 s per cache for SmolLM2 at P = 1024, on every
    # first call). Same contents: the kept K/V, zeros elsewhere.
    counts = (prompt_lengths - 1).astype(jnp.int32)
    keep = (jnp.arange(P)[None, :] < counts[:, None])[None, :, :, None, None]
    pad = ((0, 0), (0, 0), (0, slots - P), (0, 0), (0, 0))
    k, v = (jnp.pad(jnp.where(keep, x, 0).astype(cache_dtype), pad) for x in (new.k, new.v))
    return KVCache(k=k, v=v, lengths=counts)


@struct.dataclass
class Stats:
    """On-device counters of one decode loop, named as in docs/algorithm.md section 4: the ones
    every method counts, plus the method's own (`own`, a dataclass of its counters, each with a
    `to_dict`) and the summaries taken after its loop (`summary`, a dict). `to_dict` gives the
    named counters that `generate.summarize_stats` turns into the user-facing stats dict.

    Attributes:
        new_tokens: int32[B], tokens each row received (EOS included, nothing after it).
        rounds: int32[B], target forwards each row took part in (rows not yet done).
        target_calls: int32[], target forwards of the loop (prefill excluded).
        draft_calls: int32[], draft forwards (Ouroboros: summed over the rows taking part).
        draft_tokens: int32[], draft tokens those forwards produced (c = draft_tokens /
            draft_calls).
        acceptance_histogram: int32[bins], rounds by the number of tokens a row kept.
        proposed: int32[B], draft tokens each row offered the target for verification (its
            chain; lookahead: its best guess): the engine's per-request figure, not reported
            by `generate`.
        by_source: int32[B, len(SOURCES)], accepted draft tokens (kept tokens past the
            target's own one per round) by where they came from (`SOURCES`): the engine's
            per-request and Prometheus figures.
        own: the method's own counters (speculative `SpeculativeCounters`, lookahead
            `LookaheadCounters`, Ouroboros `OuroborosCounters`), None for vanilla.
        summary: {name: value} taken after the loop (pool_hit_rate, pool_occupancy,
            match_vs_accept; pool_bytes added on the host), None before.
    """

    new_tokens: jax.Array
    rounds: jax.Array
    target_calls: jax.Array
    draft_calls: jax.Array
    draft_tokens: jax.Array
    acceptance_histogram: jax.Array
    proposed: jax.Array
    by_source: Optional[jax.Array] = None
    own: Any = None
    summary: Optional[dict] = None

    def to_dict(self) -> dict:
        """{name: value} of every counter this method has, in name order: what
        `generate.summarize_stats` reads."""
        d = {n: getattr(self, n) for n in ("new_tokens", "rounds", "target_calls",
                                           "draft_calls", "draft_tokens", "acceptance_histogram")}
        if self.own is not None:
            d.update(self.own.to_dict())
        d.update(self.summary or {})
        return dict(sorted(d.items()))


def counters_dict(counters) -> dict:
    """A method's counters dataclass -> {field name: value} (its `to_dict`)."""
    return {f.name: getattr(counters, f.name) for f in dataclasses.fields(counters)}


def counter() -> jax.Array:
    """A fresh int32[] counter, for a method's own `Stats` fields."""
    return jnp.zeros((), jnp.int32)


# Where an accepted draft token came from: the draft model's chain (speculative, Ouroboros),
# a pool phrase (Ouroboros' lengthening branches, lookahead's guesses; phrases harvested from
# the context and from generation alike), a span of the context (prompt lookup)
SOURCES = ("draft_chain", "pool_phrases", "prompt_lookup")


def source_labels(size: int, **nodes) -> np.ndarray:
    """int32[T = size]: each tree node's source (an index into SOURCES; -1 for the root and
    nodes no walk takes), from {source name: node indices}."""
    labels = np.full((size,), -1, np.int32)
    for name, idx in nodes.items():
        labels[np.asarray(idx, np.int64)] = SOURCES.index(name)
    return labels


def init_stats(batch: int, hist_bins: int, own=None) -> Stats:
    """Zeroed common counters, with the method's own zeroed counters `own`."""
    return Stats(new_tokens=jnp.zeros((batch,), jnp.int32), rounds=jnp.zeros((batch,), jnp.int32),
                 target_calls=counter(), draft_calls=counter(), draft_tokens=counter(),
                 acceptance_histogram=jnp.zeros((hist_bins,), jnp.int32),
                 proposed=jnp.zeros((batch,), jnp.int32),
                 by_source=jnp.zeros((batch, len(SOURCES)), jnp.int32), own=own)


def count_sources(stats: Stats, live: jax.Array, kept: jax.Array, path: jax.Array,
                  labels: np.ndarray) -> Stats:
    """Adds a round's accepted draft tokens by source: the walk's nodes path[:, 1:kept]
    (path int32[B,A], tree indices; labels int32[T] static, `source_labels`) of live rows."""
    lab = jnp.asarray(labels)[path[:, 1:]]  # [B, A-1]
    j = jnp.arange(path.shape[1] - 1, dtype=jnp.int32)[None]
    take = (j < kept[:, None] - 1) & live[:, None]
    hit = (lab[..., None] == jnp.arange(len(SOURCES))) & take[..., None]
    return stats.replace(by_source=stats.by_source + jnp.sum(hit, axis=1, dtype=jnp.int32))


def count_round(stats: Stats, live: jax.Array, kept: jax.Array, proposed=None,
                sources=None) -> Stats:
    """Adds one target forward: live bool[B] (rows not finished before it), kept int32[B],
    proposed int32[B] (draft tokens each row offered; None: none), sources (path, labels):
    the walk's nodes and their sources (`count_sources`; None: a round without drafts)."""
    bins = stats.acceptance_histogram.shape[0]
    hist = stats.acceptance_histogram.at[jnp.clip(kept, 0, bins - 1)].add(
        live.astype(jnp.int32))
    if proposed is not None:
        stats = stats.replace(proposed=stats.proposed + jnp.where(live, proposed, 0))
    if sources is not None:
        stats = count_sources(stats, live, kept, *sources)
    return stats.replace(new_tokens=stats.new_tokens + kept,
                         rounds=stats.rounds + live.astype(jnp.int32),
                         target_calls=stats.target_calls + 1, acceptance_histogram=hist)


def whole_counted(hist: jax.Array, rows: jax.Array, kept: jax.Array) -> jax.Array:
    """hist int32[bins] plus this round's rows bool[B] binned by tokens kept (int32[B], the
    last bin holding every longer round): a chain method's histogram of the rounds whose
    chain the draft offered whole, which auto reads the pair's agreement by depth from
    (`speculative.chain_lesson`)."""
    return hist.at[jnp.clip(kept, 0, hist.shape[0] - 1)].add(rows.astype(jnp.int32))


def check_int(obj, name: str, lo: int, hi: Optional[int] = None) -> None:
    """Config validation: obj.<name> must be an int (not a bool) in [lo, hi]; else a ValueError
    naming the config class and field."""
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{type(obj).__name__}.{name} must be an integer {rng}, got {v!r}")


def check_fraction(obj, name: str) -> None:
    """Config validation: obj.<name> must be a number (not a bool) in [0, 1); else a ValueError
    naming the config class and field."""
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
        raise ValueError(f"{type(obj).__name__}.{name} must be a number in [0, 1), got {v!r}")


def check_bool(obj, *names: str) -> None:
    """Config validation: each obj.<name> must be a bool; else a ValueError naming the config
    class and field."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, bool):
            raise ValueError(f"{type(obj).__name__}.{name} must be a bool, got {v!r}")


def loop_config(cfg):
    """A pool-keeping method's config as its compiled loop sees it: `history` and `pool_rows`
    only shape the starting pool (`pool.prepare_pool`), so they are normalized away and toggling
    them never recompiles the loop."""
    return dataclasses.replace(cfg, history=True, pool_rows=None)


def decode_loop(step, state):
    """The one driver every method shares: `step(state) -> state` under a `lax.while_loop`
    until every row of `state.seq` is done (EOS or max_new_tokens), all on device."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.seq.done), step, state)


def pool_summary(stats: Stats, pool) -> dict:
    """Summaries of a pool-keeping method after its loop: pool_hit_rate (rounds whose key had
    a phrase / rounds) and pool_occupancy."""
    rounds = jnp.maximum(jnp.sum(stats.rounds), 1)
    return dict(pool_hit_rate=stats.own.pool_hits / rounds, pool_occupancy=pool_occupancy(pool))


def pool_with_context(state, rows: jax.Array, prompt: jax.Array, prompt_lengths: jax.Array,
                      on: bool):
    """A pool-keeping method's pool once rows int32[R] start prompt int32[R,P]: with `on` (its
    config's `context_phrases`, static) the prompts' n-grams inserted (`pool.insert_context`),
    so lookups can copy from the prompt from the first round; under the rows' own key ranges
    when the state has them (`key_offset`, the engine's per-request pools)."""
    if not on:
        return state.pool
    offset = None if state.key_offset is None else state.key_offset[rows]
    return insert_context(state.pool, prompt, prompt_lengths, offset)


def plain_step(params, model_config, greedy: bool, sp, limits: Limits, seq: Sequences,
               cache: KVCache) -> tuple[Sequences, KVCache, jax.Array, jax.Array]:
    """One vanilla token per row: forward the pending token, choose the next, commit the
    pending KV. -> (seq, cache, live bool[B] before the step, kept int32[B])."""
    B = seq.tokens.shape[0]
    pos = (seq.lengths - 1)[:, None]
    cache = settle(cache)
    logits, new = forward(params, model_config, seq.last[:, None], pos,
                          jnp.ones((B, 1, 1), bool), cache)
    logits = constrained.masked(limits, constrained.root_states(limits, seq), logits)
    tok = choose_tokens(logits, pos + 1, sp, greedy)
    live = ~seq.done
    lp = logprobs.walk_logprobs(logits, jnp.zeros((B, 1), jnp.int32), tok, sp, greedy)
    seq, kept = emit(seq, tok, jnp.ones((B,), jnp.int32), limits, lp)
    return seq, commit_prefix(cache, new, kept), live, kept


def follow_draft(params, model_config, seq_before: Sequences, cache: KVCache, kept: jax.Array
                 ) -> KVCache:
    """Keeps a draft's cache as far behind the sequence as it was, across a round without
    drafting (`plain_step`, kept int32[B] tokens per row, 0 or 1): the draft processes the one
    token at its cache length. Its lag behind the pending token, which each method's first
    draft forward of a round catches up on, is then unchanged."""
    B, S = seq_before.tokens.shape
    cache = settle(cache)
    pos = cache.lengths[:, None]
    tok = jnp.take_along_axis(seq_before.tokens, jnp.minimum(pos, S - 1), 1)
    _, new = forward(params, model_config, tok, pos, jnp.ones((B, 1, 1), bool), cache,
                     select=jnp.zeros((B, 1), jnp.int32))
    return commit_prefix(cache, new, kept)


def make_runner(init, insert, round_fn, finish):
    """generate's loop over a method's seam functions, jitted: init B empty rows, insert every
    row's prompt, rounds under one while_loop until every row is done, then `finish`.

    The runner's signature, the same for every method: (pair, prompt int32[B,P],
    prompt_lengths int32[B], limits, sampling, pool, *, cfg, slots, greedy) -> (Sequences,
    Stats, pool or None)."""

    def run(pair: Pair, prompt, prompt_lengths, limits: Limits, sp, pool, *, cfg, slots: int,
            greedy: bool):
        B = prompt.shape[0]
        state = init(pair, cfg, B, slots, pool)
        state = state.replace(seq=constrained.with_buffers(
            logprobs.with_buffers(state.seq, sp.logprobs), limits.constraint))
        state = insert(pair, cfg, state, jnp.arange(B, dtype=jnp.int32), prompt, prompt_lengths)
        state = decode_loop(partial(round_fn, pair, cfg, greedy, sp, limits), state)
        return state.seq, finish(state), getattr(state, "pool", None)

    return jax.jit(run, static_argnames=("cfg", "slots", "greedy"))


def run_rounds(round_fn, rounds: int, state):
    """Up to `rounds` (static) calls of round_fn(state) -> state, stopping early once every row
    is done: the engine's device step. Returns (state, kept int32[rounds, B], live
    bool[rounds, B], proposed int32[rounds, B]): what each round gave each row."""
    B = state.seq.tokens.shape[0]
    z = jnp.zeros((rounds, B), jnp.int32)

    def body(c):
        i, st, kept, live, prop = c
        new = round_fn(st)
        d_kept = new.stats.new_tokens - st.stats.new_tokens
        d_live = new.stats.rounds - st.stats.rounds
        d_prop = new.stats.proposed - st.stats.proposed
        return (i + 1, new, kept.at[i].set(d_kept), live.at[i].set(d_live),
                prop.at[i].set(d_prop))

    i, state, kept, live, prop = jax.lax.while_loop(
        lambda c: (c[0] < rounds) & ~jnp.all(c[1].seq.done), body,
        (jnp.zeros((), jnp.int32), state, z, z, z))
    return state, kept, live.astype(bool), prop
