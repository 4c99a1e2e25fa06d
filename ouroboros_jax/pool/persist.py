"""Saving and loading a phrase pool (mechanism 4, history across sessions).

A pool is four arrays plus two static fields, so it is stored as one `.npz` file. Loading
checks the file's layout so a pool saved for another vocabulary or n-gram size is refused
instead of silently producing useless lookups.
"""

from __future__ import annotations

import os
import zipfile

import jax.numpy as jnp
import numpy as np

from .phrase_pool import EVICTION_POLICIES, PhrasePool

_FORMAT = 1


def save_pool(path: str, pool: PhrasePool) -> None:
    """Writes the pool to `path` (.npz); the write is atomic (temp file, then rename)."""
    path = os.fspath(path)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, keys=np.asarray(pool.keys), phrases=np.asarray(pool.phrases),
                        stamps=np.asarray(pool.stamps), clock=np.asarray(pool.clock),
                        vocab_size=np.int64(pool.vocab_size), policy=np.array(pool.policy),
                        format=np.int64(_FORMAT))
    os.replace(tmp, path)


def load_pool(path: str, vocab_size: int | None = None, phrase_len: int | None = None
              ) -> PhrasePool:
    """Reads a pool saved by `save_pool`; vocab_size / phrase_len, when given, must match."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pool file {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable pool file ({e})") from None
    need = {"keys", "phrases", "stamps", "clock", "vocab_size", "policy", "format"}
    if not need <= set(d):
        raise ValueError(f"{path}: pool file lacks {sorted(need - set(d))}")
    if int(d["format"]) != _FORMAT:
        raise ValueError(f"{path}: pool format {int(d['format'])} unsupported")
    keys, phrases, stamps = d["keys"], d["phrases"], d["stamps"]
    if keys.ndim != 2 or phrases.shape[:2] != keys.shape or stamps.shape != keys.shape:
        raise ValueError(f"{path}: inconsistent pool shapes keys {keys.shape}, phrases "
                         f"{phrases.shape}, stamps {stamps.shape}")
    policy = str(d["policy"])
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"{path}: unknown eviction policy {policy!r}")
    if vocab_size is not None and int(d["vocab_size"]) != vocab_size:
        raise ValueError(f"{path}: pool was built for vocab_size {int(d['vocab_size'])}, "
                         f"not {vocab_size}")
    if phrase_len is not None and phrases.shape[2] != phrase_len:
        raise ValueError(f"{path}: pool phrases have {phrases.shape[2]} tokens, not {phrase_len}")
    return PhrasePool(keys=jnp.asarray(keys, jnp.int32), phrases=jnp.asarray(phrases, jnp.int32),
                      stamps=jnp.asarray(stamps, jnp.int32),
                      clock=jnp.asarray(d["clock"], jnp.int32),
                      vocab_size=int(d["vocab_size"]), policy=policy)
