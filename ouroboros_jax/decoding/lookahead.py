"""Lookahead decoding (Fu et al. 2023; docs/algorithm.md sections 0 and 1): the target itself runs
the Jacobi window and verifies up to G pool n-grams keyed by its pending token, one target
forward per step, the whole loop on device.

Letters (package glossary): B rows, W window, N n-gram size, G guesses, R pool rows.

Greedy output equals vanilla's token for token; sampled output equals vanilla sampling's for
the same seed (keys fold (row, position); the walk only ever emits the target's own choice).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..bounds import INT32_MAX, MAX_TREE_TOKENS, check_tree_tokens
from ..models.kv_cache import KVCache
from ..pool import PhrasePool, pool_bytes, prepare_pool
from ..sampling import SamplingParams, choose_tokens
from ..tree import jacobi_tree
from .common import (Limits, Sequences, Stats, check_int, count_round, counter, decode_loop, emit,
                     init_sequences, init_stats, loop_config, pool_summary, prefill)
from .jacobi import JacobiWindow, commit_with_prefix, init_window, jacobi_step
from .auto import lookahead_rate
from .spec import MethodSpec


@dataclasses.dataclass(frozen=True)
class LookaheadConfig:
    """window W, ngram N, guesses G (pool phrases per key, verified per step), pool_rows R
    (None: min(V, 65536)), history (False: every call starts from an empty pool).

    Defaults W=15, N=5, G=15 are LADE's recommended 7B setting (Fu et al. 2023), also the
    Ouroboros paper's prose recipe (W 15, N 5). On 2 CPU cores smaller trees may be faster.
    """

    window: int = 15
    ngram: int = 5
    guesses: int = 15
    pool_rows: Optional[int] = None
    history: bool = True

    def __post_init__(self):
        check_int(self, "window", 1, MAX_TREE_TOKENS)
        check_int(self, "ngram", 3, MAX_TREE_TOKENS)
        check_int(self, "guesses", 1, MAX_TREE_TOKENS)
        check_tree_tokens(self, _forward_sizes(self)[0], "(window + guesses) * (ngram - 1)")
        if self.pool_rows is not None:  # bounded by the vocabulary per call (bounds.check_call)
            check_int(self, "pool_rows", 1, INT32_MAX)
        if not isinstance(self.history, bool):
            raise ValueError(f"LookaheadConfig.history must be a bool, got {self.history!r}")


@struct.dataclass
class LookaheadState:
    """The carry of lookahead decoding's while_loop.

    Attributes:
        seq: the token buffer; its last token per row is pending.
        cache: the target's KV cache (lengths - 1 tokens).
        window: the target's Jacobi window (W columns, N-1 levels) rolled forward every step.
        pool: the n-gram pool (keyed by a token, phrases of N-1 tokens), fed by the window's
            harvested n-grams and looked up with the pending token.
        stats: the on-device counters (`common.Stats`), with guess_tokens_accepted and
            pool_hits.
    """

    seq: Sequences
    cache: KVCache
    window: JacobiWindow
    pool: PhrasePool
    stats: Stats


def lookahead_step(params, config, cfg: LookaheadConfig, greedy: bool, sp: SamplingParams,
                   limits: Limits, state: LookaheadState) -> LookaheadState:
    """One lookahead step (docs/algorithm.md section 1), one target forward.

    The target forwards its Jacobi window and up to G pool phrases keyed by the pending token
    (`jacobi_tree` layout, T = (W + G) * (N - 1) nodes); the accept walk follows the best
    phrase (1 to N tokens emitted per row); the window advances one Jacobi step and its
    n-grams go into the pool.

    Args:
        params, config: the target's params and (static) config.
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
    res = jacobi_step(params, config, layout, state.cache, state.window, state.pool, seq.last,
                      live, choose)
    seq, kept = emit(seq, res.acc.tokens, res.acc.count, limits)
    cache = commit_with_prefix(state.cache, res.new, 0, jnp.zeros_like(kept), res.acc.path, kept)
    stats = count_round(state.stats, live, kept)
    stats = stats.replace(
        guess_tokens_accepted=stats.guess_tokens_accepted
        + jnp.sum(jnp.maximum(jnp.minimum(res.acc.count, kept) - 1, 0)),
        pool_hits=stats.pool_hits + jnp.sum(live & res.guess_found))
    return LookaheadState(seq, cache, res.window, res.pool, stats)


@partial(jax.jit, static_argnames=("config", "cfg", "slots", "greedy"))
def run_lookahead(params, config, prompt, prompt_lengths, limits: Limits, sp: SamplingParams,
                  pool: PhrasePool, *, cfg: LookaheadConfig, slots: int, greedy: bool):
    """prompt int32[B,P] right-padded -> (Sequences, Stats, pool)."""
    B = prompt.shape[0]
    layout = jacobi_tree(cfg.window, cfg.ngram, cfg.guesses)
    seq = init_sequences(prompt, prompt_lengths, slots)
    cache = prefill(params, config, prompt, prompt_lengths, slots, params["embed"].dtype)
    stats = init_stats(B, cfg.ngram + 1).replace(guess_tokens_accepted=counter(),
                                                  pool_hits=counter())
    state = LookaheadState(seq, cache, init_window(layout, prompt, prompt_lengths), pool, stats)
    state = decode_loop(partial(lookahead_step, params, config, cfg, greedy, sp, limits), state)
    return state.seq, pool_summary(state.stats, state.pool), state.pool


def _run(target, draft, prompt, plens, limits, sp, cfg: LookaheadConfig, *, greedy, slots,
         pool):
    pool = prepare_pool(pool, target.config.vocab_size, cfg.guesses, cfg.ngram - 1,
                        cfg.pool_rows, cfg.history)
    seq, stats, pool = run_lookahead(target.params, target.config, prompt, plens, limits, sp,
                                     pool, cfg=loop_config(cfg),
                                     slots=slots, greedy=greedy)
    return seq, stats.replace(pool_bytes=pool_bytes(pool)), pool


def _margin(cfg: LookaheadConfig) -> int:
    # Commits never pass max_new_tokens (emit cuts first); one step touches at most N slots.
    return cfg.ngram


def _forward_sizes(cfg: LookaheadConfig) -> tuple[int, int, int]:
    return (cfg.window + cfg.guesses) * (cfg.ngram - 1), 0, 0


SPEC = MethodSpec(run=_run, needs_draft=False, config_type=LookaheadConfig,
                  default_config=LookaheadConfig, margin=_margin, forward_sizes=_forward_sizes,
                  quick_config=lambda: LookaheadConfig(window=4, ngram=4, guesses=4),
                  # G = W: as many pool guesses as window columns (the paper's setting)
                  auto_grid=lambda grid: [LookaheadConfig(window=w, ngram=n, guesses=w)
                                          for w in grid["window"] for n in grid["ngram"]],
                  auto_rate=lambda cfg, a, tt, td: lookahead_rate(cfg.window, cfg.ngram,
                                                                  cfg.guesses, tt))
