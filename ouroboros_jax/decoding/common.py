"""What every decoding method shares: the sequence buffer, emitting tokens with EOS and
`max_new_tokens` cut-offs, prefill, and the on-device stats counters.

Convention used by every method: a row's sequence holds `lengths[b]` tokens (prompt, then new
tokens); its KV cache holds the first `lengths[b] - 1` of them. The last token is "pending": it
is the root of the next forward, whose K/V are computed then. Vanilla decoding is the one-node
case of the same rule.

Glossary: B rows, S buffer slots (= cache slots), A tokens offered to `emit` at once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..models import forward
from ..models.kv_cache import KVCache, commit_prefix, init_cache


@struct.dataclass
class Sequences:
    tokens: jax.Array  # int32[B,S]: prompt then generated tokens, garbage past lengths
    lengths: jax.Array  # int32[B]
    prompt_lengths: jax.Array  # int32[B]
    done: jax.Array  # bool[B]

    @property
    def last(self) -> jax.Array:
        """int32[B]: the pending token of each row."""
        return jnp.take_along_axis(self.tokens, (self.lengths - 1)[:, None], 1)[:, 0]

    @property
    def generated(self) -> jax.Array:
        return self.lengths - self.prompt_lengths


@struct.dataclass
class Limits:
    """Dynamic stopping rules (arrays: changing them never recompiles)."""

    max_new_tokens: jax.Array  # int32[]
    eos_token_id: jax.Array  # int32[E] (or int32[]): stop at any of these ids; -1 pads


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
    cache = init_cache(config, B, slots, cache_dtype)
    _, new = forward(params, config, prompt, positions, mask, cache=None,
                     select=jnp.zeros((B, 1), jnp.int32))
    return commit_prefix(cache, new, prompt_lengths - 1)


def init_stats(batch: int, hist_bins: int) -> dict:
    """On-device counters, named as in docs/algorithm.md section 4."""
    z = lambda: jnp.zeros((), jnp.int32)
    return {
        "new_tokens": jnp.zeros((batch,), jnp.int32),
        "rounds": jnp.zeros((batch,), jnp.int32),  # target forwards each row took part in
        "target_calls": z(),
        "draft_calls": z(),
        "draft_tokens": z(),
        "acceptance_histogram": jnp.zeros((hist_bins,), jnp.int32),
    }


def count_round(stats: dict, live: jax.Array, kept: jax.Array) -> dict:
    """Adds one target forward: live bool[B] (rows not finished before it), kept int32[B]."""
    bins = stats["acceptance_histogram"].shape[0]
    hist = stats["acceptance_histogram"].at[jnp.clip(kept, 0, bins - 1)].add(
        live.astype(jnp.int32))
    return {**stats, "new_tokens": stats["new_tokens"] + kept,
            "rounds": stats["rounds"] + live.astype(jnp.int32),
            "target_calls": stats["target_calls"] + 1, "acceptance_histogram": hist}


def check_int(obj, name: str, lo: int, hi: Optional[int] = None) -> None:
    """Config validation: obj.<name> must be an int (not a bool) in [lo, hi]; else a ValueError
    naming the config class and field."""
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{type(obj).__name__}.{name} must be an integer {rng}, got {v!r}")


def loop_config(cfg):
    """A pool-keeping method's config as its compiled loop sees it: `history` and `pool_rows`
    only shape the starting pool (`pool.prepare_pool`), so they are normalized away and toggling
    them never recompiles the loop."""
    return dataclasses.replace(cfg, history=True, pool_rows=None)


def decode_loop(step, state):
    """The one driver every method shares: `step(state) -> state` under a `lax.while_loop`
    until every row of `state.seq` is done (EOS or max_new_tokens), all on device."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.seq.done), step, state)


def pool_summary(stats: dict, pool) -> dict:
    """Stats of a pool-keeping method after its loop: pool_hit_rate (rounds whose key had a
    phrase / rounds) and pool_occupancy."""
    from ..pool import pool_occupancy

    rounds = jnp.maximum(jnp.sum(stats["rounds"]), 1)
    return {**stats, "pool_hit_rate": stats["pool_hits"] / rounds,
            "pool_occupancy": pool_occupancy(pool)}

