"""Ouroboros' config and the carry of its loop (`decoding/ouroboros.py` runs them): the knobs and
switches with their meaning and checks, the method's own counters, and the while_loop state.
Letters as in the package glossary."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
from flax import struct

from ..bounds import INT32_MAX, MAX_TREE_TOKENS, check_tree_tokens
from ..models.kv_cache import KVCache
from ..pool import PhrasePool
from .common import Sequences, Stats, check_bool, check_fraction, check_int, counters_dict
from .jacobi import JacobiWindow
from .knobs import (CONTEXT_PHRASES, GAMMA, GUESSES, NGRAM, SUFFIXES, WINDOW, KnobSpace,
                    Switch, Variant)


# the free thresholds config="auto" prices over the SD step (matches of 2 to 6 tokens; 1, any
# continuation of the pending token alone, is rarely right on code)
FREE_THRESHOLDS = (6, 4, 3, 2)  # longest first: of equally priced ones auto takes it


@dataclasses.dataclass(frozen=True)
class OuroborosConfig:
    """gamma γ (draft tokens per round), window W, ngram N (phrases have N-1 tokens), guesses G
    (pool phrases per key, verified by the draft per step), suffixes X (<= G, branches per
    round), pool_rows R (None: min(V, 65536)), and the ablation switches: the paper's four
    mechanisms (phrase_drafting, lengthening, recycling, history) and context_phrases (each
    prompt's n-grams enter the pool when its row starts, so drafting and lengthening can copy
    from the prompt).

    Defaults are the paper's code recipe (gamma 10-12 -> 12, W 20, N 7, X 3) with G = W as in
    the reference. On a 2-core CPU smaller trees (e.g. W 8, N 5, G 8) may run faster.

    confidence: adaptive drafting. A row stops drafting after a draft token whose probability
    under the draft's softmax is below `confidence` (the rest of that forward's phrase is
    dropped); the round's draft forwards end when every row has stopped or holds gamma tokens.
    The target still scores the fixed tree; a row's undrafted chain slots are masked out, and
    its pool branches too (they hang after d_gamma). 0 (default) drafts gamma tokens. The rule
    looks only at the draft's own (greedy) choices, fixed before verification, so greedy output
    stays vanilla's and sampling stays lossless.

    free_drafts: a row whose context (prompt + output so far) or pool already continues its
    last tokens takes the round's chain from there, with no draft forward
    (`decoding/free_drafts.py`): its best free proposal (up to gamma tokens) is verified where
    the draft's chain would be, lengthening and recycling as usual. Rows without one draft as
    before; when no row drafts, the round runs no draft forward at all (a `lax.cond`). The
    draft catches up on the tokens free rounds committed at its next drafting round. Off by
    default; `config="auto"` turns it on (with a threshold) where the pair's measured free
    proposals (`free_offered`, `free_would_accept`: what each match length kept; replayed on
    the host from any greedy call's output, `auto/free_profile.py`) price it faster than
    drafting (`cost.free_round_model`).
    free_threshold: the match length a free proposal needs (how many of the row's last tokens,
    the pending one included, the tokens before it repeat; a pool phrase's key counts as
    one), in [1, ngram - 1]. 1 takes any continuation the context or the pool holds for the
    pending token; ngram - 1 only the longest matches.
    """

    gamma: int = 12
    window: int = 20
    ngram: int = 7
    guesses: int = 20
    suffixes: int = 3
    pool_rows: Optional[int] = None
    phrase_drafting: bool = True
    lengthening: bool = True
    recycling: bool = True
    history: bool = True
    context_phrases: bool = True
    confidence: float = 0.0
    free_drafts: bool = False
    free_threshold: int = 2

    KNOBS: ClassVar[KnobSpace] = KnobSpace(
        knobs=(GAMMA, WINDOW, NGRAM, GUESSES, SUFFIXES),
        switches=(Switch("phrase_drafting", "phrase drafting"), Switch("lengthening", "lengthening"),
                  Switch("recycling", "recycling"), Switch("history", "history"),
                  CONTEXT_PHRASES),
        # where wide forwards cost more than they bring (a CPU), auto may drop mechanisms:
        # token-by-token drafting (the window is idle), no lengthening (suffixes idle), or
        # neither and no pool at all, which is speculative decoding
        variants=(Variant({"phrase_drafting": False}, pinned={"window": 3}),
                  Variant({"lengthening": False}, pinned={"suffixes": 1}),
                  # history stays on: a pool the caller passes goes through untouched
                  Variant(dict(phrase_drafting=False, lengthening=False, recycling=False,
                               context_phrases=False),
                          pinned={"window": 2, "suffixes": 1}))
        # free drafts over the SD step and over every mechanism, at matches of up to 6
        # tokens (ngram 7), priced from the pair's measured free proposals (`cost.FreeProfile`)
        + tuple(Variant(dict(phrase_drafting=False, lengthening=False, recycling=False,
                             context_phrases=False, free_drafts=True, free_threshold=t),
                        pinned={"window": 2, "suffixes": 1, "ngram": 7})
                for t in FREE_THRESHOLDS)
        + tuple(Variant(dict(free_drafts=True, free_threshold=t), pinned={"ngram": 7})
                for t in (3, 6)),
        extras=("free_drafts", "free_threshold"))

    def __post_init__(self):
        check_int(self, "gamma", 1, MAX_TREE_TOKENS)
        check_int(self, "window", 1, MAX_TREE_TOKENS)
        check_int(self, "ngram", 3, MAX_TREE_TOKENS)
        check_int(self, "guesses", 1, MAX_TREE_TOKENS)
        check_int(self, "suffixes", 1, self.guesses)
        if self.pool_rows is not None:  # bounded by the vocabulary per call (bounds.check_call)
            check_int(self, "pool_rows", 1, INT32_MAX)
        check_fraction(self, "confidence")
        check_bool(self, "phrase_drafting", "lengthening", "recycling", "history",
                   "context_phrases", "free_drafts")
        check_int(self, "free_threshold", 1, self.ngram - 1)
        n_t, n_s, n_first = forward_sizes(self)
        check_tree_tokens(self, n_t, "1 + gamma + suffixes * (ngram - 1) (target)")
        check_tree_tokens(self, max(n_s, n_first), "(window + guesses) * (ngram - 1) (draft)")


@struct.dataclass
class OuroborosCounters:
    """Ouroboros' own counters, int32[]: draft_forwards (batch draft forwards, catch-up ones
    included), suffix_tokens_accepted (tokens accepted from pool branches), pool_hits (row
    rounds whose key had a pool phrase), draft_matches (chain draft tokens equal to the
    target's choice), draft_accepted (chain draft tokens accepted); free drafts: free_rounds
    and draft_rounds (row rounds whose chain came from the free sources / from the draft;
    they add up to the row rounds), free_tokens_accepted (chain tokens accepted from free
    proposals), catch_up_forwards (batch draft forwards feeding the draft what free rounds
    committed), draft_histogram (int32[bins]: the drafted row rounds whose chain the
    draft offered whole, by tokens kept, as acceptance_histogram counts every round: what the
    draft's chains realised); and, with
    free drafts on, over every row round (free or drafted) by the free
    proposal's match length r = 0 .. M (0: none offered), int32[M+1]: free_offered (row
    rounds) and free_would_accept (the proposal's tokens the round kept: in a free round the
    ones accepted, in a drafted round its leading agreement with the tokens the round
    emitted, a lower bound of what verifying it would have kept). Their ratio by r is what a
    free proposal of that match is worth on this pair (`cost.FreeProfile`)."""

    catch_up_forwards: jax.Array
    draft_accepted: jax.Array
    draft_histogram: jax.Array
    draft_forwards: jax.Array
    draft_matches: jax.Array
    draft_rounds: jax.Array
    free_offered: jax.Array
    free_rounds: jax.Array
    free_tokens_accepted: jax.Array
    free_would_accept: jax.Array
    pool_hits: jax.Array
    suffix_tokens_accepted: jax.Array

    def to_dict(self) -> dict:
        return counters_dict(self)


@struct.dataclass
class OuroborosState:
    """The carry of Ouroboros' while_loop.

    Attributes:
        seq: the token buffer; its last token per row is pending.
        tcache: the target's KV cache (lengths - 1 tokens).
        dcache: the draft's KV cache: every token the target confirmed that the draft has
            processed (rolled back to the accepted prefix after each round).
        window: the draft's Jacobi window, from which phrase drafting harvests phrases.
        pool: the phrase pool shared by drafting (phrases the draft verifies), lengthening
            (branches after the chain) and recycling (verified phrases go back in); it
            persists across calls when `history` is on.
        stats: the on-device counters (`common.Stats`), own = `OuroborosCounters`.
        key_offset: int32[B] added to every pool key of the row (per-request pools), or None.
    """

    seq: Sequences
    tcache: KVCache
    dcache: KVCache
    window: JacobiWindow
    pool: PhrasePool
    stats: Stats
    key_offset: Optional[jax.Array] = None


def forward_sizes(cfg: OuroborosConfig) -> tuple[int, int, int]:
    """(target tokens of a round's tree, the draft's tokens per phrase-drafting step, the
    draft's first forward with its prefix slot)."""
    m = cfg.ngram - 1
    x = cfg.suffixes if cfg.lengthening else 0
    n_t = 1 + cfg.gamma + x * m
    n_s = (cfg.window + cfg.guesses) * m if cfg.phrase_drafting else 1
    # the round's first draft forward carries a fixed prefix slot (N, or 1 without branches);
    # token drafting without branches catches up through its one-token forwards instead
    # (`speculative.draft_propose` with catch_up 1)
    if not (cfg.phrase_drafting or cfg.lengthening):
        return n_t, n_s, 1
    return n_t, n_s, n_s + (cfg.ngram if cfg.lengthening else 1)
