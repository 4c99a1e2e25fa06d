"""Prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`
proposer, llama.cpp's lookup decoding): drafts copied from the context itself, no draft model.

Requests such as "rewrite this code with type hints", "add docstrings" or "summarise / answer
from this document" produce outputs that copy long spans of their prompt. Each round:

 1. Candidates (`find_candidates`, fixed shapes, on device): the last k tokens of the row
    (prompt + output so far, k from `max_ngram` down to `min_ngram`) are matched against every
    earlier position of the row; a match ending at j proposes the M = `length` tokens after j.
    Matches rank by length k, then by how many of their M tokens lie inside the row, then by
    recency; candidates whose first token repeats a better one's are dropped (the accept walk
    could follow only one of them), and the best X = `candidates` are kept.
 2. One target forward over `tree.chain_with_branches(1, X, M)`: the pending token, then the X
    candidates as branches (missing ones and tokens past the row's end masked invalid).
 3. The shared `accept_walk` (greedy: vanilla's tokens exactly; sampling: every candidate is
    fixed before the forward and keys fold (row, position), so the same seed gives vanilla
    sampling's very tokens), `emit`, `commit_path`.

Counters: `drafted_tokens` = valid candidate tokens offered (live rows), and
`guess_tokens_accepted` = candidate tokens accepted, as lookahead counts its pool guesses.

Letters (package glossary): B rows, S buffer slots, K = max_ngram, X candidates, M tokens per
candidate, Q = candidates ranked before deduplication, T = 1 + X*M tree nodes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from ..models import forward
from ..models.kv_cache import KVCache, settle
from ..sampling import SamplingParams, choose_tokens
from ..tree import chain_with_branches, tree_mask
from .common import (Limits, Pair, Sequences, Stats, check_int, count_round, counter,
                     counters_dict, emit, empty_cache, empty_sequences, init_stats,
                     insert_sequences, make_runner, plain_step, prefill_rows, proposing,
                     source_labels)
from .cost import ROUND_OVERHEAD, RoundModel
from .knobs import CANDIDATES, LENGTH, KnobSpace
from .spec import MethodSpec
from . import constrained
from .logprobs import walk_logprobs
from .verify import accept_walk, commit_path


@dataclasses.dataclass(frozen=True)
class PromptLookupConfig:
    """max_ngram K and min_ngram: suffix lengths matched (longest first, as transformers'
    `max_matching_ngram_size` down to 1); candidates X: branches verified per round; length M:
    tokens per candidate (transformers' `prompt_lookup_num_tokens`).

    Defaults: K = 3, X = 2, M = 8, a tree of 17 nodes, which on a 2-core CPU costs about 1.5
    single-token forwards of SmolLM2-135M; `config="auto"` sizes it per device.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    candidates: int = 2
    length: int = 8

    KNOBS: ClassVar[KnobSpace] = KnobSpace(knobs=(CANDIDATES, LENGTH))

    def __post_init__(self):
        check_int(self, "max_ngram", 1)
        check_int(self, "min_ngram", 1, self.max_ngram)
        check_int(self, "candidates", 1)
        check_int(self, "length", 1)


@struct.dataclass
class PromptLookupCounters:
    """Prompt lookup's own counters, int32[]: drafted_tokens (valid candidate tokens offered,
    live rows) and guess_tokens_accepted (candidate tokens accepted)."""

    drafted_tokens: jax.Array
    guess_tokens_accepted: jax.Array

    def to_dict(self) -> dict:
        return counters_dict(self)


@struct.dataclass
class PromptLookupState:
    """The carry of prompt lookup decoding's while_loop.

    Attributes:
        seq: the token buffer (prompt + output: where candidates are looked up); its last
            token per row is pending.
        cache: the target's KV cache (lengths - 1 tokens).
        stats: the on-device counters (`common.Stats`), own = `PromptLookupCounters`.
    """

    seq: Sequences
    cache: KVCache
    stats: Stats


def match_lengths(tokens: jax.Array, lengths: jax.Array, max_ngram: int) -> jax.Array:
    """tokens int32[B,S], lengths int32[B] -> int32[B,S]: run[b, j] = how many of the row's last
    tokens (up to K = max_ngram) the tokens ending at j repeat: tokens[j - i] == tokens[L-1-i]
    for i < run. Only ends j < L - 1 (earlier than the last token) count; others are 0."""
    B, S = tokens.shape
    j = jnp.arange(S, dtype=jnp.int32)[None]  # [1,S]
    L = lengths.astype(jnp.int32)[:, None]  # [B,1]
    eqs = []
    for i in range(max_ngram):
        here = jnp.take_along_axis(tokens, jnp.clip(j - i, 0, S - 1) * jnp.ones_like(L), 1)
        tail = jnp.take_along_axis(tokens, jnp.clip(L - 1 - i, 0, S - 1), 1)  # [B,1]
        eqs.append((here == tail) & (j - i >= 0) & (L - 1 - i >= 0))
    run = jnp.sum(jnp.cumprod(jnp.stack(eqs, -1).astype(jnp.int32), axis=-1), axis=-1)
    return jnp.where(j < L - 1, run, 0).astype(jnp.int32)


def find_candidates(tokens: jax.Array, lengths: jax.Array, cfg: PromptLookupConfig
                    ) -> tuple[jax.Array, jax.Array]:
    """The round's candidates: tokens int32[B,S] (a row's first lengths[b] are real) ->
    (cand int32[B,X,M], valid bool[B,X,M]).

    Candidate x is the M tokens after the x-th best match of the row's last tokens (see the
    module docstring for the ranking); valid marks real tokens (inside the row, a match found).
    """
    cand, valid, _ = ranked_candidates(tokens, lengths, cfg)
    return cand, valid


def ranked_candidates(tokens: jax.Array, lengths: jax.Array, cfg: PromptLookupConfig
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`find_candidates` with each candidate's match length: -> (cand int32[B,X,M], valid
    bool[B,X,M], run int32[B,X]: how many of the row's last tokens (<= K) the tokens before
    candidate x repeat; 0 where none was found). Ouroboros' free drafts score by it."""
    B, S = tokens.shape
    X, M = cfg.candidates, cfg.length
    L = lengths.astype(jnp.int32)
    run = match_lengths(tokens, L, cfg.max_ngram)  # [B,S]
    j = jnp.arange(S, dtype=jnp.int32)[None]
    inside = jnp.clip(L[:, None] - 1 - j, 0, M)  # candidate tokens before the row's end
    ok = run >= cfg.min_ngram
    # longest match first, then most tokens inside the row, then the most recent
    priority = jnp.where(ok, (run * (M + 1) + inside) * S + j, -1)
    Q = min(S, 4 * X)
    pri, end = jax.lax.top_k(priority, Q)  # [B,Q]
    found = pri >= 0
    pos = end[:, :, None] + 1 + jnp.arange(M, dtype=jnp.int32)[None, None]  # [B,Q,M]
    cont = jnp.take_along_axis(tokens, jnp.clip(pos, 0, S - 1).reshape(B, -1), 1).reshape(B, Q, M)
    real = (pos < L[:, None, None]) & found[:, :, None]
    # drop a candidate whose first token a better one already offers (the walk takes the
    # lowest-index child carrying a token, so the second could never be followed)
    first = cont[:, :, 0]
    earlier = jnp.tril(jnp.ones((Q, Q), bool), -1)  # [q, q']: q' ranks before q
    dup = jnp.any((first[:, :, None] == first[:, None, :]) & found[:, None, :] & earlier[None],
                  axis=-1)
    keep = found & ~dup
    rank = jnp.cumsum(keep, axis=1) - 1  # [B,Q]
    pick = keep[:, :, None] & (rank[:, :, None] == jnp.arange(X)[None, None])  # [B,Q,X]
    has = jnp.any(pick, axis=1)  # [B,X]
    sel = jnp.argmax(pick, axis=1)  # [B,X]
    cand = jnp.take_along_axis(cont, sel[:, :, None], 1)
    valid = jnp.take_along_axis(real, sel[:, :, None], 1) & has[:, :, None]
    cand_run = jnp.take_along_axis(jnp.take_along_axis(run, end, 1), sel, 1)  # [B,X]
    return jnp.where(valid, cand, 0), valid, jnp.where(has, cand_run, 0)


def prompt_lookup_init(pair: Pair, cfg: PromptLookupConfig, rows: int, slots: int,
                       pool=None) -> PromptLookupState:
    """B = rows empty rows (done) of S = slots."""
    own = PromptLookupCounters(drafted_tokens=counter(), guess_tokens_accepted=counter())
    return PromptLookupState(empty_sequences(rows, slots), empty_cache(pair, "target", rows, slots),
                             init_stats(rows, cfg.length + 2, own))


def prompt_lookup_insert(pair: Pair, cfg: PromptLookupConfig, state: PromptLookupState, rows,
                         prompt, prompt_lengths) -> PromptLookupState:
    """Rows int32[R] start prompt int32[R,P] (right-padded), prompt_lengths int32[R]."""
    return state.replace(
        seq=insert_sequences(state.seq, rows, prompt, prompt_lengths),
        cache=prefill_rows(pair.tparams, pair.tconfig, state.cache, rows, prompt,
                           prompt_lengths))


def prompt_lookup_round(pair: Pair, cfg: PromptLookupConfig, greedy: bool,
                        sp: SamplingParams, limits: Limits, state: PromptLookupState
                        ) -> PromptLookupState:
    """One round, one target forward over the pending token and X candidates of M tokens.

    Args:
        pair: the target's params and (static) config (no draft).
        cfg: the (static) PromptLookupConfig.
        greedy: static; True takes the target's argmax, False draws with `sp`.
        sp: SamplingParams; keys fold (seed, stream, position).
        limits: Limits applied by `emit`.
        state: the loop carry before the round.

    Returns:
        The state after it: 1 to M + 1 new tokens per live row, the accepted path committed.
    """
    seq = state.seq
    B = seq.tokens.shape[0]
    X, M = cfg.candidates, cfg.length
    lay = chain_with_branches(1, X, M)
    cand, cvalid = find_candidates(seq.tokens, seq.lengths, cfg)
    cvalid = proposing(limits, cvalid)  # rows with speculation off offer none
    tokens = jnp.concatenate([seq.last[:, None], cand.reshape(B, X * M)], axis=1)
    valid = jnp.concatenate([jnp.ones((B, 1), bool), cvalid.reshape(B, X * M)], axis=1)
    states = constrained.tree_states(limits, seq, lay.parents, tokens)
    valid = constrained.cut(states, valid)  # copies leaving the language are not verified
    cache = settle(state.cache)
    pos = cache.lengths[:, None] + jnp.asarray(lay.depths)[None]
    logits, new = forward(pair.tparams, pair.tconfig, tokens, pos, tree_mask(lay.parents, valid),
                          cache)
    logits = constrained.masked(limits, states, logits)
    choices = choose_tokens(logits, pos + 1, sp, greedy)
    acc = accept_walk(lay.parents, tokens, valid, choices)
    live = ~seq.done
    seq, kept = emit(seq, acc.tokens, acc.count, limits,
                     walk_logprobs(logits, acc.path, acc.tokens, sp, greedy))
    cache = commit_path(cache, new, acc, kept)
    # the best candidate's tokens are what a row offers to be accepted in a row
    stats = count_round(state.stats, live, kept, jnp.sum(cvalid[:, 0], axis=1, dtype=jnp.int32),
                        (acc.path, source_labels(len(lay.parents),
                                                 prompt_lookup=range(1, len(lay.parents)))))
    own = stats.own
    stats = stats.replace(own=PromptLookupCounters(
        drafted_tokens=own.drafted_tokens + jnp.sum(live[:, None, None] & cvalid,
                                                    dtype=jnp.int32),
        guess_tokens_accepted=own.guess_tokens_accepted
        + jnp.sum(jnp.maximum(jnp.minimum(acc.count, kept) - 1, 0))))
    return PromptLookupState(seq, cache, stats)


def prompt_lookup_plain(pair: Pair, cfg: PromptLookupConfig, greedy: bool, sp: SamplingParams,
                        limits: Limits, state: PromptLookupState) -> PromptLookupState:
    """A round of plain decoding (one target token per row): nothing to keep in step."""
    seq, cache, live, kept = plain_step(pair.tparams, pair.tconfig, greedy, sp, limits,
                                        state.seq, state.cache)
    return PromptLookupState(seq, cache, count_round(state.stats, live, kept))


def prompt_lookup_finish(state: PromptLookupState) -> Stats:
    return state.stats


run_prompt_lookup = make_runner(prompt_lookup_init, prompt_lookup_insert, prompt_lookup_round,
                                prompt_lookup_finish)


# ------------------------------------------------------------------------------ config="auto"
# How often a copied candidate pays, fitted to the tokens per round greedy prompt lookup takes
# on SmolLM2-135M-Instruct's copy-heavy requests (3 code rewrites, 3 Spec-Bench summarization,
# 3 RAG; 128 tokens; `python -m experiments.lookup_replay ... --per-task 3`): X = 1
# gave eta 1.61 / 1.83 / 2.09 / 2.29 at M = 2 / 4 / 8 / 16, and each further candidate adds
# about 8% of the first one's gain (X = 2, 3 at M = 8: 2.19, 2.28), far less than independent
# candidates would: they are the same context's other matches, right or wrong together.
HIT = 0.3
CONTINUES = 0.75
OTHER_CANDIDATE = 0.08


def expected_tokens(candidates: int, length: int, hit: float = HIT,
                    continues: float = CONTINUES) -> float:
    """Tokens per round: the target's own token, plus the accepted prefix of the best of
    `candidates` candidates (the first token right with hit * (1 + OTHER_CANDIDATE * (X - 1)),
    then each of the M - 1 later ones continues with `continues`)."""
    p = min(1.0, hit * (1 + OTHER_CANDIDATE * (candidates - 1)))
    return 1 + p * sum(continues ** j for j in range(length))


def hit_from_eta(eta: float, candidates: int, length: int) -> float:
    """The copy hit rate at which `expected_tokens(candidates, length, hit)` equals eta (the
    later tokens' CONTINUES kept), in [0, 1]: what a call's tokens per round say of how often
    its workload repeats its context."""
    per_hit = (1 + OTHER_CANDIDATE * (candidates - 1)) * sum(CONTINUES ** j
                                                              for j in range(length))
    return min(1.0, max(0.0, (eta - 1) / per_hit))


def _learn(cfg: PromptLookupConfig, stats: dict, greedy: bool):
    # What `config="auto"` learns from a greedy call: the copy hit rate its rounds realised
    # (no depth counts: the candidates are not one chain). HIT is fitted to copy-heavy
    # requests; on chat or free writing the context repeats far less (SmolLM2's chat prompts:
    # eta 1.22 at X 1, M 4, a hit rate of 0.08), and only what the calls realise tells.
    rounds = int(stats.get("target_calls", 0))
    if not greedy or rounds <= 0 or not stats.get("new_tokens"):
        return None
    return hit_from_eta(float(stats["eta"]), cfg.candidates, cfg.length), rounds, None


def _round_model(cfg: PromptLookupConfig, a) -> RoundModel:
    # no draft model: a is the copy hit rate earlier calls realised (`_learn`), else the prior
    return RoundModel(tokens=expected_tokens(cfg.candidates, cfg.length,
                                             HIT if a is None else a),
                      overhead=ROUND_OVERHEAD)


SPEC = MethodSpec(runner=run_prompt_lookup, needs_draft=False, config_type=PromptLookupConfig,
                  default_config=PromptLookupConfig, margin=lambda cfg: cfg.length + 1,
                  init=prompt_lookup_init, insert=prompt_lookup_insert,
                  round=prompt_lookup_round, plain_round=prompt_lookup_plain,
                  sources=("prompt_lookup",),
                  finish=prompt_lookup_finish, max_emit=lambda cfg: cfg.length + 1,
                  family=lambda cfg: (),
                  forward_sizes=lambda cfg: (1 + cfg.candidates * cfg.length, 0, 0),
                  quick_config=lambda: PromptLookupConfig(candidates=2, length=4),
                  learn=_learn,
                  round_model=_round_model)
