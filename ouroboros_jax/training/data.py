"""Document packing: token streams cut into fixed [B, T+1] windows.

Each file becomes `<s> tokens </s>`; files are concatenated in manifest order into one uint16
stream, which is cut into windows of T+1 tokens (inputs are [:, :-1], targets [:, 1:]). Windows
cross document boundaries; the EOS/BOS pair tells the model where a file ends. Epoch e visits the
windows in a permutation seeded by (seed, e), so batch k is a pure function of (seed, k): resuming
at step k reproduces the data order exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ouroboros_jax.training import corpus
from ouroboros_jax.training.tokenizer import BOS_ID, EOS_ID, load_tokenizer


def encode_stream(texts: list[str], tok) -> np.ndarray:
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([BOS_ID, *enc.ids, EOS_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def token_stream(manifest_path: str | Path, tokenizer_dir: str | Path, split: str, cache_dir: str | Path | None = None) -> np.ndarray:
    """The split's packed stream, cached as .npy keyed by the manifest and tokenizer hashes."""
    import hashlib

    m = corpus.load_manifest(manifest_path)
    tok_hash = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()[:12]
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"{split}-{m['files_hash'][:12]}-{tok_hash}.npy"
        if cache.exists():
            return np.load(cache)
    stream = encode_stream(corpus.read_texts(m, split), load_tokenizer(tokenizer_dir))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, stream)
    return stream


class Packed:
    """Fixed windows of T+1 tokens over a stream; `batch(k)` is deterministic in (seed, k)."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        self.T, self.B, self.seed = seq_len, batch_size, seed
        n = (len(stream) - 1) // seq_len  # windows overlap by one token: target of the last = input of the next
        if n < batch_size:
            raise ValueError(f"stream of {len(stream)} tokens gives {n} windows < batch {batch_size}")
        self.stream, self.num_windows = stream, n
        self.batches_per_epoch = n // batch_size
        self._perm_epoch, self._perm = -1, None

    def _window(self, i: int) -> np.ndarray:
        s = i * self.T
        return self.stream[s : s + self.T + 1]

    def batch(self, k: int) -> np.ndarray:
        """int32[B, T+1] for global step k."""
        epoch, j = divmod(k, self.batches_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        idx = self._perm[j * self.B : (j + 1) * self.B]
        return np.stack([self._window(i) for i in idx]).astype(np.int32)

    def eval_batches(self, max_windows: int | None = None):
        """Consecutive windows in stream order (no shuffling), B at a time; the last may be smaller."""
        n = self.num_windows if max_windows is None else min(max_windows, self.num_windows)
        for s in range(0, n, self.B):
            yield np.stack([self._window(i) for i in range(s, min(s + self.B, n))]).astype(np.int32)
