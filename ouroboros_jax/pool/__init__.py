"""Phrase pool: fixed-shape, device-resident n-gram store (docs/algorithm.md section 3).

Knows nothing of models; see `phrase_pool` for the layout and semantics.
"""

from ouroboros_jax.pool.phrase_pool import (
    DEFAULT_MAX_ROWS,
    EVICTION_POLICIES,
    PhrasePool,
    check_pool,
    clear_keys,
    clear_pool,
    init_pool,
    insert,
    insert_context,
    insert_many,
    lookup,
    pool_bytes,
    pool_occupancy,
    prepare_pool,
    ranged_pool,
)
from ouroboros_jax.pool.persist import load_pool, save_pool

__all__ = [
    "DEFAULT_MAX_ROWS",
    "EVICTION_POLICIES",
    "PhrasePool",
    "check_pool",
    "clear_keys",
    "clear_pool",
    "init_pool",
    "insert",
    "insert_context",
    "insert_many",
    "load_pool",
    "lookup",
    "pool_bytes",
    "pool_occupancy",
    "prepare_pool",
    "ranged_pool",
    "save_pool",
]
