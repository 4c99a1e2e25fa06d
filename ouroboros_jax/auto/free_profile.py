"""What Ouroboros' free drafts would have kept, learned from any greedy call's output (issue 52).

In greedy decoding the tokens a call emits are the target's own, whatever method ran, so the
continuation a free proposal would have been checked against is known once the call returns:
at a round that starts with the row's first L tokens (prompt + output so far), the context's
free proposal (`decoding.free_drafts.context_match`: prompt lookup's ranking, matches of at
most M tokens, up to γ tokens) keeps its common prefix with tokens L, L+1, ... . `replay_row`
walks a row's output round by round on the host (numpy) and counts, by match length r, the
rounds and the tokens their proposals kept: the `free_offered` / `free_would_accept` counters
a free-drafts call counts on device, so `Agreement.record_free` pools both alike, and auto
prices free drafts (`cost.free_round_model`) from the pair's first call of any method instead
of waiting for a free-drafts call it would never choose without a profile.

What the replay cannot see, and why its profile is a lower bound of the free material:
 - the pool (its phrases depend on the draft's trajectories): a free-drafts call's own
   counters include it, and such a call is not replayed (its counters are exact);
 - round boundaries: a round after a proposal that kept k tokens starts k + 1 tokens on (a
   free round's emission); after one that kept none, `step` tokens on (the call's own tokens
   per round, what a drafted round emitted). Denser sampling of the stretches without a
   proposal only lowers the free share.
Sampling: the tokens are a sample, not the target's greedy continuation; not replayed.

Cost: one pass over the row per replayed round, O(L * M) numpy, at most MAX_ROUNDS rounds of
at most MAX_ROWS rows per call (under a millisecond per round at L = 2048).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..decoding.ouroboros_config import FREE_THRESHOLDS
from ..distributed import is_leader
from .agreement import Agreement

# The proposals replayed: matches of up to 6 tokens (the free variants' ngram 7, M = 6) and
# up to 12 tokens (Ouroboros' largest auto gamma): `cost.free_mix` caps the kept tokens at a
# config's own gamma.
REPLAY_MATCH = max(FREE_THRESHOLDS)
REPLAY_GAMMA = 12
MAX_ROUNDS = 256  # replayed rounds per row
MAX_ROWS = 8  # replayed rows per call


def context_proposal(tokens: np.ndarray, length: int, gamma: int, max_match: int
                     ) -> tuple[np.ndarray, int]:
    """The context's free proposal for a row whose first `length` tokens are real (the last
    one pending), as `free_drafts.context_match` ranks it on device: the longest match of the
    row's last tokens (at most max_match) ending before the last token, then the most
    continuation tokens inside the row (at most gamma), then the most recent.
    tokens int[S] -> (proposal int[<= gamma], match length r; 0 and r = 0: none)."""
    L = int(length)
    if L < 2:
        return tokens[:0], 0
    t = np.asarray(tokens[:L])
    j = np.arange(L - 1)
    run = np.zeros(L - 1, np.int64)
    alive = np.ones(L - 1, bool)
    for i in range(min(max_match, L)):
        alive &= (j - i >= 0) & (t[np.clip(j - i, 0, None)] == t[L - 1 - i])
        run += alive
    if not run.any():
        return t[:0], 0
    inside = np.clip(L - 1 - j, 0, gamma)
    best = int(np.argmax(np.where(run > 0, (run * (gamma + 1) + inside) * L + j, -1)))
    return t[best + 1:best + 1 + inside[best]], int(run[best])


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def replay_row(tokens: np.ndarray, prompt_len: int, length: int, step: int,
               gamma: int = REPLAY_GAMMA, max_match: int = REPLAY_MATCH,
               max_rounds: int = MAX_ROUNDS) -> tuple[np.ndarray, np.ndarray]:
    """One row's rounds by match length (see the module docstring): tokens int[S] (the first
    `length` real: prompt_len prompt tokens, then the output) -> (offered int[M+1], kept
    int[M+1]): rounds whose context proposal matched r tokens, and the tokens those proposals
    kept. The first round holds the prompt and the prefill's token."""
    offered = np.zeros(max_match + 1, np.int64)
    kept = np.zeros(max_match + 1, np.int64)
    L, rounds = int(prompt_len) + 1, 0
    while L < length and rounds < max_rounds:
        prop, r = context_proposal(tokens, L, gamma, max_match)
        k = common_prefix(prop, np.asarray(tokens[L:length]))
        offered[r] += 1
        kept[r] += k
        L += k + 1 if k else max(1, step)
        rounds += 1
    return offered, kept


def replay_call(tokens: np.ndarray, prompt_lens: np.ndarray, lengths: np.ndarray, step: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """`replay_row` over a call's rows (at most MAX_ROWS), summed: tokens int[B,S],
    prompt_lens int[B], lengths int[B] (prompt + output) -> (offered, kept) int[M+1]."""
    offered = np.zeros(REPLAY_MATCH + 1, np.int64)
    kept = np.zeros(REPLAY_MATCH + 1, np.int64)
    for b in range(min(len(lengths), MAX_ROWS)):
        o, k = replay_row(tokens[b], int(prompt_lens[b]), int(lengths[b]), step)
        offered += o
        kept += k
    return offered, kept


def learn_free_profile(agreement: Agreement, target, draft, seq, prompt_lens, stats: dict,
                       greedy: bool) -> Optional[tuple]:
    """After a call on a pair (draft not None), in process 0 (which keeps the shared store):
    pools the replayed profile of its output (seq: the call's `Sequences`, fetched; tokens
    int[B,S], lengths int[B]; prompt_lens int[B]) into the store's "free" section
    (`Agreement.record_free`), unless the call was sampled (not the target's greedy
    continuation) or counted its free proposals on device itself (a free-drafts call: those
    counters are exact and already recorded). -> (offered, kept), or None where nothing was
    recorded."""
    if not greedy or draft is None or "free_offered" in stats or not is_leader():
        return None
    step = int(round(stats.get("eta") or 1.0))
    offered, kept = replay_call(np.asarray(seq.tokens), np.asarray(prompt_lens),
                                np.asarray(seq.lengths), step)
    if offered.sum() == 0:
        return None
    agreement.record_free(target, draft, offered.tolist(), kept.tolist())
    return offered, kept
