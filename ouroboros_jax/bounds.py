"""Bounds on a call's sizes, checked on the host before anything is allocated.

A size no model or device can hold must fail as a ValueError naming the parameter, never as an
XLA abort, a raw RESOURCE_EXHAUSTED or an OOM kill minutes later. Two layers:

- a method config's own fields (`check_tree_tokens`, from the configs' `__post_init__`): a
  round scores at most MAX_TREE_TOKENS tokens in one forward. Past a few hundred nothing pays
  (a chain of gamma draft tokens yields at most 1 / (1 - a) tokens per round at agreement a:
  100 at a = 0.99), and a forward of thousands of tokens is a prefill, not a decode step;
- one call against its models and device (`request.check_call`, from `generate`, with
  `estimate_bytes` and `available_bytes` from here): no tree larger than
  the cache, no more pool rows than vocabulary entries (key k lives in row k % R, so rows past
  V are never used), no cache past the target's `max_position_embeddings` (positions the model
  was never trained on) unless explicitly allowed, and an estimate of the memory the call will
  allocate refused by name when the device cannot hold it.

Letters (package glossary): B rows, P prompt width, S cache slots, T tokens per forward, L
layers, H query heads, K kv heads, D head dim, V vocabulary, R pool rows, G slots per row, M
phrase length.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from .models.attention import BLOCK
from .models.layout import packed_bytes

MAX_TREE_TOKENS = 4096  # tokens one round may score in one forward (see the module docstring)
INT32_MAX = 2**31 - 1
# Set to 1 to let max_cache_len pass the target's max_position_embeddings (a model with a
# position scheme that extrapolates, on purpose): the explicit override the bound allows.
PAST_POSITIONS_ENV = "OUROBOROS_JAX_PAST_POSITIONS"
# Share of the free device memory a call's estimate may take: the estimate counts the large
# buffers, not XLA's temporaries and fragmentation.
MEMORY_SHARE = 0.9


def check_tree_tokens(cfg, tokens: int, what: str) -> None:
    """Config validation: a round of `cfg` scores `tokens` tokens in one forward (`what` names
    the fields that make it); more than MAX_TREE_TOKENS is refused naming them."""
    if tokens > MAX_TREE_TOKENS:
        raise ValueError(f"{type(cfg).__name__}: {what} = {tokens} tokens in one forward, more "
                         f"than the {MAX_TREE_TOKENS} a round may score (a larger tree is a "
                         "prefill, and past a few hundred tokens no round pays for itself)")


def forward_sizes(spec, cfg) -> tuple[int, int, int]:
    """(target, draft, first draft) tokens per forward of the method (vanilla: 1, 0, 0)."""
    if cfg is None or spec.forward_sizes is None:
        return 1, 0, 0
    return tuple(int(x) for x in spec.forward_sizes(cfg))


def kv_bytes_per_token(config, itemsize: int) -> int:
    """Bytes one cached token takes in one model's cache: k and v over L layers, K kv heads,
    D head dim. The one formula of the cache's size (`estimate_bytes`, serve's sizing,
    `sharding.memory_plan` counts the same from shapes)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def _kv_bytes(config, batch: int, slots: int, itemsize: int) -> int:
    """k and v [L, B, S, K, D] of one model's cache."""
    return batch * slots * kv_bytes_per_token(config, itemsize)


def _forward_bytes(config, batch: int, tokens: int, slots: int, logits: bool = True) -> int:
    """The large transient buffers of one forward of T tokens over S slots: fp32 logits
    [B, T, V] (none in a prefill, which skips the LM head), one cache block's fp32 scores
    [B, H, T, Z + T] (the blockwise kernel's, Z = min(S, BLOCK)) and the mask [B, T, T]. A
    floor, not a ceiling: enough to refuse what cannot fit, never a call that can."""
    if tokens <= 0:
        return 0
    return ((4 * batch * tokens * config.vocab_size if logits else 0)
            + 4 * batch * config.num_heads * tokens * (min(slots, BLOCK) + tokens)
            + batch * tokens * tokens)


def estimate_bytes(spec, cfg, target, draft, batch: int, prompt_width: int, slots: int,
                   pool_rows: Optional[int] = None) -> int:
    """Device bytes a call allocates beyond the models' params: the packed copy of their
    weights where decoding packs them (models/layout.py), both caches, the token buffer, the
    pool, and the larger of the prefill's and a round's transient buffers. Pure arithmetic
    on Python ints (no overflow, nothing allocated)."""
    n_t, n_s, n_first = forward_sizes(spec, cfg)
    item = lambda m: m.params["embed"].dtype.itemsize  # noqa: E731  caches use the params' dtype
    total = _kv_bytes(target.config, batch, slots, item(target)) + 4 * batch * slots
    total += packed_bytes(target)
    if draft is not None and n_s > 0:
        total += packed_bytes(draft)
    peak = max(_forward_bytes(target.config, batch, prompt_width, prompt_width, False),
               _forward_bytes(target.config, batch, n_t, slots))
    if draft is not None and n_s > 0:
        total += _kv_bytes(draft.config, batch, slots, item(draft))
        peak = max(peak, _forward_bytes(draft.config, batch, max(n_s, n_first), slots))
    if pool_rows is not None and hasattr(cfg, "guesses"):
        total += pool_rows * cfg.guesses * (cfg.ngram - 1 + 2) * 4  # keys, phrases, stamps
    return total + peak


def _memory_stats(device=None) -> tuple:
    """(the device, default the first; its allocator's stats, None when it keeps none)."""
    device = device or jax.devices()[0]
    try:
        return device, device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return device, None


def available_bytes(device=None) -> Optional[int]:
    """Free bytes of the device (its allocator's limit minus what is in use; on a CPU the
    host's available memory), None when the backend does not say."""
    device, stats = _memory_stats(device)
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def total_bytes(device=None) -> Optional[int]:
    """All the device's memory (its allocator's limit; on a CPU the host's total memory), None
    when the backend does not say: what a memory fraction is a fraction of."""
    device, stats = _memory_stats(device)
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"
