"""config="auto"'s agreement: how often the draft's token is the target's, for a pair.

Once greedy chain calls have run on the pair (speculative's, or Ouroboros' with phrase
drafting and lengthening off), the agreement they realised (`cost.agreement_from_eta`: the a
whose expected tokens per round equal the measured eta, pooled over calls by rounds), by depth
where they measured it (`depth_agreement`); before that, the share of positions where the
draft's and the target's argmax agree over the prompts (`pair_agreement`: two forwards, run
only where asked: a call without the store, a bench), else a prior (`DEFAULT_AGREEMENT`: a
`generate` call never waits for these forwards), moved toward what the first rounds realised (`partly_realised`).
A method without a draft keeps its own rate the same way (prompt lookup: its copy hit rate).
All of it pooled in the tuner's `store.Store`.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from ..decoding.cost import DepthAgreement, FreeProfile, free_profile
from ..models import causal_mask, forward
from .keys import Signatures
from .store import MAX_DEPTH, Store

DEFAULT_AGREEMENT = 0.5  # before the pair has been measured on 32 prompt positions
MIN_AGREEMENT_TOKENS = 32
# Once a pair's agreement rests on this many prompt positions, later calls reuse it without
# running the two forwards (auto's per-call cost is then a dictionary lookup).
SETTLED_AGREEMENT_TOKENS = 2048
# speculative rounds before the realised agreement replaces the prompt's: one 64-token call at
# gamma <= 1 realises 32 or more, so the end of a first call can plan with it (`switch`)
MIN_REALISED_ROUNDS = 32
# A depth of the chain is planned with its own measured agreement once this many rounds have
# reached it; deeper ones with the pooled agreement of every depth past the first. 8, not 16:
# a strong pair's exploring call (a chain of 8, `choice.EXPLORE_DEPTH`) over 128 tokens runs
# 14-15 rounds, and at 16 the real Qwen pair's first CLI process (15 rounds at 0.96-1.0) left
# the second to price with the prior 0.5, which ran gamma 1 and compiled it (0.78 s/token).
MIN_DEPTH_ROUNDS = 8


@partial(jax.jit, static_argnums=(1, 3))
def agreement_counts(tparams, tcfg, dparams, dcfg, prompt, plens):
    """(positions where both models' argmax agree, positions) over the real prompt tokens."""
    B, P = prompt.shape
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    mask = causal_mask(B, P)
    t = jnp.argmax(forward(tparams, tcfg, prompt, pos, mask)[0], axis=-1)
    d = jnp.argmax(forward(dparams, dcfg, prompt, pos, mask)[0], axis=-1)
    real = jnp.arange(P)[None, :] < plens[:, None]
    return jnp.sum((t == d) & real), jnp.sum(real)


def _shrunk(agree: int, n: int) -> float:
    """A few prompt positions' estimate shrunk toward the prior (DEFAULT_AGREEMENT) by their
    share of MIN_AGREEMENT_TOKENS."""
    if n < MIN_AGREEMENT_TOKENS:
        w = n / MIN_AGREEMENT_TOKENS
        return w * (agree / max(n, 1)) + (1 - w) * DEFAULT_AGREEMENT
    return agree / n


class Agreement:
    """The agreement of one tuner's pairs: read and pooled through its store."""

    def __init__(self, store: Store, signatures: Signatures):
        self.store, self.sig = store, signatures

    def known_agreement(self, target, draft):
        """The pair's agreement from the store without running anything: realised by greedy
        chain calls (by depth where they measured it, `depth_agreement`), else the prompts'
        pooled counts; None when neither has been measured."""
        a = self.depth_agreement(target, draft) or self.realised_agreement(target, draft)
        if a is not None:
            return a
        key = self.sig.pair(target, draft)
        agree, n = self.store.read().get("agreement", {}).get(key, [0, 0])
        if int(n) <= 0:
            return None
        return self.partly_realised(_shrunk(agree, n), key)

    def partly_realised(self, prompt_estimate: float, key: str) -> float:
        """The prompts' agreement moved toward what fewer than MIN_REALISED_ROUNDS rounds of
        earlier calls realised, by their share of MIN_REALISED_ROUNDS (unchanged without any).

        Why: the prompts' argmax agreement runs low (the real Qwen pair: 0.64 over two short
        code prompts, where its chains realise 0.92), and a first call that explored gamma 4
        over 64 tokens ran 15 rounds, one short of both thresholds; priced at the prompts'
        0.64 every later call ran vanilla (predicted 0.86x), so the pair never realised the
        rounds that would have corrected it."""
        s, rounds = self.realised_counts(key)
        if rounds <= 0:
            return prompt_estimate
        w = min(1.0, rounds / MIN_REALISED_ROUNDS)
        return w * (s / rounds) + (1 - w) * prompt_estimate

    def pair_agreement(self, target, draft, prompt, plens, use_cache: bool = True
                       ) -> tuple[float, int]:
        """(estimated top-1 agreement of the pair, positions it rests on): this call's prompts
        pooled with every earlier call's for the same pair (the store)."""
        key = self.sig.pair(target, draft)
        old = self.store.read().get("agreement", {}).get(key, [0, 0]) if use_cache else [0, 0]
        if int(old[1]) >= SETTLED_AGREEMENT_TOKENS:
            return int(old[0]) / int(old[1]), int(old[1])
        agree, n = (int(x) for x in agreement_counts(target.params, target.config,
                                                      draft.params, draft.config, prompt, plens))
        if use_cache:  # pooled under the lock with what every process has counted
            agree, n = self.store.add("agreement", key, (agree, n), (0, 0))
        return _shrunk(agree, n), n

    def record_realised(self, target, draft, a: float, rounds: int,
                        depth: Optional[list] = None, method: Optional[str] = None) -> None:
        """After a call: pool the agreement a it realised over `rounds` rounds (what its
        method's `MethodSpec.learn` reports) with earlier calls' for the pair, weighted by
        rounds, in the store; and its acceptance by depth (`cost.depth_counts`: [reached,
        accepted] per depth of its chain) with theirs, depth by depth. Without a draft: the
        method's own rate (its `learn`'s, e.g. prompt lookup's copy hit rate) on this target,
        keyed by `method`."""
        key = self.sig.realised(target, draft, method)

        def change(data):  # both pooled under one lock and one write of the store
            s, n = data.setdefault("realised", {}).get(key, [0.0, 0])
            data["realised"][key] = [float(s + a * rounds), int(n + rounds)]
            if not depth:
                return
            new = [list(d) for d in data.setdefault("depth", {}).get(key, [])]
            new += [[0, 0] for _ in range(min(len(depth), MAX_DEPTH) - len(new))]
            for k, (reached, accepted) in enumerate(depth[:MAX_DEPTH]):
                new[k] = [new[k][0] + int(reached), new[k][1] + int(accepted)]
            data["depth"][key] = new
        self.store.update(change)

    def depth_counts(self, target, draft) -> list:
        """[[reached, accepted], ...] per depth of the pair's chains, pooled ([] before any)."""
        return self.store.read().get("depth", {}).get(self.sig.pair(target, draft), [])

    def depth_agreement(self, target, draft) -> Optional[DepthAgreement]:
        """The pair's agreement by depth from the store (`cost.DepthAgreement`): each depth
        from the first on that MIN_DEPTH_ROUNDS rounds have reached, and past them the pooled
        agreement of every depth past the first (the first's where they are not measured
        yet); None until the first depth is measured."""
        counts = self.depth_counts(target, draft)
        if not counts or counts[0][0] < MIN_DEPTH_ROUNDS:
            return None
        by_depth = []
        for reached, accepted in counts:
            if reached < MIN_DEPTH_ROUNDS:
                break
            by_depth.append(round(accepted / reached, 2))
        deep_r, deep_a = (sum(c[i] for c in counts[1:]) for i in (0, 1))
        # to 2 decimals (a chain's tokens move by under 1%): the choice is searched again only
        # when the agreement has moved that much (the chooser's memo)
        beyond = round(deep_a / deep_r, 2) if deep_r >= MIN_DEPTH_ROUNDS else by_depth[-1]
        return DepthAgreement(tuple(by_depth), beyond, self.free_profile(target, draft))

    def record_free(self, target, draft, offered, would_accept) -> None:
        """After a call with Ouroboros' free drafts: pool its rounds by the free proposal's
        match length (free_offered) and the tokens those proposals kept (free_would_accept)
        with earlier calls' for the pair, length by length, in the store."""
        key = self.sig.pair(target, draft)
        new = [[int(o), int(w)] for o, w in zip(offered, would_accept)]

        def change(data):
            old = data.setdefault("free", {}).get(key, [])
            both = [list(x) for x in old] + [[0, 0]] * max(0, len(new) - len(old))
            for r, (o, w) in enumerate(new):
                both[r] = [both[r][0] + o, both[r][1] + w]
            data["free"][key] = both
        self.store.update(change)

    def free_profile(self, target, draft) -> Optional[FreeProfile]:
        """What the pair's free proposals kept by match length (`cost.FreeProfile`), once
        MIN_REALISED_ROUNDS rounds back it; else None (the cost model's prior)."""
        counts = self.store.read().get("free", {}).get(self.sig.pair(target, draft), [])
        if sum(o for o, _ in counts) < MIN_REALISED_ROUNDS:
            return None
        return free_profile([o for o, _ in counts], [w for _, w in counts])

    def realised_counts(self, key: str) -> tuple:
        """(sum of realised agreement x rounds, rounds) pooled in the store under a
        `Signatures.realised` key ((0.0, 0) before any call)."""
        s, n = self.store.read().get("realised", {}).get(key, [0.0, 0])
        return s, n

    def realised_agreement(self, target, draft, method: Optional[str] = None
                           ) -> Optional[float]:
        """What calls realised (the pair's agreement; a draftless method's own rate), once
        MIN_REALISED_ROUNDS rounds back it; else None."""
        s, n = self.realised_counts(self.sig.realised(target, draft, method))
        return s / n if n >= MIN_REALISED_ROUNDS else None
