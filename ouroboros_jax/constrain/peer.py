"""The peer row: transformers' `generate` constrained by the same table, on the host.

`TableLogitsProcessor` is a transformers `LogitsProcessor` built on a `TokenTable`: each row
keeps its automaton state on the host, advanced by the token the previous step appended, and
every refused token's score is set to -inf. It is what peers do (a host-side matcher per
row), over the very automaton this package keeps on the device, so the bench compares the
loops and not two compilers. Greedy `generate(..., logits_processor=[...])` with it gives the
tokens of this package's constrained vanilla (tests/test_structured.py).

torch is imported lazily: the package does not depend on it.
"""

from __future__ import annotations

import numpy as np

from .table import TokenTable


class TableLogitsProcessor:
    """A transformers LogitsProcessor masking by a TokenTable (one table for every row).

    prompt_length: the tokens before the output (the state starts at the table's start
    there). Call protocol: (input_ids LongTensor[B, L], scores FloatTensor[B, V]) -> scores.
    """

    def __init__(self, table: TokenTable, prompt_length: int):
        self.table = table
        self.prompt_length = int(prompt_length)
        self.states = None  # np.int64[B], each row's state after its generated tokens
        self.seen = 0  # generated tokens already folded into states

    def _advance(self, input_ids) -> None:
        ids = input_ids[:, self.prompt_length:].cpu().numpy()
        B = ids.shape[0]
        if self.states is None:
            self.states = np.zeros((B,), np.int64)
        t = self.table
        for j in range(self.seen, ids.shape[1]):
            tok = ids[:, j]
            live = self.states >= 0
            nxt = t.next_state[np.maximum(self.states, 0), t.class_of[tok]]
            self.states = np.where(live, nxt, -1)
        self.seen = ids.shape[1]

    def allowed(self) -> np.ndarray:
        """bool[B, V]: the tokens each row's state allows (every one where refused)."""
        t = self.table
        rows = t.next_state[np.maximum(self.states, 0)][:, t.class_of] >= 0
        return rows | (self.states < 0)[:, None]

    def __call__(self, input_ids, scores):
        import torch

        self._advance(input_ids)
        ok = torch.from_numpy(self.allowed()[:, :scores.shape[-1]]).to(scores.device)
        if ok.shape[-1] < scores.shape[-1]:  # padded vocabulary rows: never allowed
            pad = torch.zeros((ok.shape[0], scores.shape[-1] - ok.shape[-1]), dtype=torch.bool)
            ok = torch.cat([ok, pad], -1)
        return scores.masked_fill(~ok, float("-inf"))
