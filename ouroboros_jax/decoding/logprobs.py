"""Log-probabilities of the emitted tokens, taken from the target forward that accepted them.

Every method's round runs one target forward over a tree (vanilla: one node) and walks it
(`verify.accept_walk`, or the speculative chain rule): emitted token i is the target's choice
after walk node path[i]. Its log-probability is read from that node's logits, so reporting
them runs no extra forward. Which distribution:

- a sampled row: the processed distribution it was drawn from (temperature, top-k, top-p,
  `sampling.process_logits`); tokens outside the top-k / top-p set have -inf;
- a greedy row (greedy loop, or `greedy_rows` of a sampling loop): the plain softmax of the
  raw logits (temperature 1), as OpenAI-compatible servers report for greedy requests.

A speculative round's residual draw (Leviathan's max(p - q, 0)) is reported under p, the
target's processed distribution: the law every emitted token follows.

Whether to compute them is static (`SamplingParams.logprobs`: -1 off, k >= 0 on with the k most
likely tokens at each position); off, the compiled loop is the one without logprobs. The values
ride in `Sequences` (`logprobs` f32[B,S], `top_tokens` int32[B,S,K], `top_logprobs` f32[B,S,K],
at the slot of the token they belong to), written by `common.emit`.

Letters (package glossary): B rows, T tree nodes, A tokens one walk can emit, V vocabulary,
S buffer slots, K top tokens per position, E tokens one read returns per row.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..sampling import SamplingParams, greedy_where, process_logits


@struct.dataclass
class TokenLogprobs:
    """The log-probabilities of tokens offered to `emit`.

    Attributes:
        logprobs: f32[B,A], of each token.
        top_tokens: int32[B,A,K], the K most likely tokens at each position (K may be 0).
        top_logprobs: f32[B,A,K], theirs.
    """

    logprobs: jax.Array
    top_tokens: jax.Array
    top_logprobs: jax.Array


def wanted(sp: Optional[SamplingParams]) -> bool:
    """Whether the loop computes logprobs (static)."""
    return sp is not None and sp.logprobs >= 0


def token_logprobs(logits: jax.Array, tokens: jax.Array, sp: SamplingParams,
                   greedy: bool) -> TokenLogprobs:
    """logits [B,A,V] (the distribution each token was chosen from), tokens int32[B,A] ->
    TokenLogprobs with K = sp.logprobs top tokens (module docstring: which distribution)."""
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = raw if greedy else greedy_where(sp, raw, process_logits(logits, sp))
    lp = jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    k = max(int(sp.logprobs), 0)
    if k:
        top_lp, top_tok = jax.lax.top_k(logp, k)
    else:
        top_lp = jnp.zeros(lp.shape + (0,), jnp.float32)
        top_tok = jnp.zeros(lp.shape + (0,), jnp.int32)
    return TokenLogprobs(lp, top_tok.astype(jnp.int32), top_lp)


def walk_logprobs(logits: jax.Array, path: jax.Array, tokens: jax.Array,
                  sp: Optional[SamplingParams], greedy: bool) -> Optional[TokenLogprobs]:
    """A walk's emitted tokens' logprobs: logits [B,T,V] of the target forward, path int32[B,A]
    (the walk's nodes, indices into logits' T), tokens int32[B,A] (the walk's tokens) ->
    TokenLogprobs, or None when the loop computes none (`wanted`)."""
    if not wanted(sp):
        return None
    node_logits = jnp.take_along_axis(logits, path[..., None], 1)  # [B,A,V]
    return token_logprobs(node_logits, tokens, sp, greedy)


def with_buffers(seq, k: int):
    """Sequences seq with zeroed logprob buffers of K = k top tokens (none when k < 0)."""
    if k < 0:
        return seq
    B, S = seq.tokens.shape
    return seq.replace(logprobs=jnp.zeros((B, S), jnp.float32),
                       top_tokens=jnp.zeros((B, S, k), jnp.int32),
                       top_logprobs=jnp.zeros((B, S, k), jnp.float32))


def buffers_like(seq, fresh):
    """fresh Sequences given the logprob buffers seq has (zeroed), so rows of one can be set
    from the other."""
    if seq.logprobs is None:
        return fresh
    return with_buffers(fresh, seq.top_tokens.shape[2])


def write(seq, rows: jax.Array, slot: jax.Array, lp: Optional[TokenLogprobs]):
    """seq with lp's values at [rows, slot] (rows, slot int32[B,A]; slot S drops), as `emit`
    writes its tokens. Unchanged when seq has no buffers; a loop that computes logprobs into
    a state without buffers is a bug, said at trace time."""
    if lp is None:
        return seq
    if seq.logprobs is None:
        raise ValueError("logprobs computed for Sequences without logprob buffers "
                         "(logprobs.with_buffers)")
    return seq.replace(
        logprobs=seq.logprobs.at[rows, slot].set(lp.logprobs, mode="drop"),
        top_tokens=seq.top_tokens.at[rows, slot].set(lp.top_tokens, mode="drop"),
        top_logprobs=seq.top_logprobs.at[rows, slot].set(lp.top_logprobs, mode="drop"))


def read(seq, since: jax.Array, width: int) -> TokenLogprobs:
    """The logprobs of the tokens each row received after position since int32[B] (what
    `common.read_emitted` reads of the tokens): TokenLogprobs of A = width; garbage past the
    counts it gives."""
    S = seq.tokens.shape[1]
    idx = jnp.clip(since[:, None] + jnp.arange(width, dtype=jnp.int32)[None], 0, S - 1)
    return TokenLogprobs(jnp.take_along_axis(seq.logprobs, idx, 1),
                         jnp.take_along_axis(seq.top_tokens, idx[..., None], 1),
                         jnp.take_along_axis(seq.top_logprobs, idx[..., None], 1))
