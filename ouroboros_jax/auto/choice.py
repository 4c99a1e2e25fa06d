"""config="auto"'s choice: each method's predicted-fastest config for the device, pair and batch.

The cost model's predicted rate (decoding/cost.py: the paper's expected tokens per round at
agreement a and gamma, (1 - a^(gamma+1)) / (1 - a), plus pool terms, over the round's
predicted time from the latency tables) is maximised over each method's knob grid (its
config's `KNOBS`, decoding/knobs.py); vanilla's rate is 1 / t_T(1) (both with the work outside
the forwards added). When no setting is predicted to beat vanilla by `MIN_GAIN`, speculation
is turned off for the call (the call runs vanilla, and stats say so). A choice is kept, in
the tuner and in the store for later processes, until another is predicted `STICKY_GAIN`
faster: a new config costs a compile.

The pure part (`choose`, `predicted_rate`, `predicted_speedup`) takes tables and an
agreement; a `Chooser` prices them with its tuner's `prices.Prices` and `agreement.Agreement`
and keeps what it chose.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

from ..decoding import METHODS
from ..decoding.cost import DepthAgreement, FreeProfile, interpolate, vanilla_rate
from ..decoding.knobs import recipe_of
from ..decoding.spec import chain_agreement
from ..distributed import broadcast, model_spans_processes
from ..pool.phrase_pool import shape_fits
from .agreement import DEFAULT_AGREEMENT, MIN_DEPTH_ROUNDS, MIN_REALISED_ROUNDS, Agreement
from .keys import Signatures, batch_bucket, device_kind
from .prices import FACTOR_PRIOR_CALLS, Prices
from .store import Store, cache_path

# Predicted speedup a speculative setting needs, else the call runs vanilla. While vanilla's
# step overhead counted the LM head twice (VANILLA_STEP_SECONDS in cost.py), vanilla was priced
# 15-30% over its loop against the methods' rounds, and the margins were 1.15 (a
# realised rate) and 1.05 (TRY_GAIN: a rate estimated from the prompts or a prior, which runs
# low: the real pair's prompt argmax agreement 0.84, its chains' realised 0.91 by depth), so
# that a predicted gain within that error ran vanilla. With vanilla priced at its loop (the
# real pair's `pred x` 1.50 for gamma 6, measured 1.59; it was 2.47) the same margins turned
# speculation off on the demo pair, where it measures 1.3-1.6x (predicted 1.13x: first calls
# ran vanilla, and a later switch must pay its compile, `switch.pays_off`). So the
# margins are now what remains of the error: 5% on a realised rate, none before one.
TRY_GAIN = 1.0
MIN_GAIN = 1.05
# A method whose loop fewer than TRY_CALLS calls have timed is tried from UNTIMED_GAIN (the
# first call's settle then keeps it, `switch`): its price rests on anchors timed once, in
# the first call, and one anchor the machine slowed there (the real 1.5B's 2-token forward
# read 1.78 of its shape where it reads 1.25-1.3) priced every speculative round 25% over its
# loop; auto then predicted 0.91x for what measures 1.39-1.59x, ran vanilla, and vanilla's
# calls never teach a method's price. Tried, its calls teach its factor (`method_factor`).
UNTIMED_GAIN = 0.85
TRY_CALLS = 3
# A choice is kept until another is predicted STICKY_GAIN faster: switching costs a compile
# that staying would not, in a later call (the new loop compiles in the background, `switch`,
# on the host cores the user's calls run on) or in a process's first call against the store's
# choice (whose loop the persistent compilation cache likely holds). (A first call no longer
# settles: it compiled a second loop at its end, which a CLI user, whose process ends with the
# answer, paid for nothing; issue 53.)
STICKY_GAIN = 1.10
# A greedy call whose chosen chain is shorter than this, for a pair whose depths past the first
# have not been measured, drafts this deep instead (`Chooser.explore`): a 1-token chain
# measures the first token's agreement only, which on pairs whose agreement comes in runs
# underprices every longer chain. Not past EXPLORE_ROUNDS rounds of the pair (a pair that
# rarely passes its first token is not explored for ever). 8, not 4: the explored loop is
# the one the persistent compile cache holds, and a later process keeps it unless its own
# call's saving pays a new compile (`Switch.first_runnable`). Explored at 4, the real Qwen
# pair (agreement 0.96-1.0 at every depth) ran every later CLI process at gamma 4 (decoding
# 0.67x vanilla's time; gamma 12 reads 0.47x, and 8 sits near 12, whose extra depths a
# strong pair's draft forwards mostly pay for anyway). A weak pair pays the deeper chain in
# its first call only.
EXPLORE_DEPTH = 8
EXPLORE_ROUNDS = 128
# Grid searches remembered per tuner (`Chooser.choose_memo`)
MEMO_SIZE = 256


@dataclasses.dataclass
class Choice:
    method: str  # the method the call runs: the asked one, or "vanilla" when nothing pays
    config: object
    predicted_speedup: float
    agreement: Optional[float]
    reason: str
    tables: tuple = (None, None)  # (target, draft) latency tables the choice was made with
    # {"measured": [...], "assumed": [...]}: what stands behind the prices and the agreement
    notes: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0  # host time auto took in this call (calibration, agreement, search)
    # the method's rounds' learned cost over their price, relative to vanilla's steps'
    # (`Prices.relative_factor`): the predicted speedups above are divided by it
    price_factor: float = 1.0

    def as_stats(self, asked: str) -> dict:
        return {"asked": asked, "method": self.method,
                "config": recipe_of(self.config) if self.config is not None else None,
                "predicted_speedup": round(self.predicted_speedup, 3),
                "agreement": (None if self.agreement is None else
                              round(chain_agreement(self.agreement, self.config), 3)),
                "agreement_by_depth": (list(self.agreement.by_depth) + [self.agreement.beyond]
                                       if isinstance(self.agreement, DepthAgreement) else None),
                "reason": self.reason,
                "measured": list(self.notes.get("measured", [])),
                "assumed": list(self.notes.get("assumed", [])),
                "seconds": round(self.seconds, 4),
                # what this call measured for auto, and the seconds each took ([] but for a
                # call without the store, or over processes: a call never waits for a probe)
                "measured_now": list(self.notes.get("measured_now", []))}


# ------------------------------------------------------------------------------------ pure
def method_spec(method: str):
    """The registered MethodSpec of a method `config="auto"` can size."""
    spec = METHODS.get(method)
    if spec is None or spec.round_model is None:
        known = sorted(m for m, s in METHODS.items() if s.round_model is not None)
        raise ValueError(f"config='auto' knows {', '.join(known)}, not {method!r}")
    return spec


def fits_pool(cfg, pool_shape: Optional[tuple]) -> bool:
    """Whether a pool of pool_shape (phrases per key, tokens per phrase) can serve cfg: its
    phrases are ngram - 1 tokens and it holds at least `guesses` per key (None: no pool given,
    anything fits; a config without a pool fits any)."""
    if pool_shape is None or not hasattr(cfg, "ngram"):
        return True
    return shape_fits(pool_shape, cfg.guesses, cfg.ngram - 1)


def candidates(spec, pool_shape: Optional[tuple]) -> list:
    """A method's knob grid (`MethodSpec.auto_grid`), less the configs a passed pool cannot
    serve (`fits_pool`)."""
    return [c for c in spec.auto_grid() if fits_pool(c, pool_shape)]


def dense_tables(sizes, tt: dict, td: Optional[dict]) -> tuple[dict, Optional[dict]]:
    """(tt, td) interpolated once at every forward size in `sizes` ((n_T, n_S, ...) tuples)
    and at 1: `interpolate` returns a table's own value at a size it holds, so a grid's rates
    read these as they would the measured tables, without sorting them per config."""
    nt = {1} | {s[0] for s in sizes}
    ns = {s[1] for s in sizes if s[1]}
    return ({n: interpolate(tt, n) for n in nt},
            None if td is None else {n: interpolate(td, n) for n in ns | {1}})


def choose(method: str, tt: dict, td: Optional[dict], agreement: Optional[float],
           pool_shape: Optional[tuple] = None, min_gain: float = MIN_GAIN,
           price_factor: float = 1.0) -> Choice:
    """The predicted-fastest config of `method` from latency tables tt (target) and td (draft)
    {n: seconds} and the pair's agreement; vanilla when nothing beats it by min_gain
    (MIN_GAIN; TRY_GAIN where the method's rate is not realised yet, UNTIMED_GAIN where few
    calls have timed it: `Chooser.current`). The candidates are the method's knob grid
    (`MethodSpec.auto_grid`, from its config's `KNOBS`) and their rates the cost model's
    (`MethodSpec.rate`, decoding/cost.py); with pool_shape (a pool the call passes: phrases
    per key, tokens per phrase) only those it can serve; price_factor: the method's rounds'
    measured cost over their price relative to vanilla's (`Prices.relative_factor`),
    dividing every config's predicted speedup."""
    spec = method_spec(method)
    grid = candidates(spec, pool_shape)
    if not grid:
        raise ValueError(f"pool: its phrases of {pool_shape[1]} tokens fit no {method} config "
                         "that config='auto' searches; pass the config the pool was made with")
    tt, td = dense_tables({spec.forward_sizes(c) for c in grid}, tt, td)
    rates = [spec.rate(c, agreement, tt, td) for c in grid]
    best_rate = max(rates)
    best = grid[rates.index(best_rate)]  # the first of equals, in grid order
    gain = best_rate / vanilla_rate(tt) / price_factor
    if gain < min_gain:
        return Choice("vanilla", None, 1.0, agreement,
                      f"no {method} setting is predicted to beat vanilla here (best {gain:.2f}x "
                      f"< {min_gain:.2f}x): speculation is off for this call",
                      price_factor=price_factor)
    return Choice(method, best, gain, agreement, f"predicted {gain:.2f}x vanilla",
                  price_factor=price_factor)


def predicted_rate(method: str, cfg, tt: dict, td: Optional[dict], a: Optional[float]) -> float:
    """Predicted tokens/s of one config (vanilla's when cfg is None)."""
    if cfg is None:
        return vanilla_rate(tt)
    return method_spec(method).rate(cfg, a, tt, td)


def predicted_speedup(method: str, cfg, tt: dict, td: Optional[dict], a: Optional[float],
                      price_factor: float = 1.0) -> float:
    """`predicted_rate` over vanilla's at the same tables (1 for vanilla), over price_factor
    (the method's rounds' learned factor over vanilla's, `Prices.relative_factor`)."""
    if cfg is None or method == "vanilla":
        return 1.0
    return predicted_rate(method, cfg, tt, td, a) / vanilla_rate(tt) / price_factor


def teaches(method: str, cfg) -> bool:
    """Whether a greedy call of `cfg` teaches auto the pair's agreement (its method's `learn`
    reads a call of one round; Ouroboros' only where its round is a plain chain)."""
    learn = METHODS[method].learn
    one_round = {"target_calls": 1, "new_tokens": 1, "eta": 1.0, "acceptance_histogram": [0, 1],
                 "whole_histogram": [0, 1], "draft_histogram": [0, 1]}
    return learn is not None and learn(cfg, one_round, True) is not None


def explore_method(choice: Choice, method: str, pool_shape: Optional[tuple]) -> Choice:
    """`Chooser.explore`'s vanilla case: the best-priced config of `method` whose greedy calls
    teach (among those a passed pool can serve, `candidates`), at a chain of at least
    EXPLORE_DEPTH; `choice` itself where the method has none."""
    spec = METHODS.get(method)
    if spec is None or not spec.needs_draft or spec.learn is None:
        return choice
    teach = [c for c in candidates(spec, pool_shape) if teaches(method, c)]
    if not teach:
        return choice
    tt, td = choice.tables
    a = choice.agreement
    best = max(teach, key=lambda c: spec.rate(c, a, tt, td))
    if getattr(best, "gamma", EXPLORE_DEPTH) < EXPLORE_DEPTH:
        best = dataclasses.replace(best, gamma=EXPLORE_DEPTH)
    gain = spec.rate(best, a, tt, td) / vanilla_rate(tt) / choice.price_factor
    return dataclasses.replace(
        choice, method=method, config=best, predicted_speedup=gain,
        reason=f"exploring: {choice.reason.split(':')[0]} on the prompts' agreement "
        f"(predicted {gain:.2f}x), which is not the pair's on its outputs; this call measures "
        "that, later calls run the choice priced with it")


# Ouroboros' own mechanisms: a config with all of them off drafts one chain and verifies it,
# which is speculative decoding's round (`as_run`)
OWN_MECHANISMS = ("phrase_drafting", "lengthening", "recycling", "context_phrases",
                  "free_drafts")


def as_run(choice: Choice, pool_shape: Optional[tuple]) -> Choice:
    """The choice as it runs: an Ouroboros config with every one of its own mechanisms off
    (its SD step, which auto chooses where they do not pay and explores a pair with) runs as
    `SpeculativeConfig` of the same chain: the same tokens (greedy) and the same lossless rule
    (sampled) from a loop without Ouroboros' window, pool and free-draft machinery, which
    compiles in less time (the demo pair's first call: 4.4 s against 6.6 s of backend
    compile, `python -m experiments.first_call`). Not where the call passes a pool (its
    shape is kept: the call returns it); every other choice unchanged."""
    cfg = choice.config
    if (choice.method != "ouroboros" or cfg is None or pool_shape is not None
            or any(getattr(cfg, m, False) for m in OWN_MECHANISMS)):
        return choice
    spec = METHODS["speculative"].config_type(gamma=cfg.gamma, confidence=cfg.confidence)
    return dataclasses.replace(
        choice, method="speculative", config=spec,
        reason=choice.reason + " (Ouroboros with its own mechanisms off is speculative "
        "decoding's round: run as speculative's loop)")


def with_free_profile(a, profile: Optional[FreeProfile], notes: dict):
    """The agreement a carrying the pair's free profile (`cost.DepthAgreement.free`, what
    prices Ouroboros' free drafts), said in notes: a by depth gets it; a single number becomes
    a `DepthAgreement` of that number at every depth (chain_tokens prices it as the number).
    The profile is learned from any greedy call's output (`free_profile.learn_free_profile`),
    so it can precede the pair's agreement by depth. a unchanged without a profile."""
    if profile is None or a is None:
        return a
    shares = ", ".join(f"{o:.2f}" for o in profile.offered)
    notes["measured"].append(f"free proposals by match 0..{len(profile.offered) - 1}: "
                             f"{shares} of the rounds (the store's free section)")
    if isinstance(a, DepthAgreement):
        return DepthAgreement(a.by_depth, a.beyond, profile)
    return DepthAgreement((), round(float(a), 3), profile)


def _frozen(table: Optional[dict]):
    return None if table is None else tuple(sorted(table.items()))


def _choose_frozen(method, tt, td, a, pool_shape=None, min_gain: float = MIN_GAIN,
                   price_factor: float = 1.0) -> Choice:
    """`choose` over tables frozen to sorted item tuples (hashable: the memo's key)."""
    return choose(method, dict(tt), None if td is None else dict(td), a, pool_shape, min_gain,
                  price_factor)


# ------------------------------------------------------------------------------------ the chooser
class Chooser:
    """The choices of one tuner: priced with its prices and agreement, kept in memory (by
    method, models, batch bucket, cache size, pool shape and store) and in the store's
    "choice" section, so a later process starts from the same one."""

    def __init__(self, store: Store, signatures: Signatures, prices: Prices,
                 agreement: Agreement):
        self.store, self.sig, self.prices, self.agreement = store, signatures, prices, agreement
        self._choices: dict = {}  # choice key + store path -> the choice last made
        # `choose` once per (method, tables, agreement, pool shape, margin): a grid search of
        # a few ms per call is not repeated on every `generate` call once the tables and
        # agreement have settled
        self.choose_memo = functools.lru_cache(maxsize=MEMO_SIZE)(_choose_frozen)

    def choice_key(self, method, target, draft, B, slots, pool_shape) -> str:
        d = self.sig(draft) if draft is not None else "-"
        return (f"{device_kind()}|{method}|{self.sig(target)}|{d}|B{batch_bucket(B)}"
                f"|S{slots}|{pool_shape}")

    def stored_choice(self, key: str) -> Optional[Choice]:
        """The choice an earlier process stored under key, or None (none, or its config no
        longer builds: the config class changed)."""
        hit = self.store.read().get("choice", {}).get(key)
        if hit is None:
            return None
        if hit["config"] is None:
            return Choice("vanilla", None, 1.0, None,
                          "speculation off (an earlier process's choice)")
        spec = METHODS.get(hit["method"])
        try:
            cfg = spec.config_type(**hit["config"])
        except (AttributeError, TypeError, ValueError):
            return None
        return Choice(hit["method"], cfg, 1.0, None, "an earlier process's choice")

    def store_choice(self, key: str, choice: Choice) -> None:
        cfg = (None if choice.config is None else
               {f.name: getattr(choice.config, f.name) for f in dataclasses.fields(choice.config)
                if isinstance(getattr(choice.config, f.name), (int, bool))})
        self.store.put("choice", key, {"method": choice.method, "config": cfg})

    def auto_config(self, method: str, target, draft, prompt, plens, slots: int,
                    use_cache: bool = True, pool_shape: Optional[tuple] = None,
                    explore_depth: bool = False, switch_gain: float = STICKY_GAIN,
                    timed: bool = False, keep_method: bool = False) -> Choice:
        """Price (`Prices.latency_tables`) and recall the pair's agreement, then `choose`,
        keeping the earlier choice for the same shapes (this tuner's, else the store's) unless
        the new one is predicted switch_gain faster (STICKY_GAIN). pool_shape: (phrases per key, tokens per
        phrase) of a pool the call passes, which the chosen config must fit (`fits_pool`).
        explore_depth: the call is greedy and teaches auto, so it may draft deeper once
        (`explore`). timed: the call's loop will be timed and teach its method's factor
        (`generate`'s calls, `Prices.record_call`), so a method fewer than TRY_CALLS calls have
        timed is tried from UNTIMED_GAIN (`current`). keep_method: the caller runs the asked
        method's loop only (a server's engine): Ouroboros' SD step stays an Ouroboros config
        rather than running as speculative's (`as_run`)."""
        run = (lambda c: c) if keep_method else (lambda c: as_run(c, pool_shape))
        t0 = time.perf_counter()
        B = int(prompt.shape[0])
        stored_key = self.choice_key(method, target, draft, B, slots, pool_shape)
        key = stored_key + "|" + str(cache_path())
        if model_spans_processes(target):
            return self._auto_spmd(key, method, target, draft, prompt, plens, slots, pool_shape)
        new = run(self.current(method, target, draft, prompt, plens, slots, use_cache,
                               pool_shape, timed))
        old = self._choices.get(key)
        if old is None and use_cache:
            old = self.stored_choice(stored_key)
        out = new
        if old is not None and (old.method, old.config) != (new.method, new.config) and (
                fits_pool(old.config, pool_shape)):
            out = _kept_unless_better(old, new, switch_gain)
        if explore_depth and use_cache:  # past the sticky rule: exploring is once, on purpose
            out = run(self.explore(out, target, draft, method, pool_shape))
        if use_cache and (old is None or (old.method, old.config) != (out.method, out.config)):
            self.store_choice(stored_key, out)
        self._choices[key] = out
        return dataclasses.replace(out, seconds=time.perf_counter() - t0)

    def _auto_spmd(self, key, method, target, draft, prompt, plens, slots, pool_shape=None
                   ) -> Choice:
        """auto_config over processes (one model on a mesh spanning them): the store, which
        differs per host, is not read (every process must make the same calls: the
        agreement's forwards are collective programs); process 0's choice is broadcast, as
        timings differ per process and every process must run the same loop. Kept for the
        tuner's life per shape (the same call history on every process, so every process hits
        or misses together)."""
        old = self._choices.get(key)
        if old is None:
            old = broadcast(self.current(method, target, draft, prompt, plens, slots, False,
                                         pool_shape))
            self._choices[key] = old
        return old

    def current(self, method, target, draft, prompt, plens, slots, use_cache,
                pool_shape=None, timed: bool = False) -> Choice:
        """The predicted-fastest config now. With use_cache (generate's calls): the device's
        calibration, the models' anchors and the learned scales from the store, priors where
        it has none (`Prices.latency_tables`), and the agreement realised by earlier calls or
        counted on earlier prompts, else a prior (`_pair_agreement`): nothing is measured, so
        a first call costs what a later one does. Without use_cache everything is measured now
        and nothing learned is used."""
        B = int(prompt.shape[0])
        spec = method_spec(method)
        with_draft = draft is not None and spec.needs_draft
        tt, td, notes = self.prices.latency_tables(target, draft if with_draft else None, B,
                                                   slots, use_cache)
        a, realised = None, False
        if not spec.needs_draft and spec.learn is not None and use_cache:
            a, realised = self._own_rate(method, target, notes)
        elif with_draft:
            a, realised = self._pair_agreement(target, draft, prompt, plens, use_cache, notes)
        # to 3 decimals: a realised agreement moves a little with every call (the memo)
        if a is not None and not isinstance(a, DepthAgreement):  # (by depth: rounded already)
            a = round(a, 3)
        f, n_timed = self.price_factor(method, target, draft if with_draft else None, B,
                                       use_cache, notes, timed)
        # a method whose calls would teach its rate is tried on a smaller predicted gain
        # (TRY_GAIN), and one whose rounds fewer than TRY_CALLS calls have timed (where this
        # one will be: `timed`) on a smaller still (UNTIMED_GAIN): what its calls measure then
        # decides
        trying = timed and n_timed < TRY_CALLS
        min_gain = (UNTIMED_GAIN if trying else
                    TRY_GAIN if spec.learn is not None and not realised else MIN_GAIN)
        choice = self.choose_memo(method, _frozen(tt), _frozen(td), a, pool_shape, min_gain, f)
        if trying and choice.method != "vanilla" and choice.predicted_speedup < MIN_GAIN:
            choice = dataclasses.replace(choice, reason=choice.reason + (
                f" (trying it: {n_timed} of its calls timed, {TRY_CALLS} teach its price)"))
        return dataclasses.replace(choice, tables=(tt, td), notes=notes)

    def _own_rate(self, method, target, notes: dict) -> tuple:
        """(a draftless method's realised rate or None, whether realised), said in notes."""
        a = self.agreement.realised_agreement(target, None, method)  # e.g. a copy hit rate
        if a is not None:
            n = self.agreement.realised_counts(self.sig.realised(target, None, method))[1]
            notes["measured"].append(f"{method}'s rate {a:.3f} (`MethodSpec.learn`): realised "
                                     f"over {n} rounds of earlier calls")
        else:
            notes["assumed"].append(f"{method}'s prior rates (fewer than "
                                    f"{MIN_REALISED_ROUNDS} rounds of earlier calls)")
        return a, a is not None

    def _pair_agreement(self, target, draft, prompt, plens, use_cache: bool, notes: dict
                        ) -> tuple:
        """(the pair's agreement, whether calls realised it), said in notes: from the store
        (realised by earlier calls, by depth where they measured it, or counted on earlier
        prompts), else DEFAULT_AGREEMENT: a call never waits for the prompts' two forwards (on
        the real Qwen pair a compile of both models, for an estimate its chat template
        misleads: 0.41 where its outputs realise 0.91); its own rounds teach the pair
        (`AutoTuner.learn_realised`). Without use_cache (no store: nothing learned can be
        read) the prompts are measured now, and the seconds logged in notes' measured_now."""
        ag = self.agreement
        a = ag.known_agreement(target, draft) if use_cache else None
        key = self.sig.pair(target, draft)
        # (one read of the store for both: the notes' branch below and the margin)
        realised = isinstance(a, DepthAgreement) or (
            use_cache and ag.realised_agreement(target, draft) is not None)
        if isinstance(a, DepthAgreement):
            n = ag.depth_counts(target, draft)[0][0]
            notes["measured"].append(
                f"agreement by depth {', '.join(f'{x:.3f}' for x in a.by_depth)}, then "
                f"{a.beyond:.3f}: realised over {n} rounds of earlier calls")
        elif realised:
            n = ag.realised_counts(key)[1]
            notes["measured"].append(f"agreement {a:.3f}: realised over {n} rounds of "
                                     "earlier calls")
        elif a is not None:
            n = self.store.read()["agreement"][key][1]
            r = ag.realised_counts(key)[1]
            notes["measured"].append(
                f"agreement {a:.3f}: the pair's argmax over {n} prompt positions of earlier "
                "calls" + (f", moved {r}/{MIN_REALISED_ROUNDS} of the way to the {r} rounds "
                           "they realised" if r else ""))
        elif not use_cache:
            t0 = time.perf_counter()
            a, n = ag.pair_agreement(target, draft, prompt, plens, use_cache=False)
            notes.setdefault("measured_now", []).append(
                {"what": "the pair's agreement (one forward of each model over the prompts)",
                 "seconds": round(time.perf_counter() - t0, 3)})
            notes["measured"].append(f"agreement {a:.3f}: the pair's argmax over this call's "
                                     f"{n} prompt positions (measured now)")
        else:
            a = DEFAULT_AGREEMENT
            notes["assumed"].append(f"agreement {a} (a prior: the pair was never run here; "
                                    "this call's rounds measure it)")
        return with_free_profile(a, ag.free_profile(target, draft) if use_cache else None,
                                 notes), realised

    def price_factor(self, method, target, draft, B: int, use_cache: bool, notes: dict,
                     timed: bool) -> tuple[float, int]:
        """(`Prices.relative_factor` to 3 decimals, how many calls of the method were timed),
        said in notes (timed: this call will be); (1.0, TRY_CALLS) without use_cache (nothing
        learned is used)."""
        if not use_cache:
            return 1.0, TRY_CALLS
        f, n_m, n_v = self.prices.relative_factor(target, draft, B, method)
        if n_m:
            notes["measured"].append(
                f"{method}'s loops x{f:.3f} their price against vanilla's: {n_m} timed call"
                f"{'s' if n_m != 1 else ''} of it and {n_v} of vanilla, each pooled with "
                f"{FACTOR_PRIOR_CALLS} at its price")
        else:
            notes["assumed"].append(f"{method}'s rounds at their price (no call of it timed yet"
                                    + (f": tried from {UNTIMED_GAIN:.2f}x)" if timed else ")"))
        return round(f, 3), n_m

    def explore(self, choice: Choice, target, draft, asked: Optional[str] = None,
                pool_shape: Optional[tuple] = None) -> Choice:
        """The choice a greedy call that teaches auto runs: `choice`, or, where it drafts a
        chain shorter than EXPLORE_DEPTH and the pair's depths past the first are not measured
        yet, the same config with a chain of EXPLORE_DEPTH, so that the next choice is priced
        with the agreement of every depth it weighs (a first call at gamma 1 would otherwise
        settle there).

        Where `choice` is vanilla for a drafting method (`asked`) whose pair has never been
        measured on its own outputs, the call runs the method's best-priced config that
        teaches (`teaches`) at a chain of EXPLORE_DEPTH instead: the only agreement known then
        is the prompts' argmax one, and on chat prompts that is the template's. The real Qwen
        pair read 0.41 on one chat prompt's 39 positions (its outputs realise 0.91-0.94), was
        priced at 0.75x vanilla, ran vanilla, and as vanilla teaches nothing, ran vanilla for
        ever."""
        cfg = choice.config
        off = cfg is None and asked is not None
        short = (cfg is not None and teaches(choice.method, cfg)
                 and getattr(cfg, "gamma", EXPLORE_DEPTH) < EXPLORE_DEPTH)
        if draft is None or not (off or short):
            return choice
        counts = self.agreement.depth_counts(target, draft)  # read only where a case applies
        if (sum(c[0] for c in counts[1:]) >= MIN_DEPTH_ROUNDS
                or (counts and counts[0][0] >= EXPLORE_ROUNDS)):
            return choice
        if off:
            return explore_method(choice, asked, pool_shape)
        return dataclasses.replace(
            choice, config=dataclasses.replace(cfg, gamma=EXPLORE_DEPTH),
            reason=choice.reason + f" (exploring: a chain of {EXPLORE_DEPTH} measures the "
            "pair's agreement past the first token; later calls run the choice priced with it)")


def _kept_unless_better(old: Choice, new: Choice, switch_gain: float) -> Choice:
    """`new`, or the kept `old` (its speedup at the prices now, not those it was chosen at)
    where `new` is not predicted switch_gain faster."""
    tt, td, a = new.tables + (new.agreement,)
    f = new.price_factor
    kept = predicted_speedup(old.method, old.config, tt, td, a, f)
    rival = predicted_speedup(new.method, new.config, tt, td, a, f)
    if rival >= switch_gain * kept:
        return new
    other = ("vanilla" if new.method == "vanilla" else
             f"{rival:.2f}x vanilla for another setting")
    return dataclasses.replace(
        new, method=old.method, config=old.config, predicted_speedup=kept,
        reason=f"predicted {kept:.2f}x vanilla (kept: {other} is not "
        f"{switch_gain:.2f}x better)")
