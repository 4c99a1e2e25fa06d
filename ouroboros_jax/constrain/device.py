"""The batch's automata on the device, and the pure functions the decode loop applies.

`stack_tables` puts the tables of a batch's rows into one `RowConstraints`: automaton 0 is
"accept everything" (one state, every token of class 0 leading back to it), so rows without a
constraint ride the same code; each automaton k owns the states [base[k], base[k] + S_k) of
one `next_state` and its row `class_of[k]`. A row's state is local to its automaton (0 = its
start, -1 = refused), so starting a row over is writing 0.

The loop carries each row's state (`Sequences.fsm`); everything here is a gather.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .table import TokenTable


@struct.dataclass
class RowConstraints:
    """The automata of a batch (a jit argument: changing them never recompiles as long as the
    padded shapes hold).

    Attributes:
        next_state: int32[S, C], local next state of every automaton's states, stacked.
        class_of: int32[K, V], each automaton's token classes.
        base: int32[K], where each automaton's states start in next_state.
        n_allowed: int32[S], tokens each state allows (forced where 1).
        automaton: int32[B], each row's automaton (0: unconstrained).
    """

    next_state: jax.Array
    class_of: jax.Array
    base: jax.Array
    n_allowed: jax.Array
    automaton: jax.Array


def _bucket(n: int, lo: int = 8) -> int:
    """The power of two >= n (>= lo): padded sizes, so similar batches share a program."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def stack_tables(tables: Sequence[Optional[TokenTable]], vocab_size: int,
                 capacity: Optional[tuple] = None) -> RowConstraints:
    """Per-row tables (None: unconstrained) -> RowConstraints over B = len(tables) rows.
    Rows sharing one table object share its automaton. capacity (states, classes, automata):
    fixed padded sizes (the serving engine); None: powers of two of what the batch needs."""
    uniq: list[TokenTable] = []
    automaton = np.zeros((len(tables),), np.int32)
    for b, t in enumerate(tables):
        if t is None:
            continue
        for k, u in enumerate(uniq):
            if u is t:
                automaton[b] = k + 1
                break
        else:
            uniq.append(t)
            automaton[b] = len(uniq)
    S = 1 + sum(t.next_state.shape[0] for t in uniq)
    C = max([1] + [t.next_state.shape[1] for t in uniq])
    K = 1 + len(uniq)
    if capacity is None:
        S_pad, C_pad, K_pad = _bucket(S), _bucket(C), _bucket(K, 2)
    else:
        S_pad, C_pad, K_pad = capacity
        if S > S_pad or C > C_pad or K > K_pad:
            raise ValueError(f"constraints need {S} states, {C} classes, {K} automata; the "
                             f"capacity is {capacity}")
    next_state = np.full((S_pad, C_pad), -1, np.int32)
    next_state[0, 0] = 0  # automaton 0: every token is class 0 and keeps state 0
    class_of = np.zeros((K_pad, vocab_size), np.int32)
    base = np.zeros((K_pad,), np.int32)
    n_allowed = np.zeros((S_pad,), np.int32)
    n_allowed[0] = vocab_size
    at = 1
    for k, t in enumerate(uniq, start=1):
        s, c = t.next_state.shape
        next_state[at:at + s, :c] = t.next_state
        class_of[k, :t.class_of.shape[0]] = t.class_of
        base[k] = at
        n_allowed[at:at + s] = t.n_allowed
        at += s
    return RowConstraints(jnp.asarray(next_state), jnp.asarray(class_of), jnp.asarray(base),
                          jnp.asarray(n_allowed), jnp.asarray(automaton))


def _rows(rc: RowConstraints, states: jax.Array):
    """states int32[B, ...] local -> (global row index into next_state (0 where refused),
    refused bool[B, ...])."""
    b = rc.base[rc.automaton].reshape((-1,) + (1,) * (states.ndim - 1))
    return b + jnp.maximum(states, 0), states < 0


def step(rc: RowConstraints, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """states int32[B, ...] local, tokens int32[B, ...] -> the states after each token (-1
    where refused, and where the state was already refused)."""
    g, dead = _rows(rc, states)
    cls = jnp.take_along_axis(rc.class_of[rc.automaton],
                              tokens.reshape(tokens.shape[0], -1), 1).reshape(tokens.shape)
    return jnp.where(dead, -1, rc.next_state[g, cls])


def tree_states(rc: RowConstraints, root: jax.Array, parents: np.ndarray, tokens: jax.Array
                ) -> jax.Array:
    """The state at every node of a tree of proposed tokens: root int32[B] (the state after
    the pending token, node 0), parents int[T] (static, node 0 the root, parents before
    children), tokens int32[B,T] -> int32[B,T], node i's state after its token (-1: the
    path to it leaves the language)."""
    parents = np.asarray(parents)
    T = len(parents)
    if T == 1:
        return root[:, None]
    depth = np.zeros((T,), np.int32)
    for i in range(1, T):
        depth[i] = depth[parents[i]] + 1
    par = jnp.asarray(np.maximum(parents, 0))
    states = jnp.broadcast_to(root[:, None], tokens.shape)
    for d in range(1, int(depth.max()) + 1):  # one gather per depth, whole tree at once
        nxt = step(rc, states[:, par], tokens)
        states = jnp.where(jnp.asarray(depth == d)[None], nxt, states)
    return states


def allowed_mask(rc: RowConstraints, states: jax.Array) -> jax.Array:
    """states int32[B,T] local -> bool[B,T,V]: the tokens each state allows (every token
    where the state is refused: such nodes are never walked, and their logits must stay
    finite)."""
    g, dead = _rows(rc, states)
    row = rc.next_state[g]  # [B,T,C]
    cls = rc.class_of[rc.automaton]  # [B,V]
    ok = jnp.take_along_axis(row, jnp.broadcast_to(cls[:, None, :], states.shape + cls.shape[-1:]),
                             2) >= 0
    return ok | dead[..., None]


def mask_logits(rc: RowConstraints, states: jax.Array, logits: jax.Array) -> jax.Array:
    """logits [B,T,V] with the tokens states [B,T] refuse set to -inf: the target then chooses
    (argmax, or draws after renormalising in `process_logits`) only among allowed tokens."""
    return jnp.where(allowed_mask(rc, states), logits, -jnp.inf)


def advance(rc: RowConstraints, state: jax.Array, tokens: jax.Array, count: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """state int32[B] after tokens[b, :count[b]] (tokens int32[B,A]) -> (state int32[B],
    forced int32[B]: how many of those tokens were the only one their state allowed)."""
    A = tokens.shape[1]

    def body(a, c):
        s, forced = c
        on = a < count
        g, dead = _rows(rc, s)
        forced = forced + (on & ~dead & (rc.n_allowed[g] == 1)).astype(jnp.int32)
        nxt = step(rc, s[:, None], tokens[:, a][:, None])[:, 0]
        return jnp.where(on, nxt, s), forced

    return jax.lax.fori_loop(0, A, body, (state, jnp.zeros_like(state)))


def forced_token(rc: RowConstraints, states: jax.Array) -> jax.Array:
    """states int32[B] local -> int32[B]: the one token each state allows, -1 where it allows
    several (or none, or the state is refused). Read off the table's row (no extra table on
    the device, so the engine's packed regions need nothing new): a [B, V] mask per call."""
    g, dead = _rows(rc, states)
    forced = (rc.n_allowed[g] == 1) & ~dead
    tok = jnp.argmax(allowed_mask(rc, states[:, None])[:, 0], axis=-1).astype(jnp.int32)
    return jnp.where(forced, tok, -1)


def forced_run(rc: RowConstraints, states: jax.Array, length: int, stop: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """The tokens the automaton forces from each row's state on: states int32[B] local,
    length (static) the most to follow, stop bool[B] rows that follow none -> (tokens
    int32[B, length] (0 past count), count int32[B]). A run ends at the first state that
    allows more than one token, or after a token leading back to its own state (an accepting
    state's only token is EOS, which loops: the run ends with it)."""
    B = states.shape[0]

    def body(i, c):
        s, going, toks, count = c
        t = forced_token(rc, s)
        take = going & (t >= 0)
        nxt = step(rc, s[:, None], jnp.maximum(t, 0)[:, None])[:, 0]
        toks = toks.at[:, i].set(jnp.where(take, t, 0))
        # the only token of an accepting state is EOS and loops: the run ends with it
        going = take & (nxt != s)
        return jnp.where(take, nxt, s), going, toks, count + take.astype(jnp.int32)

    _, _, toks, count = jax.lax.fori_loop(
        0, length, body, (states, ~stop, jnp.zeros((B, length), jnp.int32),
                          jnp.zeros((B,), jnp.int32)))
    return toks, count
