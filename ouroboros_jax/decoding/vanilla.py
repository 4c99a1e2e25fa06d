"""Vanilla autoregressive decoding: one target forward per token, the whole loop on device.

Seam functions (decoding/spec.py): `vanilla_init`, `vanilla_insert`, `vanilla_step` (one round),
`vanilla_finish`; `run_vanilla` is generate's loop over them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from ..models.kv_cache import KVCache, init_cache
from ..sampling import SamplingParams
from .common import (Limits, Pair, Sequences, Stats, count_round, empty_sequences,
                     insert_sequences, init_stats, make_runner, plain_step, prefill_rows)


@struct.dataclass
class VanillaState:
    """The carry of vanilla decoding's while_loop.

    Attributes:
        seq: the token buffer (prompt + emitted tokens, lengths, done flags); its last token
            per row is the pending one, not yet in the cache.
        cache: the target's KV cache, holding every token but the pending one (lengths - 1).
        stats: the on-device counters (`common.Stats`, the common ones only).
    """

    seq: Sequences
    cache: KVCache
    stats: Stats


def vanilla_init(pair: Pair, cfg, rows: int, slots: int, pool=None) -> VanillaState:
    """B = rows empty rows (done) of S = slots."""
    return VanillaState(empty_sequences(rows, slots),
                        init_cache(pair.tconfig, rows, slots, pair.tparams["embed"].dtype),
                        init_stats(rows, 2))


def vanilla_insert(pair: Pair, cfg, state: VanillaState, rows, prompt, prompt_lengths
                   ) -> VanillaState:
    """Rows int32[R] start prompt int32[R,P] (right-padded), prompt_lengths int32[R]."""
    return state.replace(
        seq=insert_sequences(state.seq, rows, prompt, prompt_lengths),
        cache=prefill_rows(pair.tparams, pair.tconfig, state.cache, rows, prompt,
                           prompt_lengths))


def vanilla_step(pair: Pair, cfg, greedy: bool, sp: SamplingParams, limits: Limits,
                 state: VanillaState) -> VanillaState:
    """One token per row: forward the pending token, choose the next, commit the pending KV."""
    seq, cache, live, kept = plain_step(pair.tparams, pair.tconfig, greedy, sp, limits,
                                        state.seq, state.cache)
    return VanillaState(seq, cache, count_round(state.stats, live, kept))


def vanilla_finish(state: VanillaState) -> Stats:
    return state.stats


run_vanilla = make_runner(vanilla_init, vanilla_insert, vanilla_step, vanilla_finish)
