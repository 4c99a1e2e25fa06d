"""The pure cost model: tokens per round, phrase gains, one latency interpolator, and each
method's predicted rate from its own forward sizes.

A round of any method costs

    t_round = draft_forwards * t_S(n_S) + t_T(n_T) + overhead * t_T(1)

where n_T, n_S are the method's forward sizes (`MethodSpec.forward_sizes`: tokens per target
and per draft forward, fixed shapes as compiled), draft_forwards and overhead come from the
method's `RoundModel` (`MethodSpec.round_model(config, agreement)`), and t_T, t_S are latency
tables {tokens: seconds} read through `interpolate`. The predicted rate is the round model's
expected tokens over t_round. `config="auto"` (auto/choice.py) maximises it over a method's
knob grid; the bench's cost model (bench/cost_model.py) uses the same interpolator and forward
sizes to predict a measured run from its counted forwards.

Nothing here touches a device: the functions are plain arithmetic over numbers and dicts, so
they are cheap to call in a grid search and easy to test by hand.

Priors that are not measured (named constants below) describe how often pool phrases pay: they
come from the demo pair's measured counters (bench, W 4 N 3 G 4: lookahead eta 1.74, Ouroboros
c 1.25) and only shape the choice between tree sizes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import numpy as np

# Work outside the forwards, in units of the target's 1-token forward, fitted on the demo pair at
# batch 1 (measured seconds minus the probe's forward times, per round): per vanilla step
# (sampling, emit, commit), per round of any method (tree, accept walk, commits) and per
# Ouroboros round for the pool (lookups, recycling, inserts).
# A draft forward carries none: inside the loop a draft step (forward, sampling, cache commit)
# measures at or under the draft's timed 1-token forward. Speculative rounds at gamma 1-8 in one
# process, least squares over gamma of the round less its verify forward: the demo pair 0.87 ms
# a step against t_S(1) 1.01 ms; the real Qwen pair (gamma 1/2/4/6) 90 ms against t_S(1) 84 ms,
# a slope the prompt's prefill, shared by fewer rounds at longer chains, inflates. At the 0.06
# t_T(1) a step once carried (0.25 ms on the demo pair, 14 ms on the real one), every longer
# chain was priced over its loop (demo price/measured 0.85 at gamma 1 rising to 1.13 at 6), and
# auto settled on gamma 1 after its first call where gamma 3-4 measured 1.2x faster.
# Vanilla's is in seconds per step, not in units of the forward: the while loop's own small ops
# cost about the same whatever the model. It was 0.18 t_T(1) when the timers read one logit and
# XLA dropped the LM head from them; with timers that read every logit, a vanilla step measures
# 0.91x the timed 1-token forward on the real Qwen 1.5B (223.5 against 246.4 ms: nothing
# outside the forward shows), while on the demo target, whose forward takes 4-5 ms, vanilla's
# loop measured 12% above its forwards' price relative to the speculative rounds' (auto_check,
# two runs): about 0.5 ms. At 0.18 t_T(1) the real pair's and SmolLM2's vanilla were priced 18%
# above their measured loop relative to every method's round.
# Capped at the 0.18 t_T(1) fitted before: the rounds' overheads are priced in units of the
# forward, so on a model whose forward takes well under a millisecond (the tests' tiny pair) a
# fixed 0.5 ms per vanilla step alone priced vanilla at a sixth of its speed against them.
# 0.9 ms since the timers read every new K/V (models/timing.py): that made the demo target's
# timed t(1) 0.3 ms cheaper, and its vanilla step then measures 0.91-0.92 ms above it (two
# processes; generate calls of 1 and 64 tokens, fastest of 5), where a prompt-lookup round's
# measures 0.17-0.72 ms above its forward and the rounds' ROUND_OVERHEAD prices 0.37.
VANILLA_STEP_SECONDS = 9e-4
VANILLA_OVERHEAD_CAP = 0.18
ROUND_OVERHEAD = 0.1
POOL_OVERHEAD = 0.25
# Pool priors: the chance that one pool phrase (or one Jacobi n-gram) for the current key is the
# right continuation, and the chance that each further token of a right phrase is also right;
# fitted to the demo pair's lookahead counters (W 2, N 3, G 2: eta 1.31 over 128-token and 1.47
# over 512-token generations, the pool filling as a generation goes on).
PHRASE_HIT = 0.1
PHRASE_CONTINUES = 0.8


def interpolate(table: dict, n: int) -> float:
    """Seconds at n tokens from a {tokens: seconds} table (keys may be strings, as JSON gives
    them): exact at measured sizes, linear between them, linear from the last two past the
    largest, and the smallest size's time below it (a forward never gets cheaper than that)."""
    if not table:
        raise ValueError("latency table is empty")
    if n in table:  # a measured (or `auto.dense_tables`) size: its own value
        return float(table[n])
    pts = sorted((int(k), float(v)) for k, v in table.items())
    xs = [x for x, _ in pts]
    ys = [y for _, y in pts]
    if n <= xs[0]:
        return ys[0]
    if n <= xs[-1]:
        return float(np.interp(n, xs, ys))
    if len(xs) == 1:
        return ys[0]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (n - xs[-1])


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """What a device's forward costs per byte and per flop: its calibration (`config="auto"`
    measures it once per device and dtype, models/timing.py `matmul_timer`).

    Attributes:
        bandwidth: bytes/s a 1-row matmul streams its weights at.
        flops: flop/s of the matmul's rows (CPU: of the rows past the first; accelerators: of
            all rows at a compute-bound size).
        per_layer: seconds of fixed work per layer per forward (norms, attention's small ops,
            dispatch); not measured, a platform figure.
        overlap: whether reading the weights and computing overlap (accelerators: a forward
            costs the larger of the two, the roofline) or add up (a CPU's few cores do both).
    """

    bandwidth: float
    flops: float
    per_layer: float
    overlap: bool


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a model's forward reads and computes, from its config and params alone.

    Attributes:
        weight_bytes: bytes of weights a forward reads (the embedding of an untied model is a
            row lookup, not a read of the table).
        matmul_params: parameters multiplied per token (2 flops each).
        layers: decoder layers.
        kv_bytes: bytes of K and V cache per row per cached token.
        expert_bytes: of weight_bytes, the bytes of a mixture of experts' routed experts (all
            layers; 0 for a dense model, or where every expert is multiplied on every token,
            as the one-hot path does): a forward reads only the experts its tokens route to
            (`expected_experts`).
        expert_params: of matmul_params, the routed experts' parameters; a token multiplies
            experts_per_token / experts of them.
        experts: experts per layer (Y).
        experts_per_token: experts each token routes to (k).
    """

    weight_bytes: float
    matmul_params: float
    layers: int
    kv_bytes: float
    expert_bytes: float = 0.0
    expert_params: float = 0.0
    experts: int = 0
    experts_per_token: int = 0


def expected_experts(experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts (of `experts` per layer) that `tokens` tokens route to, each
    to `per_token` of them, under uniform routing: an expert is missed by one token with
    probability 1 - k/Y, by all of them with (1 - k/Y)^tokens, so
    E[distinct] = Y * (1 - (1 - k/Y)^tokens). A grouped MoE forward of T tokens at B rows reads
    this many experts' weights per layer (tokens = B * T), which is why a verification of T
    nodes costs more than a decoding step even where a dense model's would not (issue 57)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - per_token / experts) ** tokens)


def _read_bytes(shape: ModelShape, tokens: int) -> float:
    """Weight bytes a forward of `tokens` tokens (all rows) reads: every dense weight, and of
    the routed experts the expected share its tokens route to."""
    if not shape.expert_bytes:
        return shape.weight_bytes
    share = expected_experts(shape.experts, shape.experts_per_token, tokens) / shape.experts
    return shape.weight_bytes - shape.expert_bytes * (1.0 - share)


def _active_params(shape: ModelShape) -> float:
    """Parameters multiplied per token: all of a dense model's, k/Y of the routed experts'."""
    if not shape.expert_params:
        return shape.matmul_params
    idle = shape.expert_params * (1.0 - shape.experts_per_token / shape.experts)
    return shape.matmul_params - idle


def shape_latency(shape: ModelShape, rates: DeviceRates, batch: int, context: int,
                  sizes) -> dict:
    """{n: seconds} of a forward of n tokens per row at `batch` rows after `context` cached
    tokens: fixed work per layer, plus the weights and the live cache read at the device's
    bandwidth, plus the matmuls' 2 flops per active parameter per token at its flop rate, the
    two overlapping on an accelerator (the larger counts) and adding up on a CPU (where a 1-row
    forward's flops ride along with its reads: only the rows past the first add time). A
    mixture of experts reads the dense weights and the experts its batch * n tokens route to
    (`expected_experts`), so its t(n) climbs with n even where a dense model's is flat."""
    fixed = shape.layers * rates.per_layer
    cache = shape.kv_bytes * context * batch
    active = _active_params(shape)
    out = {}
    for n in sizes:
        read = (_read_bytes(shape, batch * n) + cache) / rates.bandwidth
        if rates.overlap:
            out[n] = fixed + max(read, 2.0 * active * batch * n / rates.flops)
        else:
            out[n] = fixed + read + 2.0 * active * (batch * n - 1) / rates.flops
    return out


def scaled(table: Optional[dict], scale: float) -> Optional[dict]:
    """A latency table with every time multiplied by scale (None stays None)."""
    return None if table is None else {n: t * scale for n, t in table.items()}


def expected_tokens(a: float, gamma: int) -> float:
    """Tokens per round of a chain of gamma draft tokens at per-token agreement a (accepted
    prefix + the target's own token): (1 - a^(gamma+1)) / (1 - a)."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (gamma + 1)) / (1 - a)


def agreement_from_eta(eta: float, gamma: int) -> float:
    """The a at which expected_tokens(a, gamma) == eta (bisection): the per-token agreement a
    speculative call actually realised. It is higher than the teacher-forced mean when
    agreement comes in runs (easy stretches accept whole chains), which is what the next
    choice should plan with."""
    eta = min(max(eta, 1.0), gamma + 1.0)
    lo, hi = 0.0, 0.999
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < eta else (lo, mid)
    return (lo + hi) / 2


class DepthAgreement(NamedTuple):
    """A pair's agreement by depth in a draft chain, as greedy chain calls realised it:
    by_depth[k - 1] is the share of rounds whose k-th draft token was accepted among those that
    accepted the first k - 1; beyond, the same past the measured depths. Agreement comes in
    runs (an easy stretch accepts whole chains), so the deeper tokens of a chain are accepted
    more often than the first: on the demo pair 0.58 / 0.75 / 0.77 / 0.9 at depths 1-4. One
    number fitted to a 1-token chain prices a 4-token chain's tokens 12% low there."""

    by_depth: tuple
    beyond: float
    # what free proposals were worth on the pair (`FreeProfile`), None before any was measured
    free: Optional["FreeProfile"] = None


def chain_tokens(a: DepthAgreement, gamma: int) -> float:
    """Tokens per round of a chain of gamma draft tokens under agreement by depth: 1 (the
    target's own) plus, for each depth k, the chance that the first k draft tokens are all
    accepted."""
    tokens, p = 1.0, 1.0
    for k in range(gamma):
        p *= a.by_depth[k] if k < len(a.by_depth) else a.beyond
        tokens += p
    return tokens


def agreement_for(a, gamma: int):
    """The one per-token agreement a chain of gamma is priced with: a itself when it is a
    number (or None), and for a DepthAgreement the a at which expected_tokens(a, gamma) equals
    the chain's expected tokens (`chain_tokens`), so every round model keeps its one-number
    form."""
    if isinstance(a, DepthAgreement):
        return _chain_agreement(a, gamma)
    return a


@functools.lru_cache(maxsize=1024)
def _chain_agreement(a: DepthAgreement, gamma: int) -> float:
    # a grid search prices hundreds of configs over a few gammas: one bisection per gamma
    return agreement_from_eta(chain_tokens(a, gamma), gamma)


def depth_counts(histogram, gamma: int) -> list:
    """[[reached, accepted]] for depths 1..gamma from a greedy chain call's acceptance
    histogram (rounds by tokens kept: the accepted draft tokens plus the target's own): depth k
    is reached by the rounds that accepted at least k - 1 draft tokens and passed by those that
    accepted at least k. Its last bin may hold every longer round (`count_round` clips), which
    only depths past gamma would tell apart."""
    h = [int(x) for x in histogram]
    return [[sum(h[k:]), sum(h[k + 1:])] for k in range(1, gamma + 1)]


def phrase_gain(guesses: int, ngram: int) -> float:
    """Expected extra tokens from the best of `guesses` (N-1)-token phrases for a key: some
    phrase is right with 1 - (1 - PHRASE_HIT)^G, and then each of its tokens after the first
    continues with PHRASE_CONTINUES."""
    hit = 1 - (1 - PHRASE_HIT) ** guesses
    return hit * sum(PHRASE_CONTINUES ** j for j in range(ngram - 1))


def branch_gain(a: float, gamma: int, suffixes: int, ngram: int) -> float:
    """Expected tokens a round gains from lengthening: when the whole chain of gamma is accepted
    (a^gamma), one of X pool phrases of N-1 tokens may go on, each token agreeing with a."""
    m = ngram - 1
    return a ** gamma * (1 - (1 - PHRASE_HIT) ** suffixes) * sum(a ** j for j in range(1, m + 1))


@dataclasses.dataclass(frozen=True)
class RoundModel:
    """What one round of a method yields and costs besides its forwards' sizes.

    Attributes:
        tokens: expected tokens emitted per round.
        draft_forwards: expected draft forwards per round.
        overhead: work outside the forwards, in units of the target's 1-token forward.
    """

    tokens: float
    draft_forwards: float = 0.0
    overhead: float = 0.0


def vanilla_overhead(tt: dict) -> float:
    """Vanilla's work outside its forward per step, in units of the target's 1-token forward
    (as `RoundModel.overhead`): VANILLA_STEP_SECONDS over t_T(1), at most
    VANILLA_OVERHEAD_CAP."""
    return min(VANILLA_STEP_SECONDS / interpolate(tt, 1), VANILLA_OVERHEAD_CAP)


def round_seconds(sizes: tuple, model: RoundModel, tt: dict, td: Optional[dict]) -> float:
    """Predicted seconds of one round: sizes = (n_T, n_S, ...) from `MethodSpec.forward_sizes`,
    tt / td the target's and draft's latency tables (td unused without draft forwards)."""
    n_t, n_s = sizes[0], sizes[1]
    t = interpolate(tt, n_t)
    if model.draft_forwards:
        t = model.draft_forwards * interpolate(td, n_s) + t
    if model.overhead:
        t = t + model.overhead * interpolate(tt, 1)
    return t


def loop_seconds(sizes: tuple, overhead: float, target_forwards: float, draft_forwards: float,
                 tt: dict, td: Optional[dict]) -> tuple[float, float]:
    """(target's, draft's) predicted seconds of a loop's counted forwards, priced as
    `round_seconds` prices a round: target_forwards forwards of sizes[0] tokens, each with its
    round's work outside the forwards (overhead * t_T(1)), and draft_forwards of sizes[1]."""
    t = target_forwards * (interpolate(tt, sizes[0]) + overhead * interpolate(tt, 1))
    d = draft_forwards * interpolate(td, sizes[1]) if draft_forwards else 0.0
    return t, d


def rate(sizes: tuple, model: RoundModel, tt: dict, td: Optional[dict]) -> float:
    """Predicted tokens per second of a round described by its forward sizes and model."""
    return model.tokens / round_seconds(sizes, model, tt, td)


def vanilla_rate(tt: dict) -> float:
    """Vanilla's predicted tokens per second: one target forward of one token per token."""
    return rate((1, 0), RoundModel(tokens=1.0, overhead=vanilla_overhead(tt)), tt, None)


# Free drafts (Ouroboros' `free_drafts`, issue 52): a round whose chain comes from the context
# or the pool runs no draft forward. What such a chain is worth depends on the pair and the
# workload, so it is priced from what the pair's calls measured (`FreeProfile`, from the
# rounds' free_offered / free_would_accept counters); before any, from FREE_PRIOR, which
# offers nothing: auto turns free drafts on only from a profile the pair's free-drafts calls
# measured. FREE_OVERHEAD: a round's free proposal (the context match over the buffer and M
# pool lookups), in units of t_T(1); not fitted (a guess of the order of POOL_OVERHEAD's
# share), it keeps a profile that brings nothing from pricing equal to drafting alone.
FREE_OVERHEAD = 0.05


class FreeProfile(NamedTuple):
    """What free proposals are worth on a pair, by match length r = 0 .. M (0: none offered):
    offered[r], the share of rounds whose best free proposal matched r tokens; kept[r], the
    proposal's tokens such a round kept on average (`ouroboros.shadow_accepted`)."""

    offered: tuple
    kept: tuple


FREE_PRIOR = FreeProfile(offered=(1.0,), kept=(0.0,))


def free_profile(offered, would_accept) -> Optional[FreeProfile]:
    """A FreeProfile from rounds by match length (offered) and the tokens their proposals
    kept (would_accept), as the counters free_offered / free_would_accept hold them (summed
    over calls); None without rounds."""
    total = float(sum(offered))
    if total <= 0:
        return None
    return FreeProfile(offered=tuple(round(float(o) / total, 4) for o in offered),
                       kept=tuple(round(float(w) / max(float(o), 1.0), 3)
                                  for o, w in zip(offered, would_accept)))


def free_mix(profile: FreeProfile, threshold: int, gamma: Optional[int] = None
             ) -> tuple[float, float]:
    """(share of rounds that go free, tokens per free round) at a threshold: the rounds whose
    proposal matched at least `threshold` tokens, each emitting its kept tokens (at most
    gamma, a chain's slots; None: uncapped) plus the target's own. A match past the profile's
    longest counts as its longest. (The profile keeps a mean per match, so the cap is applied
    to the mean: a bound, not the exact capped mean.)"""
    top = len(profile.offered) - 1
    rs = range(min(threshold, top), top + 1)
    share = sum(profile.offered[r] for r in rs)
    if share <= 0:
        return 0.0, 1.0
    cap = float("inf") if gamma is None else float(gamma)
    return share, 1.0 + sum(profile.offered[r] * min(profile.kept[r], cap) for r in rs) / share


def free_round_model(base: RoundModel, profile: FreeProfile, threshold: int,
                     catch_up_chunk: int, gamma: Optional[int] = None) -> RoundModel:
    """A round model with free drafts: a share f of the rounds (`free_mix`) verifies a free
    chain (its tokens, no draft forward), the rest are `base`'s rounds; each free round's
    tokens are fed to the draft later by catch-up forwards of catch_up_chunk tokens, priced
    as draft forwards (they are wider: on an accelerator the same, on a CPU a little more).
    The verify forward is base's (the same tree); the overhead base's plus FREE_OVERHEAD."""
    f, free_tokens = free_mix(profile, threshold, gamma)
    return RoundModel(tokens=(1 - f) * base.tokens + f * free_tokens,
                      draft_forwards=(1 - f) * base.draft_forwards
                      + f * free_tokens / catch_up_chunk,
                      overhead=base.overhead + FREE_OVERHEAD)


def best_free_threshold(sizes: tuple, base: RoundModel, profile: FreeProfile,
                        catch_up_chunk: int, tt: dict, td: Optional[dict],
                        thresholds) -> Optional[int]:
    """The threshold of `thresholds` at which free drafts price fastest, or None where the
    draft-only round (`base`) prices at least as fast as every one."""
    best, best_rate = None, rate(sizes, base, tt, td)
    for t in thresholds:
        r = rate(sizes, free_round_model(base, profile, t, catch_up_chunk), tt, td)
        if r > best_rate:
            best, best_rate = t, r
    return best
