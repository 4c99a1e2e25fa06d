"""A call's response_format(s) -> the `RowConstraints` its loop carries (host side, once per
call or request)."""

from __future__ import annotations

from typing import Optional, Sequence

from .device import RowConstraints, stack_tables
from .formats import is_constrained
from .table import MAX_TABLE_BYTES, TokenTable, table_for


def per_row_formats(response_format, rows: int, field: str = "response_format") -> list:
    """One format for every row, or a list of `rows` formats (None: that row unconstrained)."""
    if isinstance(response_format, (list, tuple)):
        if len(response_format) != rows:
            raise ValueError(f"{field} given as a list must hold one format per prompt "
                             f"({rows}), got {len(response_format)}")
        return list(response_format)
    return [response_format] * rows


def row_tables(response_format, rows: int, tokenizer, vocab_size: int,
               eos_ids: Sequence[int], max_bytes: int = MAX_TABLE_BYTES,
               field: str = "response_format") -> list[Optional[TokenTable]]:
    """Each row's TokenTable (None: unconstrained), built once per distinct format (cached)."""
    formats = per_row_formats(response_format, rows, field)
    return [table_for(f, tokenizer, vocab_size, eos_ids, max_bytes,
                      field if not isinstance(response_format, (list, tuple)) else f"{field}[{i}]")
            for i, f in enumerate(formats)]


def any_constrained(response_format) -> bool:
    formats = response_format if isinstance(response_format, (list, tuple)) else [response_format]
    return any(is_constrained(f) for f in formats)


def row_constraints(response_format, rows: int, tokenizer, vocab_size: int,
                    eos_ids: Sequence[int], max_bytes: int = MAX_TABLE_BYTES,
                    field: str = "response_format"
                    ) -> tuple[Optional[RowConstraints], list[Optional[TokenTable]]]:
    """(the loop's RowConstraints, or None when no row is constrained; each row's table)."""
    if not any_constrained(response_format):
        return None, [None] * rows
    tables = row_tables(response_format, rows, tokenizer, vocab_size, eos_ids, max_bytes, field)
    return stack_tables(tables, vocab_size), tables


def constraint_stats(seq, tables: list[Optional[TokenTable]]) -> dict:
    """A constrained call's measures: forced_tokens (generated tokens that were the only one
    their state allowed, all rows; per row), forced_tokens_proposed (those proposed as free
    drafts with no draft forward, by the methods that do: Ouroboros), and the largest
    table's bytes and build seconds (the first build's: a cached table keeps its figure)."""
    import numpy as np

    built = [t for t in tables if t is not None]
    if not built or seq.forced is None:
        return {}
    forced = np.asarray(seq.forced).reshape(len(tables), -1)
    return {"forced_tokens": int(forced[:, 0].sum()),
            "forced_tokens_per_row": [int(x) for x in forced[:, 0]],
            "forced_tokens_proposed": int(forced[:, 1:].sum()),
            "constraint_table_bytes": max([t.nbytes for t in built], default=0),
            "constraint_build_seconds": max([t.build_seconds for t in built], default=0.0)}
