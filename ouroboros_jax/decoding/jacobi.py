"""The lookahead (Jacobi) step of docs/algorithm.md section 1, as pure functions of any model.

Used by the target in lookahead decoding and by the draft inside Ouroboros. One step is one
forward over a fixed-size tree (`tree.jacobi_tree(W, N, G)`):

  [ last | level0: W-1 | level1 .. level(N-2): W each | guesses: G x (N-1) ]

optionally preceded by a causal prefix of up to U tokens that the model has not processed yet
(Ouroboros feeds the target's accepted/corrected tokens that way; rows fill the slot with
their own counts, the rest is masked invalid). After the forward:

  - the guess (pool phrase keyed by `last`) that agrees longest with the model's own choices
    is walked with the shared `accept_walk` (1 + matched tokens emitted);
  - every window column yields an n-gram (key, level1..level(N-2), new prediction) for the pool,
    once the window has warmed up;
  - the window moves on by one: its [N-1, W] grid shifts up a row, the predictions at level
    N-2 become the new bottom row.

Window state: `grid[b, l, c]` is level l, column c (grid[:, 0, 0] stands for `last` and is never
read). Its node sits at depth l + c below `last`, i.e. it is a guess of the token l + c places
after `last`. The start is a Hankel fill from W+N-3 consecutive prompt tokens (taken cyclically
from the prompt's end): grid[l, c] = u[l + c - 1], so the first columns are the prompt's own
n-grams shifted; deterministic, no host randomness. During the first N-2 steps the levels still
hold start tokens, so no n-gram is harvested yet (warm-up); pool guesses are verified from the
first step, since a pool carried over from earlier calls is already useful then.

Letters (package glossary): B rows, W window, N n-gram size, M = N-1, G guesses, U prefix slot,
T tree nodes, Q nodes whose logits are kept, A tokens one step can emit (= N), V vocab.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..models import forward
from ..models.kv_cache import KVCache, NewKV, commit
from ..pool import PhrasePool, insert_many, lookup
from ..sampling import token_probability
from ..tree import JacobiLayout, chain_parents, tree_mask
from .verify import Accepted, accept_walk


@struct.dataclass
class JacobiWindow:
    """A Jacobi (lookahead) window per row.

    Attributes:
        grid: int32[B, N-1, W]; grid[b, l, c] is level l, column c, a guess of the token
            l + c places after `last` (grid[:, 0, 0] stands for `last` and is never read).
            Each step the grid shifts up a level and the forward's predictions become the
            bottom level N-2 (see the module docstring).
        steps: int32[B], steps taken (n-grams are harvested once steps >= N-2).
    """

    grid: jax.Array  # int32[B, N-1, W]: level l, column c (grid[:, 0, 0] unused)
    steps: jax.Array  # int32[B]: steps taken (n-grams are harvested once steps >= N-2)


def init_window(layout: JacobiLayout, prompt: jax.Array, prompt_lengths: jax.Array
                ) -> JacobiWindow:
    """Hankel start from the last W+N-3 prompt tokens (cyclic for shorter prompts).

    prompt int32[B,P] right-padded, prompt_lengths int32[B] (>= 1).
    """
    w, m = layout.window, layout.ngram - 1
    u_len = w + m - 2  # = W + N - 3
    lc = np.arange(m)[:, None] + np.arange(w)[None, :] - 1  # [M, W], -1 at (0, 0)
    lc = np.maximum(lc, 0)
    plen = prompt_lengths.astype(jnp.int32)[:, None, None]
    idx = jnp.mod(plen - u_len + jnp.asarray(lc)[None], plen)  # [B, M, W]
    B = prompt.shape[0]
    grid = jnp.take_along_axis(prompt, idx.reshape(B, -1), axis=1).reshape(B, m, w)
    return JacobiWindow(grid=grid.astype(jnp.int32), steps=jnp.zeros((B,), jnp.int32))


def empty_window(layout: JacobiLayout, rows: int) -> JacobiWindow:
    """B = rows zero windows (the engine's free slots; `init_window` restarts a row)."""
    m, w = layout.ngram - 1, layout.window
    return JacobiWindow(grid=jnp.zeros((rows, m, w), jnp.int32),
                        steps=jnp.zeros((rows,), jnp.int32))


def tree_forward(params, model_config, cache: KVCache, tokens: jax.Array, parents: np.ndarray,
                 depths: np.ndarray, valid: jax.Array, select: np.ndarray,
                 prefix: Optional[jax.Array] = None, prefix_count: Optional[jax.Array] = None
                 ) -> tuple[jax.Array, NewKV, jax.Array]:
    """One forward of a static tree after the cache, with an optional causal prefix.

    tokens int32[B,T], parents/depths static int[T] (roots have parent -1), valid bool[B,T],
    select static int[Q] (tree nodes whose logits are needed). prefix int32[B,U] with
    prefix_count int32[B]: the first prefix_count[b] prefix tokens are real and form a chain
    after the cache; the tree's roots hang off the prefix. Returns (logits f32[B,Q,V],
    NewKV over all U+T nodes (prefix first), positions int32[B,Q] of the selected nodes).
    """
    B, T = tokens.shape
    base = cache.lengths[:, None]
    if prefix is None:
        all_tokens, all_parents, all_valid = tokens, np.asarray(parents), valid
        pos = base + jnp.asarray(depths)[None]
        sel = np.asarray(select)
    else:
        U = prefix.shape[1]
        parents = np.asarray(parents)
        all_parents = np.concatenate([chain_parents(U),
                                      np.where(parents < 0, U - 1, parents + U)]).astype(np.int32)
        a = jnp.arange(U, dtype=jnp.int32)[None]
        pc = prefix_count.astype(jnp.int32)[:, None]
        all_tokens = jnp.concatenate([prefix, tokens], axis=1)
        all_valid = jnp.concatenate([a < pc, valid], axis=1)
        pos = jnp.concatenate([base + a, base + pc + jnp.asarray(depths)[None]], axis=1)
        sel = np.asarray(select) + U
    mask = tree_mask(all_parents, all_valid)
    sel_b = jnp.broadcast_to(jnp.asarray(sel, jnp.int32)[None], (B, len(sel)))
    logits, new = forward(params, model_config, all_tokens, pos, mask, cache, select=sel_b)
    return logits, new, jnp.take_along_axis(pos, sel_b, axis=1)


def commit_with_prefix(cache: KVCache, new: NewKV, prefix_slot: int, prefix_count: jax.Array,
                       path: jax.Array, path_count: jax.Array) -> KVCache:
    """Commits the first prefix_count[b] prefix nodes, then the first path_count[b] tree nodes
    of path int32[B,A] (tree indices). prefix_slot is the static U of the forward (0: none)."""
    B, A = path.shape
    U = prefix_slot
    a = jnp.arange(U + A, dtype=jnp.int32)[None]
    pc = prefix_count.astype(jnp.int32)[:, None]
    from_path = jnp.take_along_axis(path, jnp.clip(a - pc, 0, A - 1), axis=1) + U
    idx = jnp.where(a < pc, a, from_path)
    return commit(cache, new, idx, prefix_count + path_count)


@struct.dataclass
class JacobiResult:
    """What one `jacobi_step` produced (nothing of it committed yet).

    Attributes:
        acc: the walk along the best guess: path in tree indices [B, A = N], tokens [B, N],
            count [B] (1 + matched guess tokens).
        new: K/V of all U + T nodes of the forward (prefix first).
        window: the window moved on by one step (rows not active: unchanged).
        pool: the pool with this step's harvested n-grams inserted.
        guess_found: bool[B], at least one pool guess existed for `last`.
        confidence: f32[B, N], the model's softmax probability of each walked token
            (`acc.tokens`), or None unless asked for (adaptive drafting).
        walk_logits: f32[B, N, V], the logits each walked token was chosen from, or None
            unless asked for (the target's logprobs, `decoding/logprobs.py`).
    """

    acc: Accepted
    new: NewKV
    window: JacobiWindow
    pool: PhrasePool
    guess_found: jax.Array
    confidence: Optional[jax.Array] = None
    walk_logits: Optional[jax.Array] = None


def jacobi_step(params, model_config, layout: JacobiLayout, cache: KVCache, window: JacobiWindow,
                pool: PhrasePool, last: jax.Array, active: jax.Array,
                choose: Callable[[jax.Array, jax.Array], jax.Array], *,
                prefix: Optional[jax.Array] = None, prefix_count: Optional[jax.Array] = None,
                with_confidence: bool = False, key_offset: Optional[jax.Array] = None,
                with_logits: bool = False, propose: Optional[jax.Array] = None,
                constrain: Optional[Callable] = None) -> JacobiResult:
    """One lookahead step of rows `active` (bool[B]); inactive rows keep window and pool.

    last int32[B]: the pending token (root), at position cache.lengths (+ prefix_count).
    choose(logits [B,Q,V], positions [B,Q]) -> int32[B,Q]: the model's token after a node
    (positions = where the chosen token lands): argmax for a greedy draft, `choose_tokens` for
    the target. Window predictions always use argmax (they are only candidates).
    Nothing is committed here: the caller commits `acc.path` (see `commit_with_prefix`).
    with_confidence (static): also return the model's probability of each walked token;
    with_logits (static): the logits each walked token was chosen from.
    propose bool[B] (None: every row): rows whose pool guesses are offered; the others'
    walks stop at the root (speculation off for that row).
    key_offset int32[B] (None: 0): added to the row's pool keys, lookups and inserts alike
    (the engine's per-request pools give each slot its own key range).
    constrain (None: no constraint): constrain(tokens int32[B,Q], parents int[Q], logits
    [B,Q,V]) -> logits masked by the automaton state at each of the Q verified nodes (the
    root, then each guess's chain), applied before `choose` (`decoding/constrained.py`).
    """
    B = last.shape[0]
    w, n, g = layout.window, layout.ngram, layout.guesses
    m = n - 1
    T = layout.size
    li, gi, ki = layout.level_index, layout.guess_index, layout.key_index

    # -- input: last, window grid (level0 without its column 0), guesses keyed by last
    tokens = jnp.zeros((B, T), jnp.int32).at[:, 0].set(last)
    tokens = tokens.at[:, li[0, 1:]].set(window.grid[:, 0, 1:])
    tokens = tokens.at[:, li[1:].reshape(-1)].set(window.grid[:, 1:].reshape(B, -1))  # N >= 3
    valid = jnp.ones((B, T), bool)
    if g:
        guesses, found = lookup(pool, last if key_offset is None else last + key_offset, g)
        if propose is not None:
            found = found & propose[:, None]
        tokens = tokens.at[:, gi.reshape(-1)].set(guesses.reshape(B, -1))
        valid = valid.at[:, gi.reshape(-1)].set(jnp.repeat(found, m, axis=1))
    else:
        found = jnp.zeros((B, 1), bool)

    # -- one forward; logits only where needed: last, level N-2 (window tails), guesses
    tail = li[m - 1]
    select = np.concatenate([[0], tail, gi.reshape(-1)]).astype(np.int32)
    logits, new, pos = tree_forward(params, model_config, cache, tokens, layout.parents,
                                    layout.depths, valid, select, prefix, prefix_count)
    preds = jnp.argmax(logits[:, 1:1 + w], axis=-1).astype(jnp.int32)  # [B,W]
    verify = np.concatenate([[0], np.arange(1 + w, len(select))])
    vlogits = logits[:, verify]
    if constrain is not None:  # the root, then G chains of M guess tokens hanging off it
        j = np.arange(g * m)
        vparents = np.concatenate([[-1], np.where(j % m == 0, 0, j)]).astype(np.int32)
        vlogits = constrain(tokens[:, select[verify]], vparents, vlogits)
    choices = choose(vlogits, pos[:, verify] + 1)  # [B, 1 + G*M]

    # -- accept along the best guess: the walk over [last, that guess] (a chain of N nodes)
    c0 = choices[:, :1]
    if g:
        gtok = guesses  # [B,G,M]
        gch = choices[:, 1:].reshape(B, g, m)  # model's token after each guess node
        before = jnp.concatenate([jnp.broadcast_to(c0[:, :, None], (B, g, 1)), gch[:, :, :-1]], 2)
        run = jnp.cumprod((gtok == before) & found[:, :, None], axis=2)
        best = jnp.argmax(jnp.sum(run, axis=2), axis=1)  # [B], first longest
        btok = jnp.take_along_axis(gtok, best[:, None, None], 1)[:, 0]  # [B,M]
        bch = jnp.take_along_axis(gch, best[:, None, None], 1)[:, 0]
        bfound = jnp.take_along_axis(found, best[:, None], 1)  # [B,1]
        ctok = jnp.concatenate([last[:, None], btok], 1)
        cch = jnp.concatenate([c0, bch], 1)
        cvalid = jnp.concatenate([jnp.ones((B, 1), bool), jnp.repeat(bfound, m, 1)], 1)
        acc = accept_walk(chain_parents(n), ctok, cvalid, cch)
        conf = walked = None
        if with_confidence or with_logits:  # only the N nodes of the best guess's chain
            nodes = jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                                     1 + best[:, None] * m + jnp.arange(m)[None]], 1)  # [B,N]
            chain_logits = jnp.take_along_axis(vlogits, nodes[:, :, None], 1)
            walked = jnp.take_along_axis(chain_logits, acc.path[:, :, None], 1)
        if with_confidence:
            conf = jnp.take_along_axis(token_probability(chain_logits, cch), acc.path, 1)
        tree_of = jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                                   jnp.asarray(gi, jnp.int32)[best]], 1)  # [B,N]
        path = jnp.take_along_axis(tree_of, acc.path, 1)
    else:
        acc = accept_walk(chain_parents(1), last[:, None], jnp.ones((B, 1), bool), c0)
        path = acc.path
        conf = token_probability(logits[:, :1], c0) if with_confidence else None
        walked = vlogits[:, :1] if with_logits else None
    acc = acc.replace(path=path)

    # -- harvest each column's n-gram: key, level1..level(N-2), new prediction
    warm = active & (window.steps >= n - 2)
    keys = tokens[:, ki]  # [B,W]: last, then level0
    if key_offset is not None:
        keys = keys + key_offset[:, None]
    phr = jnp.concatenate([jnp.transpose(window.grid[:, 1:], (0, 2, 1)), preds[:, :, None]], 2)
    pool = insert_many(pool, keys.reshape(-1), phr.reshape(-1, m), jnp.repeat(warm, w))

    # -- move the window by one
    moved = jnp.concatenate([window.grid[:, 1:], preds[:, None]], 1)
    grid = jnp.where(active[:, None, None], moved, window.grid)
    window = JacobiWindow(grid=grid, steps=window.steps + active.astype(jnp.int32))
    return JacobiResult(acc=acc, new=new, window=window, pool=pool,
                        guess_found=jnp.any(found, axis=1), confidence=conf,
                        walk_logits=walked)
