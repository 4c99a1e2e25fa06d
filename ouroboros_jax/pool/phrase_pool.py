"""Phrase pool: a fixed-shape, device-resident n-gram table (docs/algorithm.md section 3).

A phrase is a key token plus the M = N-1 tokens that followed it (an n-gram). The reference
keeps a Python dict token -> list of <= G phrases with LRU order and no bound on keys; here it
is four arrays updated inside the jitted decode loop, with memory fixed at construction:

  keys     int32[R, G]     key token held by each slot, -1 when empty
  phrases  int32[R, G, M]  continuation tokens of each slot
  stamps   int32[R, G]     recency clock value at last insert/refresh; 0 = empty slot
  clock    int32[]         number of writes so far (the next write gets clock + 1)

Key k lives in row k % R. With R = V each row is exactly one key's G slots (the reference's
dict, made dense). With R < V several keys share a row and compete for its G slots (the oldest
slot is evicted whoever owns it); a lookup filters the row by key equality, so collisions cost
capacity, never correctness. That is how a 152k vocabulary stays bounded: R defaults to
min(V, 65536). For V = 152064 (Qwen), G = 20, M = 6:
  R = 65536 rows x 20 slots x (4 key + 24 phrase + 4 stamp bytes) + 4 clock = 41,943,044 bytes
  (40 MiB; each row is shared by at most 3 keys). A dense [V, G, M] table would take
  97,320,964 bytes and grow with every larger vocabulary.

Eviction is a static property of the pool (`policy`):
  "lru"  (default, as the reference): re-inserting an existing (key, phrase) makes it newest;
         when a row is full its least recently inserted/refreshed slot is replaced.
  "fifo": re-inserting an existing phrase changes nothing; the oldest *first* insert goes.

Stamps are unique among filled slots (each write takes a fresh clock value), so "newest first"
and "oldest" are always well defined. Only their order means anything, so before the int32
clock can pass 2**31 - 1 (~50 million decode steps at 40 inserts per step) the stamps are
renumbered 1..n in the same order and the clock restarts at n, the number of filled slots
(`renumber_stamps`): lookups, eviction and `save_pool` / `load_pool` never see a wrapped,
negative stamp. The check runs on the host, where a pool enters a call (`prepare_pool`, once per
`generate` call: it renumbers past RENUMBER_AT, leaving 2**30 writes of room, more than one call
can make) and in eager `insert` / `insert_many` calls; never inside a jitted loop, where a
lax.cond over the pool would copy it every round (measured: 6.5x the cost of a 40-phrase
insert_many on a 32000-row pool). `clear_pool` resets the clock.

Dimension letters (package glossary): R pool rows, G slots (phrases per key) per row, M phrase
length, I phrases inserted in one batch, V vocabulary; `insert_context` reads B rows of context
tokens of padded width P, n-grams of N = M + 1 tokens.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

DEFAULT_MAX_ROWS = 65536
CLOCK_MAX = 2**31 - 1  # the largest stamp an int32 holds
# A pool entering a call is renumbered past this clock. A call writes fewer than 2**30 phrases:
# at most max_position_embeddings rounds (<= 2**20 in any released model) of at most
# bounds.MAX_TREE_TOKENS (2**12) inserts, i.e. 2**32 only in a pathological product; the
# methods insert at most W * G + X phrases a round (hundreds), so 2**30 leaves room by far.
RENUMBER_AT = 2**30
EVICTION_POLICIES = ("lru", "fifo")


@struct.dataclass
class PhrasePool:
    """Pytree of the pool's arrays (see module docstring); sizes and policy are static.

    Attributes:
        keys: int32[R, G], the key token held by each slot, -1 when empty.
        phrases: int32[R, G, M], the continuation tokens of each slot.
        stamps: int32[R, G], recency clock value at the last insert/refresh; 0 = empty slot.
        clock: int32[], the last stamp handed out.
        vocab_size: V (static): keys and phrase tokens must lie in [0, V).
        policy: "lru" or "fifo" (static), see `EVICTION_POLICIES`.
    """

    keys: jax.Array
    phrases: jax.Array
    stamps: jax.Array
    clock: jax.Array
    vocab_size: int = struct.field(pytree_node=False)
    policy: str = struct.field(pytree_node=False, default="lru")

    @property
    def rows(self) -> int:
        return self.keys.shape[0]

    @property
    def guesses(self) -> int:
        return self.keys.shape[1]

    @property
    def phrase_len(self) -> int:
        return self.phrases.shape[2]


def init_pool(
    vocab_size: int,
    guesses: int,
    phrase_len: int,
    rows: int | None = None,
    policy: str = "lru",
) -> PhrasePool:
    """Empty pool: R = rows or min(vocab_size, 65536) rows of G = guesses slots of M tokens."""
    for name, v in (("vocab_size", vocab_size), ("guesses", guesses),
                    ("phrase_len", phrase_len), ("rows", rows)):
        if v is None and name == "rows":
            continue
        # int32 ids and slot indices: a size past 2**31 - 1 could not be addressed
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) \
                or not 1 <= v <= CLOCK_MAX:
            raise ValueError(f"init_pool: {name} must be an integer in [1, 2**31 - 1], got {v!r}")
    vocab_size, guesses, phrase_len = int(vocab_size), int(guesses), int(phrase_len)
    rows = min(vocab_size, DEFAULT_MAX_ROWS) if rows is None else int(rows)
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"policy must be one of {EVICTION_POLICIES}, got {policy!r}")
    return PhrasePool(
        keys=jnp.full((rows, guesses), -1, dtype=jnp.int32),
        phrases=jnp.zeros((rows, guesses, phrase_len), dtype=jnp.int32),
        stamps=jnp.zeros((rows, guesses), dtype=jnp.int32),
        clock=jnp.zeros((), dtype=jnp.int32),
        vocab_size=vocab_size,
        policy=policy,
    )


def check_pool(pool, where: str = "pool") -> None:
    """Host-side check of a pool's structure (not its contents): array ranks, shapes and integer
    dtypes agree, so a hand-made pool fails here, naming the array, not deep inside a jitted
    loop. Contents are checked by `load_pool`; out-of-vocabulary phrases are masked by `lookup`.
    """
    if not isinstance(pool, PhrasePool):
        raise ValueError(f"{where} must be a PhrasePool, got {type(pool).__name__}")
    arrays = {n: getattr(pool, n) for n in ("keys", "phrases", "stamps", "clock")}
    for n, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype") \
                or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{where}.{n} must be an integer array, got "
                             f"{getattr(a, 'dtype', type(a).__name__)}")
    keys, phrases, stamps, clock = (arrays[n] for n in ("keys", "phrases", "stamps", "clock"))
    if (keys.ndim != 2 or phrases.ndim != 3 or tuple(phrases.shape[:2]) != tuple(keys.shape)
            or tuple(stamps.shape) != tuple(keys.shape) or clock.shape != ()
            or min(phrases.shape) < 1):
        raise ValueError(f"{where}: inconsistent shapes keys {tuple(keys.shape)}, phrases "
                         f"{tuple(phrases.shape)}, stamps {tuple(stamps.shape)}, clock "
                         f"{tuple(clock.shape)} (want [R,G], [R,G,M], [R,G], [] with R, G, M "
                         ">= 1)")
    v = pool.vocab_size
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{where}.vocab_size must be an integer >= 1, got {v!r}")
    if pool.policy not in EVICTION_POLICIES:
        raise ValueError(f"{where}.policy must be one of {EVICTION_POLICIES}, got "
                         f"{pool.policy!r}")


def clear_pool(pool: PhrasePool) -> PhrasePool:
    """Same shapes and policy, every slot empty, clock back to 0 (history off / reset)."""
    return init_pool(pool.vocab_size, pool.guesses, pool.phrase_len, pool.rows, pool.policy)


def clear_keys(pool: PhrasePool, lo, hi) -> PhrasePool:
    """The pool with every slot whose key lies in [lo, hi) emptied: one key range's phrases
    forgotten (the serving engine's per-request ranges, when a new request takes a slot)."""
    gone = (pool.keys >= lo) & (pool.keys < hi)
    return pool.replace(keys=jnp.where(gone, -1, pool.keys),
                        stamps=jnp.where(gone, 0, pool.stamps))


def ranged_pool(pool: PhrasePool, ranges: int) -> PhrasePool:
    """An empty pool shaped as `pool` (guesses, phrase length, policy) with rows for `ranges`
    key ranges of the vocabulary each (key k + i * vocab_size is key k of range i; at most
    65536 rows)."""
    return init_pool(pool.vocab_size, pool.guesses, pool.phrase_len,
                     min(pool.vocab_size * ranges, 65536), pool.policy)


def pool_bytes(pool: PhrasePool) -> int:
    """Device bytes held by the pool's arrays (works on abstract eval_shape pools too)."""
    return int(
        sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
            for x in jax.tree_util.tree_leaves(pool))
    )


def pool_occupancy(pool: PhrasePool) -> jax.Array:
    """int32[] number of filled slots (at most R * G)."""
    return jnp.sum(pool.stamps > 0, dtype=jnp.int32)


def renumber_stamps(pool: PhrasePool) -> PhrasePool:
    """The same pool with its filled slots' stamps renumbered 1..n in their order (n filled
    slots) and the clock set to n: lookups and eviction, which only compare stamps, behave
    exactly as before. Jittable."""
    flat = pool.stamps.reshape(-1)
    filled = flat > 0
    order = jnp.argsort(flat)  # empty slots (0) first, then filled ones oldest to newest
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size, dtype=flat.dtype))
    n_empty = jnp.sum(~filled, dtype=flat.dtype)
    stamps = jnp.where(filled, rank - n_empty + 1, 0).reshape(pool.stamps.shape)
    return pool.replace(stamps=stamps, clock=jnp.sum(filled, dtype=pool.clock.dtype))


def _room_for(pool: PhrasePool, writes: int) -> PhrasePool:
    """The pool, its stamps renumbered first when `writes` more writes could pass CLOCK_MAX.
    Host side only: a traced clock (inside jit, a scan, a while_loop) is left alone, because a
    lax.cond there would copy the whole pool every call; pools enter jitted loops through
    `prepare_pool`, which makes the room."""
    if isinstance(pool.clock, jax.core.Tracer):
        return pool
    if int(pool.clock) > CLOCK_MAX - writes:
        return renumber_stamps(pool)
    return pool


def insert(pool: PhrasePool, key, phrase, valid=True) -> PhrasePool:
    """Insert one phrase; jittable, fixed shapes.

    Args:
      key: int32[] key token. A negative key is treated as padding (no-op), so callers can
        mark absent n-grams with -1.
      phrase: int32[M] continuation tokens.
      valid: bool[]; False makes the call a no-op (pool, clock included, unchanged).

    Slot choice in row key % R: the slot already holding (key, phrase) if any (LRU: refreshed
    to newest; FIFO: left alone), else the first empty slot, else the row's oldest slot.
    """
    return _insert(_room_for(pool, 1), key, phrase, valid)


def _insert(pool: PhrasePool, key, phrase, valid=True) -> PhrasePool:
    """`insert` without the clock check (the caller has made room for the write)."""
    key = jnp.asarray(key, dtype=jnp.int32)
    phrase = jnp.asarray(phrase, dtype=jnp.int32)
    if key.shape != () or phrase.shape != (pool.phrase_len,):
        raise ValueError(
            f"insert wants key int32[] and phrase int32[{pool.phrase_len}], "
            f"got shapes {key.shape} and {phrase.shape}"
        )
    valid = jnp.asarray(valid, dtype=bool) & (key >= 0)
    row = key % pool.rows
    row_keys, row_phrases, row_stamps = pool.keys[row], pool.phrases[row], pool.stamps[row]

    same = (row_stamps > 0) & (row_keys == key) & jnp.all(row_phrases == phrase, axis=-1)
    has_same = jnp.any(same)
    # Empty slots have stamp 0 < every filled stamp, so argmin finds the first empty slot
    # when there is one and the oldest slot otherwise.
    slot = jnp.where(has_same, jnp.argmax(same), jnp.argmin(row_stamps))
    write = valid & ~(has_same & (pool.policy == "fifo"))

    clock = pool.clock + write.astype(jnp.int32)
    # Writing the old values back when not writing keeps one code path with fixed shapes.
    return pool.replace(
        keys=pool.keys.at[row, slot].set(jnp.where(write, key, row_keys[slot])),
        phrases=pool.phrases.at[row, slot].set(jnp.where(write, phrase, row_phrases[slot])),
        stamps=pool.stamps.at[row, slot].set(jnp.where(write, clock, row_stamps[slot])),
        clock=clock,
    )


def insert_many(pool: PhrasePool, keys, phrases, valid=None) -> PhrasePool:
    """Insert I phrases in order: keys int32[I], phrases int32[I, M], valid bool[I] (default all).

    Sequential (lax.scan over `insert`) rather than one scatter, so duplicates and row
    collisions inside one batch behave exactly like successive inserts.
    """
    keys = jnp.asarray(keys, dtype=jnp.int32)
    phrases = jnp.asarray(phrases, dtype=jnp.int32)
    if valid is None:
        valid = jnp.ones(keys.shape, dtype=bool)
    valid = jnp.asarray(valid, dtype=bool)
    p = keys.shape
    if keys.ndim != 1 or phrases.shape != (*p, pool.phrase_len) or valid.shape != p:
        raise ValueError(
            f"insert_many wants keys [I], phrases [I, {pool.phrase_len}], valid [I]; got "
            f"{keys.shape}, {phrases.shape}, {valid.shape}"
        )

    def step(p, x):
        return _insert(p, *x), None

    pool, _ = jax.lax.scan(step, _room_for(pool, keys.shape[0]), (keys, phrases, valid))
    return pool


def insert_context(pool: PhrasePool, tokens, lengths, key_offset=None) -> PhrasePool:
    """Inserts every n-gram lying wholly inside each row's context: key = a token, phrase = the
    M tokens that follow it. Jittable, fixed shapes (P - M inserts per row, the ones that do not
    fit masked through `insert_many`'s valid).

    Args:
      tokens: int32[B,P], each row's first lengths[b] tokens are real (right padding).
      lengths: int32[B], real tokens per row (n-grams never reach past them).
      key_offset: int32[B] added to the row's keys (per-request key ranges), or None.

    Order (what decides which n-grams the LRU keeps and `lookup` offers first): within a row,
    an n-gram starting later is inserted later, so the context's most recent phrase for a key
    wins, as if the row had recycled its context token by token; a repeated n-gram is
    refreshed at its last occurrence (LRU). Across rows the inserts are aligned at the rows' ends and
    interleaved (step k = 0 .. P-M-1 inserts, in every row, the n-gram ending P-M-1-k tokens
    before the row's last one), so in a shared pool no row's newest phrases are pushed out by
    another row's older ones, whatever the rows' lengths.
    """
    tokens = jnp.asarray(tokens, dtype=jnp.int32)
    lengths = jnp.asarray(lengths, dtype=jnp.int32)
    B, P = tokens.shape
    m = pool.phrase_len
    steps = P - m  # n-gram start positions that fit in the padded width
    if steps < 1:
        return pool
    # step k, row b: the n-gram starting at i = k + lengths[b] - P, which ends at
    # lengths[b] - 1 - (steps - 1 - k); i < 0 means the row is shorter than that
    start = jnp.arange(steps, dtype=jnp.int32)[:, None] + (lengths - P)[None]  # [steps, B]
    valid = start >= 0
    at = jnp.maximum(start, 0)[..., None] + jnp.arange(m + 1, dtype=jnp.int32)  # [steps,B,N]
    rows = jnp.broadcast_to(jnp.arange(B)[None, :, None], at.shape)
    grams = tokens[rows, at]  # at < lengths <= P wherever valid
    keys = grams[..., 0] if key_offset is None else grams[..., 0] + key_offset[None]
    return insert_many(pool, keys.reshape(-1), grams[..., 1:].reshape(-1, m),
                       valid.reshape(-1))


def lookup(pool: PhrasePool, key, k: int):
    """Up to k phrases stored under key, newest first.

    Args:
      key: int32[...] key token(s); any leading shape (or vmap). Negative keys find nothing.
      k: static int, 1 <= k <= G.

    Returns:
      phrases int32[..., k, M] (rows with found=False are 0) and found bool[..., k]; found is
      a prefix mask (all True entries come first).
    """
    if not 1 <= k <= pool.guesses:
        raise ValueError(f"k must be in [1, G={pool.guesses}], got {k}")
    key = jnp.asarray(key, dtype=jnp.int32)
    row = key % pool.rows
    row_stamps = pool.stamps[row]  # [..., G]
    row_phrases = pool.phrases[row]  # [..., G, M]
    # A phrase holding an id outside [0, V) (a hand-edited or foreign pool) is never offered:
    # the model's embedding lookup would turn it into NaN and poison the whole row.
    in_vocab = jnp.all((row_phrases >= 0) & (row_phrases < pool.vocab_size), axis=-1)
    match = ((row_stamps > 0) & (pool.keys[row] == key[..., None]) & (key[..., None] >= 0)
             & in_vocab)
    # Stamps are unique among filled slots, so ordering by stamp is newest first, no ties.
    top, slot = jax.lax.top_k(jnp.where(match, row_stamps, -1), k)  # [..., k]
    found = top > 0
    phrases = jnp.take_along_axis(row_phrases, slot[..., None], axis=-2)  # [..., k, M]
    return jnp.where(found[..., None], phrases, 0), found


def shape_fits(shape: tuple, guesses: int, phrase_len: int) -> bool:
    """Whether a pool of shape (phrases per key, tokens per phrase) can serve a call that
    verifies `guesses` phrases of `phrase_len` tokens: the same phrase length, at least as
    many phrases per key."""
    return shape[1] == phrase_len and shape[0] >= guesses


def prepare_pool(pool: Optional[PhrasePool], vocab: int, guesses: int, phrase_len: int,
                 rows: Optional[int], history: bool) -> PhrasePool:
    """The pool a call starts from: the given one (history), emptied (history off), or new."""
    if pool is None:
        return init_pool(vocab, guesses, phrase_len, rows)
    if not isinstance(pool, PhrasePool):
        raise ValueError(f"pool must be a PhrasePool returned by an earlier call, got "
                         f"{type(pool).__name__}")
    check_pool(pool)
    if pool.vocab_size != vocab or not shape_fits((pool.guesses, pool.phrase_len), guesses,
                                                  phrase_len):
        raise ValueError(f"pool: shape (vocab {pool.vocab_size}, {pool.guesses} phrases per key "
                         f"of {pool.phrase_len} tokens) does not fit this call (vocab {vocab}, "
                         f">= {guesses} phrases of ngram-1 = {phrase_len} tokens)")
    if not history:
        return clear_pool(pool)
    return _room_for(pool, CLOCK_MAX - RENUMBER_AT)  # a long-lived pool's clock never wraps
