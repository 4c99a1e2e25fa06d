"""Lookahead decoding (Fu et al. 2023; docs/algorithm.md sections 0 and 1): the target itself runs
the Jacobi window and verifies up to G pool n-grams keyed by its pending token, one target
forward per step, the whole loop on device.

Letters (package glossary): B rows, W window, N n-gram size, G guesses, R pool rows.

Greedy output equals vanilla's token for token; sampled output equals vanilla sampling's for
the same seed (keys fold (row, position); the walk only ever emits the target's own choice).

Seam functions (decoding/spec.py): `lookahead_init`, `lookahead_insert`, `lookahead_step` (one
round), `lookahead_plain` (a round without the window and guesses), `lookahead_finish`;
`run_lookahead` is generate's loop over them. `key_offset` (per row, None in generate) moves a
row's pool keys into its own range: the engine's per-request pools.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..bounds import INT32_MAX, MAX_TREE_TOKENS, check_tree_tokens
from ..models.kv_cache import KVCache, settle
from ..pool import PhrasePool, prepare_pool
from ..sampling import SamplingParams, choose_tokens
from ..tree import jacobi_tree
from . import constrained
from .common import (Limits, Pair, Sequences, Stats, check_bool, check_int, count_round, counter,
                     counters_dict,
                     emit, empty_cache, empty_sequences, init_stats, insert_sequences, loop_config,
                     make_runner, plain_step, pool_summary, pool_with_context,
                     prefill_rows, set_rows, source_labels)
from .jacobi import JacobiWindow, commit_with_prefix, empty_window, init_window, jacobi_step
from .cost import RoundModel, phrase_gain
from .knobs import CONTEXT_PHRASES, GUESSES, NGRAM, WINDOW, KnobSpace
from .logprobs import token_logprobs, wanted
from .spec import MethodSpec


@dataclasses.dataclass(frozen=True)
class LookaheadConfig:
    """window W, ngram N, guesses G (pool phrases per key, verified per step), pool_rows R
    (None: min(V, 65536)), history (False: every call starts from an empty pool),
    context_phrases (each prompt's n-grams enter the pool when its row starts, so guesses can
    copy from the prompt; False for ablations).

    Defaults W=15, N=5, G=15 are LADE's recommended 7B setting (Fu et al. 2023), also the
    Ouroboros paper's prose recipe (W 15, N 5). On 2 CPU cores smaller trees may be faster.
    """

    window: int = 15
    ngram: int = 5
    guesses: int = 15
    pool_rows: Optional[int] = None
    history: bool = True
    context_phrases: bool = True

    KNOBS: ClassVar[KnobSpace] = KnobSpace(knobs=(WINDOW, NGRAM, GUESSES),
                                           switches=(CONTEXT_PHRASES,), baseline="lookahead")

    def __post_init__(self):
        check_int(self, "window", 1, MAX_TREE_TOKENS)
        check_int(self, "ngram", 3, MAX_TREE_TOKENS)
        check_int(self, "guesses", 1, MAX_TREE_TOKENS)
        check_tree_tokens(self, _forward_sizes(self)[0], "(window + guesses) * (ngram - 1)")
        if self.pool_rows is not None:  # bounded by the vocabulary per call (bounds.check_call)
            check_int(self, "pool_rows", 1, INT32_MAX)
        check_bool(self, "history", "context_phrases")


@struct.dataclass
class LookaheadCounters:
    """Lookahead's own counters, int32[]: guess_tokens_accepted (tokens accepted from pool
    guesses), pool_hits (row rounds whose key had a pool phrase)."""

    guess_tokens_accepted: jax.Array
    pool_hits: jax.Array

    def to_dict(self) -> dict:
        return counters_dict(self)


@struct.dataclass
class LookaheadState:
    """The carry of lookahead decoding's while_loop.

    Attributes:
        seq: the token buffer; its last token per row is pending.
        cache: the target's KV cache (lengths - 1 tokens).
        window: the target's Jacobi window (W columns, N-1 levels) rolled forward every step.
        pool: the n-gram pool (keyed by a token, phrases of N-1 tokens), fed by the window's
            harvested n-grams and looked up with the pending token.
        stats: the on-device counters (`common.Stats`), own = `LookaheadCounters`.
        key_offset: int32[B] added to every pool key of the row (per-request pools), or None.
    """

    seq: Sequences
    cache: KVCache
    window: JacobiWindow
    pool: PhrasePool
    stats: Stats
    key_offset: Optional[jax.Array] = None


def lookahead_init(pair: Pair, cfg: LookaheadConfig, rows: int, slots: int, pool: PhrasePool
                   ) -> LookaheadState:
    """B = rows empty rows (done) of S = slots, around `pool`."""
    layout = jacobi_tree(cfg.window, cfg.ngram, cfg.guesses)
    own = LookaheadCounters(guess_tokens_accepted=counter(), pool_hits=counter())
    return LookaheadState(empty_sequences(rows, slots),
                          empty_cache(pair, "target", rows, slots),
                          empty_window(layout, rows), pool, init_stats(rows, cfg.ngram + 1, own))


def lookahead_insert(pair: Pair, cfg: LookaheadConfig, state: LookaheadState, rows, prompt,
                     prompt_lengths) -> LookaheadState:
    """Rows int32[R] start prompt int32[R,P]: cache prefilled, window started from it, its
    n-grams in the pool (context_phrases)."""
    layout = jacobi_tree(cfg.window, cfg.ngram, cfg.guesses)
    return state.replace(
        seq=insert_sequences(state.seq, rows, prompt, prompt_lengths),
        cache=prefill_rows(pair.tparams, pair.tconfig, state.cache, rows, prompt,
                           prompt_lengths),
        window=set_rows(state.window, rows, init_window(layout, prompt, prompt_lengths)),
        pool=pool_with_context(state, rows, prompt, prompt_lengths, cfg.context_phrases))


def lookahead_step(pair: Pair, cfg: LookaheadConfig, greedy: bool, sp: SamplingParams,
                   limits: Limits, state: LookaheadState) -> LookaheadState:
    """One lookahead step (docs/algorithm.md section 1), one target forward.

    The target forwards its Jacobi window and up to G pool phrases keyed by the pending token
    (`jacobi_tree` layout, T = (W + G) * (N - 1) nodes); the accept walk follows the best
    phrase (1 to N tokens emitted per row); the window advances one Jacobi step and its
    n-grams go into the pool.

    Args:
        pair: the target's params and (static) config (no draft).
        cfg: the (static) LookaheadConfig: window W, ngram N, guesses G.
        greedy: static; True takes the target's argmax, False draws with `sp`.
        sp: SamplingParams (temperature, top-k, top-p, seed); keys fold (row, position).
        limits: Limits (max_new_tokens, EOS ids) applied by `emit`.
        state: the loop carry before the step.

    Returns:
        The LookaheadState after the step: seq with the emitted tokens, cache with the accepted
        path committed, window moved on, pool with the harvested n-grams, stats counting it.
    """
    layout = jacobi_tree(cfg.window, cfg.ngram, cfg.guesses)
    seq = state.seq
    live = ~seq.done
    choose = lambda logits, pos: choose_tokens(logits, pos, sp, greedy)
    cache = settle(state.cache)
    res = jacobi_step(pair.tparams, pair.tconfig, layout, cache, state.window,
                      state.pool, seq.last, live, choose, key_offset=state.key_offset,
                      with_logits=wanted(sp), propose=limits.speculate,
                      constrain=constrained.tree_mask_fn(limits, seq))
    lp = None if res.walk_logits is None else token_logprobs(res.walk_logits, res.acc.tokens,
                                                             sp, greedy)
    seq, kept = emit(seq, res.acc.tokens, res.acc.count, limits, lp)
    cache = commit_with_prefix(cache, res.new, 0, jnp.zeros_like(kept), res.acc.path, kept)
    # the best guess offered N-1 tokens when the key had a phrase
    stats = count_round(state.stats, live, kept, jnp.where(res.guess_found, cfg.ngram - 1, 0),
                        (res.acc.path, source_labels(layout.size,
                                                     pool_phrases=layout.guess_index.ravel())))
    own = stats.own
    stats = stats.replace(own=LookaheadCounters(
        guess_tokens_accepted=own.guess_tokens_accepted
        + jnp.sum(jnp.maximum(jnp.minimum(res.acc.count, kept) - 1, 0)),
        pool_hits=own.pool_hits + jnp.sum(live & res.guess_found)))
    return state.replace(seq=seq, cache=cache, window=res.window, pool=res.pool, stats=stats)


def lookahead_plain(pair: Pair, cfg: LookaheadConfig, greedy: bool, sp: SamplingParams,
                    limits: Limits, state: LookaheadState) -> LookaheadState:
    """A round of plain decoding (one target token per row). The window is left as it was:
    its tokens are only candidates, verified when lookahead resumes."""
    seq, cache, live, kept = plain_step(pair.tparams, pair.tconfig, greedy, sp, limits,
                                        state.seq, state.cache)
    return state.replace(seq=seq, cache=cache, stats=count_round(state.stats, live, kept))


def lookahead_finish(state: LookaheadState) -> Stats:
    return state.stats.replace(summary=pool_summary(state.stats, state.pool))


run_lookahead = make_runner(lookahead_init, lookahead_insert, lookahead_step, lookahead_finish)


def _prepare(cfg: LookaheadConfig, pool, vocab: int):
    """(the config the compiled loop sees, the pool a call starts from)."""
    return loop_config(cfg), prepare_pool(pool, vocab, cfg.guesses, cfg.ngram - 1,
                                          cfg.pool_rows, cfg.history)


def _margin(cfg: LookaheadConfig) -> int:
    # Commits never pass max_new_tokens (emit cuts first); one step touches at most N slots.
    return cfg.ngram


def _forward_sizes(cfg: LookaheadConfig) -> tuple[int, int, int]:
    return (cfg.window + cfg.guesses) * (cfg.ngram - 1), 0, 0


def _round_model(cfg: LookaheadConfig, a) -> RoundModel:
    # measured: a lookahead round costs no more than the probe's forward of its size (its pool
    # work overlaps the forward's), so no overhead term; no draft, so no agreement
    return RoundModel(tokens=1 + phrase_gain(cfg.guesses, cfg.ngram))


SPEC = MethodSpec(runner=run_lookahead, needs_draft=False, config_type=LookaheadConfig,
                  default_config=LookaheadConfig, margin=_margin, forward_sizes=_forward_sizes,
                  init=lookahead_init, insert=lookahead_insert, round=lookahead_step,
                  plain_round=lookahead_plain, finish=lookahead_finish, prepare=_prepare,
                  sources=("pool_phrases",),
                  keeps_pool=True,
                  max_emit=lambda cfg: cfg.ngram,
                  family=lambda cfg: (cfg.window, cfg.ngram, cfg.guesses, cfg.pool_rows),
                  quick_config=lambda: LookaheadConfig(window=4, ngram=4, guesses=4),
                  round_model=_round_model)
