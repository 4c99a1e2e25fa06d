"""Structured output: a regex, a JSON schema or "any JSON object" compiled into a token-level
automaton, kept on the device as a dense table and applied inside the decode loop.

Modules, one job each:
- `formats.py`: the OpenAI-style `response_format` -> a regular expression (validated, errors
  naming the field);
- `vocabulary.py`: a tokenizer -> every token's bytes (byte-level BPE and SentencePiece spelled
  as the text they decode to), the vocabulary outlines-core indexes;
- `table.py`: the automaton (outlines-core's `Index`) -> `TokenTable`, the dense
  `next_state[S, C]` over token classes plus `class_of[V]`, bounded in bytes, cached by
  (format, tokenizer, EOS ids);
- `device.py`: the batch's tables stacked into `RowConstraints` (a jit argument) and the pure
  device functions the loop calls: the allowed-token mask of a state, states along a tree of
  proposed tokens, the advance over emitted tokens, the run of tokens a state forces;
- `peer.py`: the same table as a transformers `LogitsProcessor` (host state per row), the
  bench's peer row.

outlines-core is an optional dependency (`pip install "ouroboros-jax[structured]"`): the library
imports without it; only building a table needs it.

Letters (package glossary): B rows, T tree nodes, V vocabulary, S automaton states (all the
batch's automata stacked), C token classes, K automata in the batch (0 = "accept everything").
"""

from .device import (RowConstraints, advance, allowed_mask, mask_logits, stack_tables,
                     tree_states)
from .formats import ConstraintError, regex_for
from .table import MAX_TABLE_BYTES, TokenTable, build_table, table_for

__all__ = ["ConstraintError", "MAX_TABLE_BYTES", "RowConstraints", "TokenTable", "advance",
           "allowed_mask", "build_table", "mask_logits", "regex_for", "stack_tables",
           "table_for", "tree_states"]
