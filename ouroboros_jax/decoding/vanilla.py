"""Vanilla autoregressive decoding: one target forward per token, the whole loop on device."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from ..models import forward
from ..models.kv_cache import KVCache, commit_prefix
from ..sampling import SamplingParams, choose_tokens
from .common import (Limits, Sequences, Stats, count_round, decode_loop, emit, init_sequences,
                     init_stats, prefill)


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


def vanilla_step(params, config, greedy: bool, sp: SamplingParams, limits: Limits,
                 state: VanillaState) -> VanillaState:
    """One token per row: forward the pending token, choose the next, commit the pending KV."""
    seq, cache = state.seq, state.cache
    B = seq.tokens.shape[0]
    pos = (seq.lengths - 1)[:, None]
    logits, new = forward(params, config, seq.last[:, None], pos, jnp.ones((B, 1, 1), bool),
                          cache)
    tok = choose_tokens(logits, pos + 1, sp, greedy)
    live = ~seq.done
    seq, kept = emit(seq, tok, jnp.ones((B,), jnp.int32), limits)
    cache = commit_prefix(cache, new, kept)
    return VanillaState(seq, cache, count_round(state.stats, live, kept))


@partial(jax.jit, static_argnames=("config", "slots", "greedy"))
def run_vanilla(params, config, prompt, prompt_lengths, limits: Limits, sp: SamplingParams, *,
                slots: int, greedy: bool):
    """prompt int32[B,P] right-padded -> (Sequences with S = slots, Stats)."""
    seq = init_sequences(prompt, prompt_lengths, slots)
    cache = prefill(params, config, prompt, prompt_lengths, slots, params["embed"].dtype)
    state = VanillaState(seq, cache, init_stats(prompt.shape[0], 2))
    state = decode_loop(partial(vanilla_step, params, config, greedy, sp, limits), state)
    return state.seq, state.stats
