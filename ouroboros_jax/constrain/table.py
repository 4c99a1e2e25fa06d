"""The automaton as a dense table over token classes, built once per (format, tokenizer, EOS
ids) and cached.

outlines-core's `Index` gives the token-level automaton as `{state: {token: next state}}`. Most
tokens behave alike (every letter inside a JSON string, every token no state allows), so tokens
with identical columns share a class: `next_state[S, C]` int32 (-1: the token leaves the
language) and `class_of[V]`. State 0 is the start. A token of an EOS id is allowed exactly in
accepting states (and leads back to the same state; the row stops there anyway).

`n_allowed[S]` counts the tokens each state allows: where it is 1 the token is forced
(`forced_token[S]`, -1 elsewhere).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional, Sequence

import numpy as np

from .formats import INSTALL, ConstraintError, canonical, regex_for
from .vocabulary import vocabulary_map

# The default bound on one table (next_state + class_of): a format whose table is larger is
# refused with a ConstraintError (the server's 400) rather than filling device memory.
MAX_TABLE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTable:
    """One format's automaton over one tokenizer's vocabulary (host numpy).

    Attributes:
        next_state: int32[S, C], the state after a token of class c in state s; -1: refused.
        class_of: int32[V], each token id's class.
        n_allowed: int32[S], tokens each state allows (EOS ids included in accepting states).
        forced_token: int32[S], the one token a state allows, -1 where it allows several.
        accepting: bool[S], states where the output may end.
        regex: the regular expression it was built from.
        build_seconds: seconds the build took (index and table).
    """

    next_state: np.ndarray
    class_of: np.ndarray
    n_allowed: np.ndarray
    forced_token: np.ndarray
    accepting: np.ndarray
    regex: str
    build_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return int(self.next_state.nbytes + self.class_of.nbytes)


def table_bytes(states: int, classes: int, vocab: int) -> int:
    """Bytes of a table of S = states, C = classes over V = vocab (int32)."""
    return 4 * (states * classes + vocab)


def from_transitions(transitions: dict, start: int, finals: Sequence[int],
                     eos_ids: Sequence[int], vocab_size: int, regex: str = "",
                     max_bytes: int = MAX_TABLE_BYTES, field: str = "response_format"
                     ) -> TokenTable:
    """{state: {token: next}} (outlines-core's `Index.get_transitions()`, or a hand-written
    automaton), its start state and accepting states -> TokenTable, states renumbered with the
    start at 0. eos_ids: every id that ends generation; allowed in accepting states only.
    Raises ConstraintError (naming `field`) when the table would exceed max_bytes."""
    order = [start] + sorted(s for s in set(transitions) | set(finals) if s != start)
    seen = set(order)
    for d in transitions.values():
        for n in set(d.values()) - seen:
            order.append(n)
            seen.add(n)
    lut = np.full((max(order) + 1,), -1, np.int64)
    lut[np.asarray(order, np.int64)] = np.arange(len(order))
    S, V = len(order), vocab_size
    eos = np.asarray([int(e) for e in eos_ids if 0 <= int(e) < V], np.int64)
    accepting = np.zeros((S,), bool)
    accepting[lut[np.asarray(list(finals), np.int64)]] = True
    cols = []  # per state: (token ids, next states) with EOS in accepting states
    for s in order:
        d = transitions.get(s, {})
        toks = np.fromiter(d.keys(), np.int64, len(d))
        nxt = lut[np.fromiter(d.values(), np.int64, len(d))]
        keep = ~np.isin(toks, eos)
        toks, nxt = toks[keep], nxt[keep]
        if accepting[lut[s]] and len(eos):
            toks = np.concatenate([toks, eos])
            nxt = np.concatenate([nxt, np.full((len(eos),), lut[s], np.int64)])
        cols.append((toks, nxt))
    # refine classes state by state: two tokens share a class iff every state treats them alike
    cls = np.zeros((V,), np.int64)
    for toks, nxt in cols:
        col = np.full((V,), -1, np.int64)
        col[toks] = nxt
        _, cls = np.unique(cls * (S + 1) + (col + 1), return_inverse=True)
        cls = cls.reshape(-1)
    C = int(cls.max()) + 1
    if table_bytes(S, C, V) > max_bytes:
        raise ConstraintError(field, f"the automaton needs a table of {S} states x {C} token "
                                     f"classes ({table_bytes(S, C, V) / 2**20:.1f} MiB), over the "
                                     f"bound of {max_bytes / 2**20:.1f} MiB: simplify it")
    rep = np.zeros((C,), np.int64)
    rep[cls] = np.arange(V)  # any token of each class stands for it
    size = np.bincount(cls, minlength=C)
    table = np.full((S, C), -1, np.int32)
    n_allowed = np.zeros((S,), np.int32)
    forced = np.full((S,), -1, np.int32)
    for s, (toks, nxt) in enumerate(cols):
        col = np.full((V,), -1, np.int64)
        col[toks] = nxt
        table[s] = col[rep]
        n_allowed[s] = int(np.sum(size[table[s] >= 0]))
        if n_allowed[s] == 1:
            forced[s] = int(toks[0])
    return TokenTable(next_state=table, class_of=cls.astype(np.int32), n_allowed=n_allowed,
                      forced_token=forced, accepting=accepting, regex=regex)


def build_table(regex: str, tokenizer, vocab_size: int, eos_ids: Sequence[int],
                max_bytes: int = MAX_TABLE_BYTES, field: str = "response_format") -> TokenTable:
    """A regex over the output text -> its TokenTable over the tokenizer's vocabulary
    (outlines-core builds the token-level automaton; `from_transitions` the table)."""
    import time

    try:
        from outlines_core import Index, Vocabulary
    except ImportError:
        raise ConstraintError(field, f"structured output needs outlines-core: {INSTALL}") \
            from None
    eos = [int(e) for e in eos_ids if 0 <= int(e) < vocab_size]
    if not eos:
        raise ConstraintError(field, "needs an EOS id (eos_token_id) so generation can stop "
                                     "where the format ends")
    t0 = time.perf_counter()
    vocab_map = {b: ids for b, ids in _vocabulary(tokenizer, vocab_size).items()}
    for e in eos:  # EOS is not text: outlines-core takes one EOS id apart from the map
        for b in [b for b, ids in vocab_map.items() if e in ids]:
            vocab_map[b] = [i for i in vocab_map[b] if i != e]
            if not vocab_map[b]:
                del vocab_map[b]
    try:
        index = Index(regex, Vocabulary(eos[0], vocab_map))
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConstraintError(field, f"cannot be compiled into a token automaton ({e})") \
            from None
    table = from_transitions(index.get_transitions(), index.get_initial_state(),
                             sorted(index.get_final_states()), eos, vocab_size, regex,
                             max_bytes, field)
    return dataclasses.replace(table, build_seconds=time.perf_counter() - t0)


# tokenizer -> {vocab size: map} and tokenizer -> {(format, eos, bound): TokenTable}: keyed by
# the tokenizer object itself (weakly), so a table is never shared across vocabularies
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer, vocab_size: int) -> dict:
    per = _VOCABS.setdefault(tokenizer, {})
    if vocab_size not in per:
        per[vocab_size] = vocabulary_map(tokenizer, vocab_size)
    return per[vocab_size]


def table_for(response_format, tokenizer, vocab_size: int, eos_ids: Sequence[int],
              max_bytes: int = MAX_TABLE_BYTES, field: str = "response_format"
              ) -> Optional[TokenTable]:
    """response_format -> its TokenTable for this tokenizer (None: no constraint), built once
    and cached by (format, tokenizer, vocab size, EOS ids, bound). Raises ConstraintError."""
    regex = regex_for(response_format, field)
    if regex is None:
        return None
    if tokenizer is None:
        raise ConstraintError(field, "needs the model's tokenizer (the model was loaded without "
                                     "one)")
    key = (canonical(response_format), vocab_size, tuple(sorted(set(map(int, eos_ids)))),
           max_bytes)
    per = _TABLES.setdefault(tokenizer, {})
    if key not in per:
        per[key] = build_table(regex, tokenizer, vocab_size, eos_ids, max_bytes, field)
    return per[key]
