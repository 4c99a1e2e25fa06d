"""Structured output for the engine's requests: a request's response_format compiled once, at
validation (`constrain.table_for`, cached by format and tokenizer), into the table its slot's
region will hold; every refusal a FieldError naming the field (the server's 400)."""

from __future__ import annotations

import dataclasses

from ..constrain import ConstraintError, table_for
from ..constrain.formats import is_constrained
from ..request import FieldError, ValidRequest


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
