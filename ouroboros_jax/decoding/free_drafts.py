"""Free drafts (issue 52): a chain for an Ouroboros round from sources that cost no draft
forward, the row's own context (prompt + output so far) and the phrase pool.

Per row, each source offers its best continuation of the row's last tokens, scored by its
match length: how many of the row's last tokens (the pending one included) the tokens before
the proposal repeat.

 - context: prompt lookup's own ranking (`prompt_lookup.ranked_candidates`, one candidate of
   up to γ tokens, matches of at most M = N-1 tokens): the longest match, then the most tokens
   inside the row, then the most recent;
 - pool: the phrases stored under the token j places before the pending one (j = 0 .. M-1)
   whose first j tokens are the row's last j tokens continue it with their other M - j
   tokens; the match is j + 1 (the key counts). The longest match wins, then the newest
   phrase (`pool.lookup` order). The pool keeps recency, not acceptance, so recency is the
   only history it offers.

The row's free proposal is the better of the two (longer match; on a tie the one offering
more tokens, the context first). Ouroboros takes the free path for a row whose proposal has
at least one token and a match of at least `free_threshold` (`ouroboros.OuroborosConfig`).

Letters (package glossary): B rows, S buffer slots, γ gamma (chain slots), M = N-1 phrase
tokens, G guesses (phrases per pool key).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..pool import PhrasePool, lookup
from .common import Sequences
from .prompt_lookup import PromptLookupConfig, ranked_candidates


@struct.dataclass
class FreeDraft:
    """Each row's best free proposal for its chain.

    Attributes:
        tokens: int32[B,γ], the proposal (0 past count).
        count: int32[B], its tokens (0: no source offered one).
        run: int32[B], its match length (0: none), in [0, M].
        from_context: bool[B], the context offered it (else the pool).
    """

    tokens: jax.Array
    count: jax.Array
    run: jax.Array
    from_context: jax.Array


def context_match(seq: Sequences, gamma: int, max_match: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The context's best continuation (prompt lookup's ranking, matches of at most
    max_match tokens): -> (tokens int32[B,γ], count int32[B], run int32[B])."""
    cfg = PromptLookupConfig(max_ngram=max_match, min_ngram=1, candidates=1, length=gamma)
    cand, valid, run = ranked_candidates(seq.tokens, seq.lengths, cfg)
    return cand[:, 0], jnp.sum(valid[:, 0], axis=1, dtype=jnp.int32), run[:, 0]


def pool_match(pool: PhrasePool, seq: Sequences, key_offset: Optional[jax.Array] = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pool's best continuation of each row: -> (tokens int32[B,M], count int32[B],
    run int32[B]), see the module docstring. key_offset int32[B] (None: 0) moves the row's
    keys into its own range, as every pool read of the row does."""
    B, S = seq.tokens.shape
    m, g = pool.phrase_len, pool.guesses
    j = jnp.arange(m, dtype=jnp.int32)
    at = seq.lengths[:, None] - 1 - j[None]  # [B,M]: tail[:, j] = the token j before the last
    tail = jnp.take_along_axis(seq.tokens, jnp.clip(at, 0, S - 1), 1)
    keys = tail if key_offset is None else tail + key_offset[:, None]
    phrases, found = lookup(pool, jnp.where(at >= 0, keys, -1), g)  # [B,M(j),G,M], [B,M,G]
    # under the key j tokens back, a phrase continues the row when its tokens i < j are the
    # row's last j tokens: phrase[i] == tail[j - 1 - i]
    i = j
    need = i[None, :] < j[:, None]  # [M(j), M(i)]
    want = tail[:, jnp.clip(j[:, None] - 1 - i[None, :], 0, m - 1)]  # [B, M(j), M(i)]
    agree = jnp.all((phrases == want[:, :, None, :]) | ~need[None, :, None, :], axis=-1) & found
    score = jnp.where(agree, (j + 1)[None, :, None], 0).reshape(B, m * g)
    best = jnp.argmax(score, axis=1)  # the longest match; among its phrases the newest
    run = jnp.max(score, axis=1).astype(jnp.int32)
    jb = (best // g).astype(jnp.int32)
    phrase = phrases.reshape(B, m * g, m)[jnp.arange(B), best]  # [B,M]
    shifted = jnp.take_along_axis(phrase, jnp.clip(jb[:, None] + j[None], 0, m - 1), 1)
    count = jnp.where(run > 0, m - jb, 0).astype(jnp.int32)
    return jnp.where(j[None] < count[:, None], shifted, 0), count, run


def _fit(tokens: jax.Array, count: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """tokens int32[B,W'] cut or zero-padded to [B,width], count clipped to width."""
    have = tokens.shape[1]
    if have >= width:
        return tokens[:, :width], jnp.minimum(count, width)
    return jnp.pad(tokens, ((0, 0), (0, width - have))), count


def free_proposal(seq: Sequences, pool: PhrasePool, gamma: int,
                  key_offset: Optional[jax.Array] = None) -> FreeDraft:
    """Each row's best free proposal of up to γ tokens from its context and the pool
    (matches of at most M = the pool's phrase length, so both sources score on one scale)."""
    m = pool.phrase_len
    c_tok, c_n, c_run = context_match(seq, gamma, m)
    p_tok, p_n, p_run = pool_match(pool, seq, key_offset)
    p_tok, p_n = _fit(p_tok, p_n, gamma)
    ctx = (c_run > p_run) | ((c_run == p_run) & (c_n >= p_n))
    return FreeDraft(tokens=jnp.where(ctx[:, None], c_tok, p_tok),
                     count=jnp.where(ctx, c_n, p_n), run=jnp.where(ctx, c_run, p_run),
                     from_context=ctx)
