"""The constraint's hooks in the shared verify machinery: every method calls these at the same
three places, so constrained decoding is one rule, not one per method.

1. Before the target's forward, `tree_states` gives the automaton state at every node of the
   proposed tree (draft chain, Jacobi/pool phrases, branches, copies) and `cut` drops the nodes
   whose path leaves the language: they can never be accepted, so they cost no verify width.
2. After it, `masked` sets the target's logits of refused tokens to -inf at every verified node
   (the bonus/correction position included), by the state there. The accept walk then follows
   the target's constrained choice at each node: greedy tokens are constrained vanilla's, and a
   draw is from the constrained (renormalised) distribution with the same (row, position) key,
   so sampling stays lossless with respect to it.
3. `emit` advances each row's state along the tokens it kept (`advance_rows`): rollback is free,
   the state at the accepted length is where the walk stopped.

Without a constraint (`Limits.constraint` None, static) every hook is the identity and the
loop is the one without them.

Letters (package glossary): B rows, T tree nodes, V vocab, A tokens offered to emit.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..constrain import device as cdev


def with_buffers(seq, rc):
    """seq with zeroed automaton buffers (fsm int32[B], forced int32[B,2]) when rc (a
    `constrain.RowConstraints`) is given, as is otherwise."""
    if rc is None:
        return seq
    return zero_buffers(seq, seq.tokens.shape[0])


def zero_buffers(seq, rows: int):
    """seq with zeroed automaton buffers over `rows` rows: fsm int32[R] (every automaton at
    its start) and forced int32[R,2] (column 0: emitted tokens their state allowed alone;
    column 1: forced tokens proposed as free drafts, no draft forward)."""
    return seq.replace(fsm=jnp.zeros((rows,), jnp.int32), forced=jnp.zeros((rows, 2), jnp.int32))


def buffers_like(seq, fresh):
    """fresh Sequences [R] with zeroed automaton buffers when seq has them (rows restarting:
    every automaton starts at its local state 0)."""
    if seq.fsm is None:
        return fresh
    return zero_buffers(fresh, fresh.tokens.shape[0])


def root_states(limits, seq) -> Optional[jax.Array]:
    """int32[B,1]: each row's state at its pending token (None without a constraint)."""
    if limits.constraint is None:
        return None
    return seq.fsm[:, None]


def tree_states(limits, seq, parents: np.ndarray, tokens: jax.Array) -> Optional[jax.Array]:
    """parents int[T] (static), tokens int32[B,T] (node 0 the pending token) -> int32[B,T]:
    the state at each node (-1: its path leaves the language); None without a constraint."""
    if limits.constraint is None:
        return None
    return cdev.tree_states(limits.constraint, seq.fsm, parents, tokens)


def cut(states: Optional[jax.Array], valid: jax.Array) -> jax.Array:
    """valid bool[B,T] without the nodes whose path leaves the language."""
    return valid if states is None else valid & (states >= 0)


def masked(limits, states: Optional[jax.Array], logits: jax.Array) -> jax.Array:
    """logits [B,T,V] with each node's refused tokens at -inf (states int32[B,T])."""
    if states is None:
        return logits
    return cdev.mask_logits(limits.constraint, states, logits)


def advance_rows(rc, seq, new: jax.Array, kept: jax.Array):
    """seq with each row's state advanced along new[b, :kept[b]] (new int32[B,A]) and its
    forced-token count added to; as is without a constraint."""
    if rc is None:
        return seq
    fsm, forced = cdev.advance(rc, seq.fsm, new, kept)
    return seq.replace(fsm=fsm, forced=seq.forced.at[:, 0].add(forced))


def tree_mask_fn(limits, seq):
    """A `jacobi_step` hook (None without a constraint): (tokens int32[B,Q], parents int[Q],
    logits [B,Q,V]) -> logits masked by the state at each node. Nodes whose path leaves the
    language keep their logits: the walk never reaches them, since their parent's choice is
    masked to the language."""
    if limits.constraint is None:
        return None

    def constrain(tokens, parents, logits):
        return masked(limits, tree_states(limits, seq, parents, tokens), logits)

    return constrain


class DraftGuard(NamedTuple):
    """What a draft model's own loop needs to draft inside the rows' constraints.

    root: int32[B], each row's state at its pending token; mask(logits [B,1,V], state [B]) ->
    logits with refused tokens at -inf; advance(state [B], token [B]) -> the state after it;
    tree(root [B], tokens int32[B,Q], parents int[Q], logits [B,Q,V]) -> logits masked by the
    state at each node of a tree hanging off a root in state root (a `jacobi_step` hook once
    bound to the root); follow(state [B], tokens int32[B,A], count [B]) -> the state after
    tokens[b, :count[b]].
    """

    root: jax.Array
    mask: object
    advance: object
    tree: object
    follow: object


def draft_guard(limits, seq) -> Optional[DraftGuard]:
    """The rows' constraints for a draft loop (None without a constraint)."""
    rc = limits.constraint
    if rc is None:
        return None

    def tree(root, tokens, parents, logits):
        return cdev.mask_logits(rc, cdev.tree_states(rc, root, parents, tokens), logits)

    return DraftGuard(root=seq.fsm,
                      mask=lambda logits, state: cdev.mask_logits(rc, state[:, None], logits),
                      advance=lambda state, tok: cdev.step(rc, state, tok),
                      tree=tree,
                      follow=lambda state, tokens, count: cdev.advance(rc, state, tokens,
                                                                       count)[0])


class ForcedRun(NamedTuple):
    """Each row's run of tokens the automaton forces from its state (`forced_run`): certain,
    so they are proposed with no draft forward. tokens int32[B,γ] (0 past count), count
    int32[B] (0: the row's state allows several tokens, or the row does not propose)."""

    tokens: jax.Array
    count: jax.Array


def forced_run(limits, seq, gamma: int, live: jax.Array) -> Optional[ForcedRun]:
    """Each live row's forced run from its state, up to gamma (static) tokens; rows that may
    not speculate (`Limits.speculate`) offer none. None without a constraint."""
    rc = limits.constraint
    if rc is None:
        return None
    stop = ~live if limits.speculate is None else ~(live & limits.speculate)
    tokens, count = cdev.forced_run(rc, seq.fsm, gamma, stop)
    return ForcedRun(tokens, count)


def take_forced(prop, free: jax.Array, run: ForcedRun):
    """A free-drafts choice (prop a `free_drafts.FreeDraft`, or None: free drafts off; free
    bool[B]) with every row that has a forced run taking it instead -> (the proposal, its
    .tokens and .count read; free bool[B]). A forced run goes first: its tokens are certain,
    so the round keeps all of them plus the target's own next token with no draft forward."""
    forced = run.count > 0
    if prop is None:
        return run, free | forced
    return prop.replace(tokens=jnp.where(forced[:, None], run.tokens, prop.tokens),
                        count=jnp.where(forced, run.count, prop.count)), free | forced


def count_proposed(seq, run: Optional[ForcedRun], taken: jax.Array):
    """seq with the forced tokens rows proposed this round (taken bool[B]: the rows whose
    chain was their forced run) added to its count (`Sequences.forced[:, 1]`)."""
    if run is None:
        return seq
    return seq.replace(forced=seq.forced.at[:, 1].add(jnp.where(taken, run.count, 0)))
