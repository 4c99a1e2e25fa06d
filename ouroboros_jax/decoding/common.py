"""What every decoding method shares: the sequence buffer, emitting tokens with EOS and
`max_new_tokens` cut-offs, prefill, and the on-device stats counters.

Convention used by every method: a row's sequence holds `lengths[b]` tokens (prompt, then new
tokens); its KV cache holds the first `lengths[b] - 1` of them. The last token is "pending": it
is the root of the next forward, whose K/V are computed then. Vanilla decoding is the one-node
case of the same rule.

Letters (package glossary): B rows, P prompt width, S buffer slots (= cache slots), A tokens
offered to `emit` at once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..models import forward
from ..models.kv_cache import KVCache


@struct.dataclass
class Sequences:
    """The token buffer every method's loop carries.

    Attributes:
        tokens: int32[B,S], the prompt then the generated tokens; garbage past lengths.
        lengths: int32[B], tokens held per row; the last one is pending (not in the cache).
        prompt_lengths: int32[B], the prompt's share of lengths.
        done: bool[B], the row stopped (EOS emitted or max_new_tokens reached).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    done: jax.Array

    @property
    def last(self) -> jax.Array:
        """int32[B]: the pending token of each row."""
        return jnp.take_along_axis(self.tokens, (self.lengths - 1)[:, None], 1)[:, 0]

    @property
    def generated(self) -> jax.Array:
        return self.lengths - self.prompt_lengths


@struct.dataclass
class Limits:
    """Dynamic stopping rules (arrays: changing them never recompiles).

    Attributes:
        max_new_tokens: int32[], the most tokens a row generates.
        eos_token_id: int32[n_eos] (or int32[]): a row stops after any of these ids; -1 pads.
    """

    max_new_tokens: jax.Array
    eos_token_id: jax.Array


def init_sequences(prompt: jax.Array, prompt_lengths: jax.Array, slots: int) -> Sequences:
    """prompt int32[B,P] right-padded, prompt_lengths int32[B] -> Sequences with S = slots."""
    B, P = prompt.shape
    tokens = jnp.zeros((B, slots), jnp.int32).at[:, :P].set(prompt)
    return Sequences(tokens=tokens, lengths=prompt_lengths.astype(jnp.int32),
                     prompt_lengths=prompt_lengths.astype(jnp.int32),
                     done=jnp.zeros((B,), bool))


def emit(seq: Sequences, new: jax.Array, counts: jax.Array, limits: Limits
         ) -> tuple[Sequences, jax.Array]:
    """Appends new[b, :counts[b]] to each live row, cut after an EOS and at max_new_tokens.

    new int32[B,A], counts int32[B]. Returns (sequences, kept int32[B]): how many tokens each
    row really received (0 for finished rows). The kept tokens are always a prefix of `new`.
    """
    B, A = new.shape
    a = jnp.arange(A, dtype=jnp.int32)[None, :]
    room = limits.max_new_tokens - seq.generated
    valid = (a < counts[:, None]) & (a < room[:, None]) & ~seq.done[:, None]
    eos = jnp.atleast_1d(limits.eos_token_id)
    is_eos = jnp.any(new[..., None] == eos, axis=-1) & valid
    first_eos = jnp.min(jnp.where(is_eos, a, A), axis=1)
    valid = valid & (a <= first_eos[:, None])
    kept = jnp.sum(valid, axis=1).astype(jnp.int32)
    S = seq.tokens.shape[1]
    slot = jnp.where(valid, seq.lengths[:, None] + a, S)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, A))
    tokens = seq.tokens.at[rows, slot].set(new, mode="drop")
    lengths = seq.lengths + kept
    done = seq.done | (first_eos < A) | (lengths - seq.prompt_lengths >= limits.max_new_tokens)
    return seq.replace(tokens=tokens, lengths=lengths, done=done), kept


def prefill(params, config, prompt: jax.Array, prompt_lengths: jax.Array, slots: int,
            cache_dtype) -> KVCache:
    """Fills a fresh cache with every prompt token but the pending last one.

    prompt int32[B,P] right-padded. One causal forward; padding and the last token are computed
    but not committed, and the LM head is skipped (no logits are needed here).
    """
    B, P = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((P, P), bool)), (B, P, P))
    _, new = forward(params, config, prompt, positions, mask, cache=None,
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


@struct.dataclass(kw_only=True)
class Stats:
    """On-device counters of one decode loop, named as in docs/algorithm.md section 4.

    Every method counts the first six; a method's own counters and the summaries taken after
    its loop are None where it does not have them (None is an empty pytree: no carry cost).
    `to_dict` gives the named counters that `generate.summarize_stats` turns into the
    user-facing stats dict.

    Attributes:
        new_tokens: int32[B], tokens each row received (EOS included, nothing after it).
        rounds: int32[B], target forwards each row took part in (rows not yet done).
        target_calls: int32[], target forwards of the loop (prefill excluded).
        draft_calls: int32[], draft forwards (Ouroboros: summed over the rows taking part).
        draft_tokens: int32[], draft tokens those forwards produced (c = draft_tokens /
            draft_calls).
        acceptance_histogram: int32[bins], rounds by the number of tokens a row kept.
        drafted_tokens: speculative, int32[]: tokens proposed (adaptive drafting proposes
            fewer than gamma).
        draft_forwards: Ouroboros, int32[]: batch draft forwards.
        guess_tokens_accepted: lookahead, int32[]: tokens accepted from pool guesses.
        suffix_tokens_accepted: Ouroboros, int32[]: tokens accepted from pool branches.
        pool_hits: lookahead and Ouroboros, int32[]: row rounds whose key had a pool phrase.
        draft_matches: Ouroboros, int32[]: chain draft tokens equal to the target's choice.
        draft_accepted: Ouroboros, int32[]: chain draft tokens accepted.
        pool_hit_rate: after the loop (`pool_summary`), f32[]: pool_hits / rounds.
        pool_occupancy: after the loop, int32[]: filled pool slots.
        match_vs_accept: after Ouroboros' loop, f32[2]: draft_matches and draft_accepted per
            round (paper Table 1).
        pool_bytes: after the loop (host int): device bytes of the pool.
    """

    # Declared in name order (keyword-only): the loop carry's leaves then come in the order the
    # former dict of counters had, so the compiled loops are the same programs.
    acceptance_histogram: jax.Array
    draft_accepted: Optional[jax.Array] = None
    draft_calls: jax.Array
    draft_forwards: Optional[jax.Array] = None
    draft_matches: Optional[jax.Array] = None
    draft_tokens: jax.Array
    drafted_tokens: Optional[jax.Array] = None
    guess_tokens_accepted: Optional[jax.Array] = None
    match_vs_accept: Optional[jax.Array] = None
    new_tokens: jax.Array
    pool_bytes: Optional[int] = None
    pool_hit_rate: Optional[jax.Array] = None
    pool_hits: Optional[jax.Array] = None
    pool_occupancy: Optional[jax.Array] = None
    rounds: jax.Array
    suffix_tokens_accepted: Optional[jax.Array] = None
    target_calls: jax.Array

    def to_dict(self) -> dict:
        """{name: value} of every counter this method has (the None ones left out), in name
        order: what `generate.summarize_stats` reads."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


def counter() -> jax.Array:
    """A fresh int32[] counter, for a method's own `Stats` fields."""
    return jnp.zeros((), jnp.int32)


def init_stats(batch: int, hist_bins: int) -> Stats:
    """Zeroed common counters (a method adds its own with `.replace(name=counter())`)."""
    return Stats(new_tokens=jnp.zeros((batch,), jnp.int32), rounds=jnp.zeros((batch,), jnp.int32),
                 target_calls=counter(), draft_calls=counter(), draft_tokens=counter(),
                 acceptance_histogram=jnp.zeros((hist_bins,), jnp.int32))


def count_round(stats: Stats, live: jax.Array, kept: jax.Array) -> Stats:
    """Adds one target forward: live bool[B] (rows not finished before it), kept int32[B]."""
    bins = stats.acceptance_histogram.shape[0]
    hist = stats.acceptance_histogram.at[jnp.clip(kept, 0, bins - 1)].add(
        live.astype(jnp.int32))
    return stats.replace(new_tokens=stats.new_tokens + kept,
                         rounds=stats.rounds + live.astype(jnp.int32),
                         target_calls=stats.target_calls + 1, acceptance_histogram=hist)


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


def loop_config(cfg):
    """A pool-keeping method's config as its compiled loop sees it: `history` and `pool_rows`
    only shape the starting pool (`pool.prepare_pool`), so they are normalized away and toggling
    them never recompiles the loop."""
    return dataclasses.replace(cfg, history=True, pool_rows=None)


def decode_loop(step, state):
    """The one driver every method shares: `step(state) -> state` under a `lax.while_loop`
    until every row of `state.seq` is done (EOS or max_new_tokens), all on device."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.seq.done), step, state)


def pool_summary(stats: Stats, pool) -> Stats:
    """Stats of a pool-keeping method after its loop: pool_hit_rate (rounds whose key had a
    phrase / rounds) and pool_occupancy."""
    from ..pool import pool_occupancy

    rounds = jnp.maximum(jnp.sum(stats.rounds), 1)
    return stats.replace(pool_hit_rate=stats.pool_hits / rounds,
                         pool_occupancy=pool_occupancy(pool))
