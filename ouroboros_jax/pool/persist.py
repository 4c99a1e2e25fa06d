"""Saving and loading a phrase pool (mechanism 4, history across sessions).

A pool is four arrays plus two static fields, so it is stored as one `.npz` file. Loading
checks the file's layout and contents (shapes, integer dtypes, every id inside the vocabulary,
stamps and clock consistent) so a pool saved for another vocabulary or n-gram size, or edited
by hand, is refused instead of producing useless lookups or crashing inside the decode loop.
"""

from __future__ import annotations

import os
import uuid
import zipfile
import zlib

import jax.numpy as jnp
import numpy as np

from .phrase_pool import EVICTION_POLICIES, PhrasePool, check_pool

_FORMAT = 1


def save_pool(path: str, pool: PhrasePool) -> None:
    """Writes the pool to `path` (.npz); the write is atomic (a temp file of its own beside it,
    then a rename), so concurrent saves to one path never fail or mix: the last rename wins."""
    check_pool(pool)
    path = os.fspath(path)
    # a unique temp name per save: a fixed one let one saver rename another's file away
    # (opened "x": created here, with the umask's permissions, as np.savez would)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as f:  # a file object: savez adds no ".npz" to the name
            np.savez_compressed(f, keys=np.asarray(pool.keys), phrases=np.asarray(pool.phrases),
                                stamps=np.asarray(pool.stamps), clock=np.asarray(pool.clock),
                                vocab_size=np.int64(pool.vocab_size),
                                policy=np.array(pool.policy), format=np.int64(_FORMAT))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # never leave a half-written or orphaned temp file behind
            os.remove(tmp)
        raise


def load_pool(path: str, vocab_size: int | None = None, phrase_len: int | None = None
              ) -> PhrasePool:
    """Reads a pool saved by `save_pool`; vocab_size / phrase_len, when given, must match."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pool file {path!r} does not exist")
    try:
        z = np.load(path, allow_pickle=False)
        if not hasattr(z, "files"):
            raise ValueError("a single .npy array, not an .npz archive")
        with z:
            d = {k: z[k] for k in z.files}
    # An empty, truncated or bit-flipped archive surfaces as any of these (zip headers, zlib
    # streams, "encrypted" flag bits, unknown compression methods): all mean the same thing.
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, RuntimeError,
            NotImplementedError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable pool file ({type(e).__name__}: {e})") from None
    need = {"keys", "phrases", "stamps", "clock", "vocab_size", "policy", "format"}
    if not need <= set(d):
        raise ValueError(f"{path}: pool file lacks {sorted(need - set(d))}")
    for n in ("format", "vocab_size", "clock"):
        if d[n].shape != () or not np.issubdtype(d[n].dtype, np.integer):
            raise ValueError(f"{path}: {n} must be an integer scalar, got {d[n].dtype} "
                             f"{d[n].shape}")
    if int(d["format"]) != _FORMAT:
        raise ValueError(f"{path}: pool format {int(d['format'])} unsupported")
    keys, phrases, stamps = d["keys"], d["phrases"], d["stamps"]
    for n, a in (("keys", keys), ("phrases", phrases), ("stamps", stamps)):
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{path}: {n} must hold integers, got {a.dtype}")
    if keys.ndim != 2 or phrases.ndim != 3 or phrases.shape[:2] != keys.shape \
            or stamps.shape != keys.shape or min(phrases.shape) < 1:
        raise ValueError(f"{path}: inconsistent pool shapes keys {keys.shape}, phrases "
                         f"{phrases.shape}, stamps {stamps.shape}")
    if d["policy"].shape != () or d["policy"].dtype.kind != "U":
        raise ValueError(f"{path}: policy must be a string")
    policy = str(d["policy"])
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"{path}: unknown eviction policy {policy!r}")
    V, clock = int(d["vocab_size"]), int(d["clock"])
    if not 1 <= V < 2**31:
        raise ValueError(f"{path}: vocab_size {V} out of range")
    filled = stamps > 0
    rows = np.arange(keys.shape[0])[:, None]
    if (stamps < 0).any() or not 0 <= clock < 2**31:
        raise ValueError(f"{path}: negative stamps or clock out of range")
    if ((keys < 0) & filled).any() or (keys >= V).any() or (keys < -1).any():
        raise ValueError(f"{path}: keys must be -1 (empty) or token ids in [0, {V})")
    if ((keys % keys.shape[0] != rows) & filled).any():
        raise ValueError(f"{path}: a key is stored outside its row (key % rows)")
    bad = filled[..., None] & ((phrases < 0) | (phrases >= V))
    if bad.any():
        r, g, m = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{path}: phrase token {int(phrases[r, g, m])} (row {r}, slot {g}) is "
                         f"outside the vocabulary [0, {V})")
    live = stamps[filled]
    if len(np.unique(live)) != len(live) or (live.size and live.max() > clock):
        raise ValueError(f"{path}: stamps must be unique and at most clock ({clock})")
    if vocab_size is not None and int(d["vocab_size"]) != vocab_size:
        raise ValueError(f"{path}: pool was built for vocab_size {int(d['vocab_size'])}, "
                         f"not {vocab_size}")
    if phrase_len is not None and phrases.shape[2] != phrase_len:
        raise ValueError(f"{path}: pool phrases have {phrases.shape[2]} tokens, not {phrase_len}")
    return PhrasePool(keys=jnp.asarray(keys, jnp.int32), phrases=jnp.asarray(phrases, jnp.int32),
                      stamps=jnp.asarray(stamps, jnp.int32),
                      clock=jnp.asarray(d["clock"], jnp.int32),
                      vocab_size=int(d["vocab_size"]), policy=policy)
