"""The one tree primitive every attention mask in the project is built from
(docs/algorithm.md section 5).

Every forward that scores more than one new token (prefill chunk, speculative chain, Ouroboros
chain + suffix branches, the draft's Jacobi window + pool guesses) is a forest of T new nodes
hanging off the committed prefix (the KV cache). It is described by one array:

  parents  int[..., T]   parents[i] = index (within the T new nodes) of node i's parent, or -1
                          when node i hangs directly off the cache. Topological: parents[i] < i.

From it follow, with no per-strategy code:

  tree_mask(parents, valid)  bool[..., T, T]  mask[i, j] = j is an ancestor of i, or j == i
  tree_depths(parents)       int32[..., T]    strict ancestors within the T nodes
  positions                  = cache_length[..., None] + depths   (the caller adds)

Node i sees the whole cache plus tree_mask[i]; the model never knows which strategy built it.

The static layouts (`chain_parents`, `jacobi_tree`, `chain_with_branches`) return numpy and
index bookkeeping, so callers scatter tokens in and gather predictions out by index arrays
instead of offset arithmetic. Layout builders are cached, so the same arguments give the very
same (hashable) object and can be passed as static jit arguments without recompiling.

Dimension letters (package glossary): B batch, T new tokens (tree nodes), W window, N n-gram
size, M = N-1 phrase length, G guesses (phrases per key), C chain length, X branches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "tree_mask",
    "tree_depths",
    "chain_parents",
    "JacobiLayout",
    "jacobi_tree",
    "ChainBranchLayout",
    "chain_with_branches",
]


# ----------------------------------------------------------------------------- primitive


def _check_static_parents(parents) -> None:
    """Validate parents when they are concrete numpy (static layouts); traced ones are trusted.

    Concrete jax arrays are not checked either: that would force a device->host sync.
    """
    if not isinstance(parents, (np.ndarray, list, tuple)):
        return
    p = np.asarray(parents)
    if p.ndim < 1:
        raise ValueError(f"parents must have shape [..., T], got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"parents must be integers, got dtype {p.dtype}")
    idx = np.arange(p.shape[-1])
    if np.any(p < -1) or np.any(p >= idx):
        raise ValueError(
            "parents must satisfy -1 <= parents[i] < i (topological order); got "
            f"{p.tolist() if p.size <= 64 else p}"
        )


def _ancestor_or_self(parents, xp=jnp):
    """int[..., T] parents -> bool[..., T, T] reach[i, j] = j is i's ancestor or j == i.

    One-hot parent matrix, then transitive closure by repeated squaring: after s squarings
    (A | I) covers paths of length <= 2**s, and the longest path in T topological nodes is T-1,
    so ceil(log2(T-1)) static steps suffice. A matmul per step (not a scan over nodes) keeps
    it O(log T) sequential depth and works on traced, batched parents. xp: jnp (traced
    parents) or np (concrete ones: run eagerly in jax, each op would compile a small program
    of its own while the loop is traced).
    """
    parents = xp.asarray(parents, dtype=xp.int32)
    t = parents.shape[-1]
    cols = xp.arange(t, dtype=xp.int32)
    # parents == -1 matches no column, so roots get no edge.
    step = (parents[..., :, None] == cols) | (cols[:, None] == cols)  # [..., T, T]
    # float matmul: entries are 0/1 and any positive count means "reachable", so even bf16 /
    # tf32 matmul precision cannot flip the > 0.5 test.
    reach = step.astype(xp.float32)
    for _ in range(max(t - 2, 0).bit_length()):
        reach = (xp.einsum("...ij,...jk->...ik", reach, reach) > 0.5).astype(xp.float32)
    return reach > 0.5


def tree_mask(parents, valid=None) -> jax.Array:
    """Attention mask among T new nodes: "ancestor or self".

    Args:
      parents: int[..., T] (numpy or jax, may be traced), -1 = hangs off the cache, and
        parents[i] < i. Numpy input is validated (ValueError); traced input is trusted.
      valid: optional bool[..., T] (broadcastable against parents). An invalid node is nobody's
        ancestor: no other node attends to it. It still attends to itself (and to its valid
        ancestors), so no softmax row is ever fully masked, even with no cache.
        Validity masks columns only: a valid node below an invalid one still sees the
        invalid node's own valid ancestors.

    Returns:
      bool[..., T, T] mask[i, j] = j is an ancestor of i or j == i (and j valid or j == i).
    """
    _check_static_parents(parents)
    if isinstance(parents, (np.ndarray, list, tuple)):
        # Static layouts: fold the closure into a constant instead of staging log2(T) [T,T]
        # matmuls that would run at every decoding step (~2.6 ms at T = 240 on CPU). In
        # numpy: run eagerly in jax, each of its ops compiled a small program of its own while
        # the loop was traced (11 programs, about 1 s of a demo pair's first Ouroboros call).
        mask = jnp.asarray(_ancestor_or_self(np.asarray(parents), xp=np))
    else:
        mask = _ancestor_or_self(parents)
    if valid is not None:
        t = mask.shape[-1]
        eye = jnp.eye(t, dtype=bool)
        mask = mask & (jnp.asarray(valid, dtype=bool)[..., None, :] | eye)
    return mask


def tree_depths(parents) -> jax.Array:
    """int[..., T] parents -> int32[..., T] number of strict ancestors among the T nodes.

    A node with parent -1 has depth 0; its position is cache_length + depth (caller adds).
    """
    _check_static_parents(parents)
    if isinstance(parents, (np.ndarray, list, tuple)):
        return jnp.asarray(_np_depths_any(np.asarray(parents)))
    return jnp.sum(_ancestor_or_self(parents), axis=-1, dtype=jnp.int32) - 1


def _np_depths_any(parents: np.ndarray) -> np.ndarray:
    """Host-side depths for static parents with any leading batch dims."""
    flat = parents.reshape(-1, parents.shape[-1])
    return np.stack([np_depths(row) for row in flat]).reshape(parents.shape).astype(np.int32)


# ----------------------------------------------------------------------------- static layouts


def _frozen(a) -> np.ndarray:
    """int32 copy, read-only: layouts are cached and shared, so nobody may edit them in place."""
    a = np.array(a, dtype=np.int32)
    a.flags.writeable = False
    return a


def np_depths(parents: np.ndarray) -> np.ndarray:
    """Host-side depths of a static layout (parents[i] < i, so one forward pass suffices)."""
    depths = np.zeros(len(parents), dtype=np.int32)
    for i, p in enumerate(parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    return depths


def chain_parents(n: int) -> np.ndarray:
    """int32[n] parents of a plain causal chain: node 0 off the cache, node i off node i-1."""
    if n < 0:
        raise ValueError(f"chain length n must be >= 0, got {n}")
    return _frozen(np.arange(n) - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class JacobiLayout:
    """Index bookkeeping of one lookahead (Jacobi) step input, docs/algorithm.md section 1.

    Node order: [ last | level0: W-1 | level1 .. level(N-2): W each | guesses: G x (N-1) ].

    The window is kept as a grid of N-1 rows (levels) by W columns. Column c is one n-gram:
    key = `key_index[c]` (`last` for c = 0, level0[c-1] otherwise), continuation =
    level1[c] .. level(N-2)[c] then the model's prediction at level(N-2)[c]. Every window node
    hangs off the node above it in its column (`last` above level1[0]); level0 itself is a
    chain left to right off `last`.

    Fields (all numpy int32, read-only):
      window W, ngram N, guesses G: the sizes it was built for.
      size: T = (W + G) * (N - 1), total input length.
      window_size: W * (N - 1), the 1 + (W-1) + (N-2) * W window tokens (last included).
      last_index: 0, index of `last`.
      parents: int32[T].
      depths: int32[T], position offsets from pos(last) (last has depth 0).
      level_index: int32[N-1, W], level_index[l, c] = input index of level l, column c;
        level_index[0, 0] = -1 (level0 has only W-1 tokens: its slot is `last`).
      key_index: int32[W], level_index[0] with column 0 replaced by last_index (n-gram keys).
      guess_index: int32[G, N-1], guess_index[g, m] = input index of token m of guess g.

    Use: tokens[level_index[l, 1:]] etc. to scatter; predictions[level_index[N-2]] are the new
    last level and the n-gram tails; predictions[guess_index] are verified against guess tokens
    (the prediction at last, index 0, checks each guess's first token). The window update
    "level0 <- level1 without its first token, level l <- level l+1, level(N-2) <- predictions"
    is a shift of the [N-1, W] token grid up by one row.
    """

    window: int
    ngram: int
    guesses: int
    size: int
    window_size: int
    last_index: int
    parents: np.ndarray
    depths: np.ndarray
    level_index: np.ndarray
    key_index: np.ndarray
    guess_index: np.ndarray


@functools.lru_cache(maxsize=None)
def jacobi_tree(window: int, ngram: int, guesses: int) -> JacobiLayout:
    """Static tree of one lookahead step (docs/algorithm.md section 1) -> JacobiLayout.

    Args:
      window: W >= 1, Jacobi window width (columns).
      ngram: N >= 3, n-gram size; a phrase has M = N-1 tokens. N = 2 is rejected: the window
        would have no level carrying a continuation, so it would yield no n-grams.
      guesses: G >= 0, pool phrases verified per step (each a chain of N-1 tokens off last).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if ngram < 3:
        raise ValueError(f"ngram must be >= 3 (level1 must exist to form n-grams), got {ngram}")
    if guesses < 0:
        raise ValueError(f"guesses must be >= 0, got {guesses}")
    w, m, g = window, ngram - 1, guesses

    # Grid of input indices; the -1 at [0, 0] stands for level0's missing first column.
    level_index = np.empty((m, w), dtype=np.int64)
    level_index[0, 0] = -1
    level_index[0, 1:] = 1 + np.arange(w - 1)
    level_index[1:] = w + np.arange((m - 1) * w).reshape(m - 1, w)
    window_size = w * m
    guess_index = window_size + np.arange(g * m).reshape(g, m)
    size = window_size + g * m

    key_index = level_index[0].copy()
    key_index[0] = 0  # `last` is column 0's key

    parents = np.full(size, -1, dtype=np.int64)  # `last` (index 0) hangs off the cache
    parents[level_index[0, 1:]] = key_index[:-1]  # level0 chain: off last, then off level0[j-1]
    parents[level_index[1:]] = np.concatenate([key_index[None], level_index[1:-1]])  # above
    if g:
        parents[guess_index[:, 0]] = 0  # each guess starts off `last`
        parents[guess_index[:, 1:]] = guess_index[:, :-1]

    return JacobiLayout(
        window=w,
        ngram=ngram,
        guesses=g,
        size=size,
        window_size=window_size,
        last_index=0,
        parents=_frozen(parents),
        depths=_frozen(np_depths(parents)),
        level_index=_frozen(level_index),
        key_index=_frozen(key_index),
        guess_index=_frozen(guess_index),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ChainBranchLayout:
    """A chain of C nodes off the cache, then X branches of M nodes off the chain's last node.

    Ouroboros verification: chain = correction + γ draft tokens, branches = X suffixes.
    Plain speculative verification: X = 0. Lookahead verification of G guesses: C = 1, X = G.

    Fields (numpy int32, read-only):
      chain_len C, branches X, branch_len M, size T = C + X * M.
      parents: int32[T]; depths: int32[T] (chain i at depth i, branch o token m at depth C + m).
      chain_index: int32[C] = 0 .. C-1.
      branch_index: int32[X, M], branch_index[o, m] = input index of token m of branch o.
    """

    chain_len: int
    branches: int
    branch_len: int
    size: int
    parents: np.ndarray
    depths: np.ndarray
    chain_index: np.ndarray
    branch_index: np.ndarray


@functools.lru_cache(maxsize=None)
def chain_with_branches(chain_len: int, branches: int, branch_len: int) -> ChainBranchLayout:
    """Static chain-plus-branches tree -> ChainBranchLayout (see the class for fields)."""
    if chain_len < 1:
        raise ValueError(
            f"chain_len must be >= 1 (branches hang off its last node), got {chain_len}"
        )
    if branches < 0 or branch_len < 0:
        raise ValueError(f"branches and branch_len must be >= 0, got {branches}, {branch_len}")
    c, x, m = chain_len, branches, branch_len
    chain_index = np.arange(c)
    branch_index = c + np.arange(x * m).reshape(x, m)
    parents = np.concatenate([chain_parents(c), np.zeros(x * m, dtype=np.int32)]).astype(np.int64)
    if x and m:
        parents[branch_index[:, 0]] = c - 1
        parents[branch_index[:, 1:]] = branch_index[:, :-1]
    return ChainBranchLayout(
        chain_len=c,
        branches=x,
        branch_len=m,
        size=c + x * m,
        parents=_frozen(parents),
        depths=_frozen(np_depths(parents)),
        chain_index=_frozen(chain_index),
        branch_index=_frozen(branch_index),
    )
