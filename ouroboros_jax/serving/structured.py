"""Structured output for the engine's requests: a request's response_format compiled once, at
validation (`constrain.table_for`, cached by format and tokenizer), into the table its slot's
region will hold; every refusal a FieldError naming the field (the server's 400).

Every slot owns a region of `states` automaton states over `classes` token classes in one
table (`constrain.RowConstraints`: automaton k = slot + 1, automaton 0 "accept everything"), in
the engine's `Limits`. A constrained request's table is written into its slot's region
(`device_constrain`) just before its insert, which points the slot at it (or, for a request
without one, at automaton 0). Steps apply the automata only while a busy slot has one
(`executor.device_step`'s `constrained`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..constrain import ConstraintError, table_for
from ..constrain.device import RowConstraints
from ..constrain.formats import is_constrained
from ..request import FieldError, ValidRequest
from .executor import DeviceState, pack_insert, pinned
from .lockstep import Op
from .packed_state import Packed, pack, unpack


def insert_ops(slot: int, req: ValidRequest, region: tuple) -> list:
    """The device calls that start req in slot: its automaton into the slot's region of the
    table first when it has one, then the insert (which points the slot at it, or at the
    unconstrained automaton 0)."""
    ops = [] if req.table is None else [Op("constraint", packed=pack_constraint(
        slot, req.table, *region))]
    return ops + [Op("insert", packed=pack_insert(slot, req))]


def with_table(req: ValidRequest, tokenizer, vocab: int, region: tuple) -> ValidRequest:
    """req with its response_format's TokenTable (req as is without one). region (states,
    classes): what one slot's part of the engine's table holds."""
    fmt = req.params.response_format
    if not is_constrained(fmt):
        return req
    states, classes = region
    if states <= 0 or classes <= 0:
        raise FieldError("response_format", "response_format: this engine was built without "
                                            "structured output (constraint_states=0)")
    try:
        table = table_for(fmt, tokenizer, vocab, [int(e) for e in req.eos if e >= 0],
                          field="response_format")
    except ConstraintError as e:
        raise FieldError(e.field, str(e)) from None
    S, C = table.next_state.shape
    if S > states or C > classes:
        raise FieldError("response_format", f"response_format: its automaton needs {S} states "
                                            f"x {C} token classes, over this engine's bound of "
                                            f"{states} x {classes} per request; simplify it")
    return dataclasses.replace(req, table=table)


def blank_constraint(B: int, vocab: int, states: int, classes: int) -> RowConstraints:
    """B slots' automata before any request: every slot unconstrained, each with a region of
    `states` states over `classes` token classes (the bound a request's table must fit)."""
    S = 1 + B * states
    return RowConstraints(
        next_state=jnp.full((S, classes), -1, jnp.int32).at[0, 0].set(0),
        class_of=jnp.zeros((B + 1, vocab), jnp.int32),
        base=jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              1 + jnp.arange(B, dtype=jnp.int32) * states]),
        n_allowed=jnp.zeros((S,), jnp.int32).at[0].set(vocab),
        automaton=jnp.zeros((B,), jnp.int32))


def constraint_region(dev: DeviceState) -> tuple[int, int]:
    """(states, classes) of one slot's region in dev's table."""
    rc = dev.limits.constraint
    B = rc.automaton.shape[0]
    return (rc.next_state.shape[0] - 1) // B, rc.next_state.shape[1]


def pack_constraint(slot: int, table, states: int, classes: int) -> np.ndarray:
    """A request's TokenTable for slot's region -> int32[1 + states*classes + V + states]:
    slot, next_state padded to the region, class_of, n_allowed (one upload)."""
    S, C = table.next_state.shape
    rows = np.full((states, classes), -1, np.int32)
    rows[:S, :C] = table.next_state
    n_allowed = np.zeros((states,), np.int32)
    n_allowed[:S] = table.n_allowed
    return np.concatenate([[slot], rows.ravel(), table.class_of, n_allowed]).astype(np.int32)


@partial(jax.jit, donate_argnums=(1,))
def device_constrain(pair, dev: DeviceState, packed) -> DeviceState:
    """A request's table (`pack_constraint`) into its slot's region; the slot's automaton set
    to it by the insert that follows. dev may be `packed_state.Packed`."""
    held = dev
    dev = unpack(dev) if isinstance(dev, Packed) else dev
    rc = dev.limits.constraint
    states, classes = constraint_region(dev)
    V = rc.class_of.shape[1]
    slot = packed[0]
    rows = packed[1:1 + states * classes].reshape(states, classes)
    cls = packed[1 + states * classes:1 + states * classes + V]
    n_allowed = packed[1 + states * classes + V:]
    at = 1 + slot * states
    rc = rc.replace(next_state=jax.lax.dynamic_update_slice(rc.next_state, rows, (at, 0)),
                    class_of=rc.class_of.at[slot + 1].set(cls),
                    n_allowed=jax.lax.dynamic_update_slice(rc.n_allowed, n_allowed, (at,)))
    dev = pinned(pair, dev.replace(limits=dev.limits.replace(constraint=rc)))
    return pack(dev, held.layout) if isinstance(held, Packed) else dev


def blank_limits(limits, B: int, vocab: int, region: tuple):
    """The engine's blank Limits with every slot unconstrained over regions of (states,
    classes) (as they are when either is 0: structured output off)."""
    if min(region) <= 0:
        return limits
    return limits.replace(constraint=blank_constraint(B, vocab, *region))


def constrain(executor, data: np.ndarray) -> None:
    """The engine's "constraint" op: a request's table into its slot's region."""
    executor.held = device_constrain(executor.pair, executor.held, jnp.asarray(data))
