"""`config="auto"`: each method's configuration chosen for the device, models and batch at hand.

A speculative method pays off only where scoring many tokens in one forward costs about what
scoring one costs (an accelerator reading its weights at batch 1), and only as far as the draft
agrees with the target. Both are measured rather than assumed:

1. **latency probe** (`probe_latency`): seconds per forward of the target and of the draft by
   input size n, at the call's batch bucket and cache size, on the actual device; measured once
   and kept on disk (`cache_path()`), keyed by device kind, model shape and dtype, batch bucket
   and cache bucket, so later calls and later processes pay nothing;
2. **agreement**: once greedy speculative calls have run on the pair, the agreement they
   realised (`agreement_from_eta`: the a whose expected tokens per round equal the measured
   eta, pooled over calls by rounds, on disk); before that, the share of positions where the
   draft's and the target's argmax agree over the call's prompts (`pair_agreement`: two
   forwards, pooled on disk with earlier calls);
3. **choice** (`choose`): the paper's expected-tokens model (tokens per round at agreement a and
   gamma: (1 - a^(gamma+1)) / (1 - a)) divided by the round's predicted time from the latency
   table, maximised over a grid of each method's knobs; vanilla's rate is 1 / t_T(1) (both
   with the work outside the forwards added). When no
   setting is predicted to beat vanilla by `MIN_GAIN`, speculation is turned off for the call
   (the call runs vanilla, and stats say so).

On an accelerator t_T(n) is nearly flat up to tens or hundreds of tokens, and the choice lands at
large trees (the paper's recipe: gamma ~12, W ~20, N ~7); on a 2-core CPU a forward's cost grows
with every token, and it lands at small trees (what `ouroboros-jax tune` finds there).

Priors that are not measured (named constants below) describe how often pool phrases pay: they
come from the demo pair's measured counters (bench, W 4 N 3 G 4: lookahead eta 1.74, Ouroboros
c 1.25) and only shape the choice between tree sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from functools import partial
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# Sizes (tokens per forward) the probe times; anything between is interpolated, anything past
# the last is extrapolated linearly from the last two.
TARGET_SIZES = (1, 4, 8, 16, 64)
DRAFT_SIZES = (1, 4, 16, 64)
MIN_GAIN = 1.05  # predicted speedup a speculative setting needs, else the call runs vanilla
DEFAULT_AGREEMENT = 0.5  # before the pair has been measured on 32 prompt positions
MIN_AGREEMENT_TOKENS = 32
# Once a pair's agreement rests on this many prompt positions, later calls reuse it without
# running the two forwards (auto's per-call cost is then a dictionary lookup).
SETTLED_AGREEMENT_TOKENS = 2048
# Work outside the forwards, in units of the target's 1-token forward, fitted on the demo pair at
# batch 1 (`calibrate` below: measured seconds minus the probe's forward times, per round):
# per vanilla step (sampling, emit, commit), per round of any method (tree, accept walk,
# commits), per draft forward (its sampling and cache commit) and per Ouroboros round for the
# pool (lookups, recycling, inserts).
VANILLA_OVERHEAD = 0.18
ROUND_OVERHEAD = 0.1
DRAFT_STEP_OVERHEAD = 0.06
POOL_OVERHEAD = 0.25
# Pool priors: the chance that one pool phrase (or one Jacobi n-gram) for the current key is the
# right continuation, and the chance that each further token of a right phrase is also right;
# fitted to the demo pair's lookahead counters (W 2, N 3, G 2: eta 1.31 over 128-token and 1.47
# over 512-token generations, the pool filling as a generation goes on).
PHRASE_HIT = 0.1
PHRASE_CONTINUES = 0.8

GRID = {
    "gamma": (1, 2, 3, 4, 6, 8, 10, 12),
    "window": (2, 4, 8, 15, 20),
    "ngram": (3, 4, 5, 7),
    "suffixes": (1, 2, 3),
}


# ------------------------------------------------------------------------------------ disk cache
def cache_path() -> Path:
    """$OUROBOROS_JAX_CACHE/auto.json, else ~/.cache/ouroboros_jax/auto.json."""
    root = os.environ.get("OUROBOROS_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ouroboros_jax")
    return Path(root) / "auto.json"


# In-process copy of what this process read or wrote, by cache path: no file reads per call.
_MEMO: dict = {}


def _read_cache() -> dict:
    p = str(cache_path())
    if p not in _MEMO:
        try:
            _MEMO[p] = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            _MEMO[p] = {}
    return _MEMO[p]


def _write_cache(update: dict) -> None:
    """Merges `update` into the cache file atomically; a read-only home just skips caching."""
    p = cache_path()
    data = _read_cache()
    for k, v in update.items():
        data.setdefault(k, {}).update(v)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, p)
    except OSError:
        pass


def model_signature(model) -> str:
    """Shape, dtype and placement of a model: what its forward's cost depends on."""
    cfg = dataclasses.asdict(model.config)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(k, None)
    leaf = model.params["embed"]
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    where = dict(mesh.shape) if mesh is not None else len(getattr(sharding, "device_set", [0]) or [0])
    blob = json.dumps([cfg, str(leaf.dtype), str(where)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def device_kind() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}:{jax.device_count()}"


def batch_bucket(batch: int) -> int:
    return 1 << max(0, (int(batch) - 1).bit_length())


# ------------------------------------------------------------------------------------ latency
def _forward_seconds(model, batch: int, n: int, slots: int, inner: int = 4):
    """A timer (`models.timing.forward_timer`) of n tokens per row at `batch` rows after
    slots/2 cached tokens (at most slots - n) in a cache of `slots` slots."""
    from ..models.timing import forward_timer

    return forward_timer(model, n, max(0, min(slots - n, slots // 2)), slots, batch=batch, inner=inner)


def _latency_key(model, batch: int, slots: int) -> str:
    return f"{device_kind()}|{model_signature(model)}|B{batch_bucket(batch)}|S{slots}"


def _stored_latency(model, batch: int, slots: int, sizes) -> Optional[dict]:
    """The measured {n: seconds} on disk for this device kind, model shape, batch bucket and
    cache size, or None."""
    hit = _read_cache().get("latency", {}).get(_latency_key(model, batch, slots))
    if hit and all(str(n) in hit for n in sizes):
        return {int(k): float(v) for k, v in hit.items()}
    return None


def _measure(timers: dict, reps: int) -> dict:
    """{n: timer} -> {n: seconds}: interleaved rounds, so background load spreads over all sizes
    alike; the fastest round (load from other processes only ever adds time); monotone in n
    (a larger input never costs less: noise can make a measured table dip)."""
    sizes = sorted(timers)
    samples = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            samples[n].append(timers[n]())
    table = {n: float(np.min(v)) for n, v in samples.items()}
    for n_prev, n in zip(sizes, sizes[1:]):
        table[n] = max(table[n], table[n_prev])
    return table


def probe_latency(model, batch: int, slots: int, sizes=TARGET_SIZES, reps: int = 5,
                  use_cache: bool = True) -> dict:
    """{n: seconds per forward} for this model at this batch bucket and cache size, measured now
    (one compile per size); from the disk cache when this device kind has measured this model
    shape before."""
    B = batch_bucket(batch)
    if use_cache:
        hit = _stored_latency(model, B, slots, sizes)
        if hit is not None:
            return hit
    table = _measure({n: _forward_seconds(model, B, n, slots) for n in sizes}, reps)
    if use_cache:
        _write_cache({"latency": {_latency_key(model, B, slots):
                                  {str(n): t for n, t in table.items()}}})
    return table


# A priori device figures for `prior_latency`: (bytes/s read from memory, flop/s of the
# matmuls, seconds of fixed work per layer) by platform. The CPU's are this project's 2-core
# x86 machines (21 GB/s measured by a numpy copy; SmolLM2's 16-token forward about twice its
# 1-token one); the accelerators' are round figures of current parts, whose one effect is that
# t(n) stays nearly flat up to tens of tokens there.
PRIOR_DEVICE = {"cpu": (20e9, 150e9, 30e-6), "gpu": (2e12, 400e12, 10e-6),
                "tpu": (1e12, 200e12, 10e-6)}


def prior_latency(model, batch: int, slots: int, sizes=TARGET_SIZES) -> dict:
    """{n: seconds} predicted from the model's shape alone, before any probe: the weights read
    once per forward plus the cache's live half, at the platform's memory rate, plus the
    matmuls' 2 * params flops per token at its flop rate, plus a fixed cost per layer."""
    cfg = model.config
    leaves = jax.tree.leaves(model.params)
    item = np.dtype(model.params["embed"].dtype).itemsize
    total = sum(int(np.prod(x.shape)) for x in leaves)
    # the LM head is a matmul over V x E; the embedding lookup of an untied model reads a row
    matmul = total - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    bw, flops, per_layer = PRIOR_DEVICE.get(jax.default_backend(), PRIOR_DEVICE["gpu"])
    B = batch_bucket(batch)
    cache = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * (slots // 2) * B * item
    fixed = cfg.num_layers * per_layer + (matmul * item + cache) / bw
    return {n: fixed + 2.0 * matmul * B * n / flops for n in sizes}


class DeferredProbe:
    """The latency probe of one (model, batch bucket, cache size), spread over later calls:
    each `step()` compiles the timer of one more size (a compile is most of a probe's cost);
    the step after the last compile times them all, interleaved, and stores the table on
    disk. So no call pays the whole probe, and the first pays none of it."""

    def __init__(self, model, batch: int, slots: int, sizes):
        self.model, self.batch, self.slots, self.sizes = model, batch_bucket(batch), slots, sizes
        self.timers: dict = {}
        self.table: Optional[dict] = None

    def step(self, reps: int = 5) -> bool:
        """One piece of the probe; True once the table is measured (and stored)."""
        if self.table is not None:
            return True
        missing = [n for n in self.sizes if n not in self.timers]
        if missing:
            self.timers[missing[0]] = _forward_seconds(self.model, self.batch, missing[0],
                                                       self.slots)
            return False
        self.table = _measure(self.timers, reps)
        self.timers = {}  # drop the compiled timers
        _write_cache({"latency": {_latency_key(self.model, self.batch, self.slots):
                                  {str(n): t for n, t in self.table.items()}}})
        return True


class DeferredAgreement:
    """The pair's prompt agreement (`pair_agreement`: two forwards, so two compiles), run on a
    later call's prompts instead of the first call's."""

    def __init__(self, target, draft):
        self.target, self.draft, self.done = target, draft, False

    def step(self, prompt, plens) -> bool:
        if not self.done:
            pair_agreement(self.target, self.draft, prompt, plens)
            self.done = True
        return True


# Probe work not done yet, by key, in the order it was found missing; `_CALLS` numbers the
# auto calls of this process, so a call never advances work it registered itself.
_PENDING: dict = {}
_CALLS = [0]


def _advance_pending(prompt, plens) -> None:
    """One step of the pending probe work registered by earlier calls: the agreement first
    (it moves the choice most), then the latency probes in the order they were found missing."""
    ready = [(k, w) for k, (since, w) in _PENDING.items() if since < _CALLS[0]]
    ready.sort(key=lambda kw: not isinstance(kw[1], DeferredAgreement))
    if ready:
        key, work = ready[0]
        done = work.step(prompt, plens) if isinstance(work, DeferredAgreement) else work.step()
        if done:
            del _PENDING[key]


def finish_probes(token_lists=None) -> None:
    """Completes every pending probe now: the demo and the benches call it after their first
    calls, so that their timed calls measure decoding, not probing. token_lists: prompts (lists
    of token ids) a pending agreement measurement runs on; without them it stays pending."""
    for key, (since, work) in list(_PENDING.items()):
        if isinstance(work, DeferredAgreement):
            if not token_lists:
                continue
            P = max(16, -(-max(len(t) for t in token_lists) // 16) * 16)
            prompt = np.zeros((len(token_lists), P), np.int32)
            for i, t in enumerate(token_lists):
                prompt[i, :len(t)] = t
            plens = np.array([len(t) for t in token_lists], np.int32)
            work.step(jnp.asarray(prompt), jnp.asarray(plens))
        else:
            while not work.step():
                pass
        del _PENDING[key]


def latency_table(model, batch: int, slots: int, sizes, use_cache: bool = True
                  ) -> tuple[dict, bool]:
    """(table {n: seconds}, measured?): the stored measurement when there is one; else, with
    use_cache, `prior_latency` while a `DeferredProbe` measures it over the next calls;
    without use_cache (tests, tune), measured now."""
    if not use_cache:
        return probe_latency(model, batch, slots, sizes, use_cache=False), True
    hit = _stored_latency(model, batch, slots, sizes)
    if hit is not None:
        return hit, True
    key = ("latency", str(cache_path()), _latency_key(model, batch, slots))
    if key not in _PENDING:
        _PENDING[key] = (_CALLS[0], DeferredProbe(model, batch, slots, sizes))
    return prior_latency(model, batch, slots, sizes), False


def _defer_agreement(target, draft) -> None:
    """Once per process and pair, while no speculative call has realised the pair's agreement
    and its prompts' counts have not settled: measure it on a later call's prompts."""
    pair = f"{model_signature(target)}|{model_signature(draft)}"
    key = ("agreement", str(cache_path()), pair)
    if key in _AGREED or realised_agreement(target, draft) is not None:
        return
    if _read_cache().get("agreement", {}).get(pair, [0, 0])[1] >= SETTLED_AGREEMENT_TOKENS:
        return
    _AGREED.add(key)
    _PENDING[key] = (_CALLS[0], DeferredAgreement(target, draft))


_AGREED: set = set()


def known_agreement(target, draft) -> Optional[float]:
    """The pair's agreement from disk without running anything: realised by speculative calls,
    else the prompts' pooled counts; None when neither has been measured."""
    a = realised_agreement(target, draft)
    if a is not None:
        return a
    agree, n = _read_cache().get("agreement", {}).get(
        f"{model_signature(target)}|{model_signature(draft)}", [0, 0])
    if int(n) <= 0:
        return None
    if n < MIN_AGREEMENT_TOKENS:  # shrink a few positions' estimate toward the prior
        w = n / MIN_AGREEMENT_TOKENS
        return w * (agree / n) + (1 - w) * DEFAULT_AGREEMENT
    return agree / n


def lookup(table: dict, n: int) -> float:
    """Seconds at n from a {n: seconds} table (linear between and past measured sizes)."""
    xs = sorted(table)
    ys = [table[x] for x in xs]
    if n <= xs[0]:
        return ys[0]
    if n <= xs[-1]:
        return float(np.interp(n, xs, ys))
    if len(xs) == 1:
        return ys[0]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (n - xs[-1])


# ------------------------------------------------------------------------------------ agreement
@partial(jax.jit, static_argnums=(1, 3))
def _agreement_counts(tparams, tcfg, dparams, dcfg, prompt, plens):
    """(positions where both models' argmax agree, positions) over the real prompt tokens."""
    from ..models import forward

    B, P = prompt.shape
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((P, P), bool)), (B, P, P))
    t = jnp.argmax(forward(tparams, tcfg, prompt, pos, mask)[0], axis=-1)
    d = jnp.argmax(forward(dparams, dcfg, prompt, pos, mask)[0], axis=-1)
    real = jnp.arange(P)[None, :] < plens[:, None]
    return jnp.sum((t == d) & real), jnp.sum(real)


def pair_agreement(target, draft, prompt, plens, use_cache: bool = True) -> tuple[float, int]:
    """(estimated top-1 agreement of the pair, positions it rests on): this call's prompts pooled
    with every earlier call's for the same pair (disk cache)."""
    key = f"{model_signature(target)}|{model_signature(draft)}"
    old = _read_cache().get("agreement", {}).get(key, [0, 0]) if use_cache else [0, 0]
    if int(old[1]) >= SETTLED_AGREEMENT_TOKENS:
        return int(old[0]) / int(old[1]), int(old[1])
    agree, n = (int(x) for x in _agreement_counts(target.params, target.config, draft.params,
                                                   draft.config, prompt, plens))
    if use_cache:
        agree, n = agree + int(old[0]), n + int(old[1])
        _write_cache({"agreement": {key: [agree, n]}})
    if n < MIN_AGREEMENT_TOKENS:  # shrink a few positions' estimate toward the prior
        w = n / MIN_AGREEMENT_TOKENS
        return w * (agree / max(n, 1)) + (1 - w) * DEFAULT_AGREEMENT, n
    return agree / n, n


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


MIN_REALISED_ROUNDS = 64  # speculative rounds before the realised agreement replaces the prompt's


def record_realised(target, draft, stats: dict, gamma: int) -> None:
    """After a speculative call: pool its realised agreement (from eta at this gamma, weighted by
    rounds) with earlier calls' for the pair, on disk."""
    rounds = int(stats.get("target_calls", 0))
    if rounds <= 0 or not stats.get("new_tokens"):
        return
    a = agreement_from_eta(float(stats["eta"]), gamma)
    key = f"{model_signature(target)}|{model_signature(draft)}"
    old = _read_cache().get("realised", {}).get(key, [0.0, 0])
    _write_cache({"realised": {key: [float(old[0]) + a * rounds, int(old[1]) + rounds]}})


def realised_agreement(target, draft) -> Optional[float]:
    key = f"{model_signature(target)}|{model_signature(draft)}"
    s, n = _read_cache().get("realised", {}).get(key, [0.0, 0])
    return s / n if n >= MIN_REALISED_ROUNDS else None


# ------------------------------------------------------------------------------------ the model
def expected_tokens(a: float, gamma: int) -> float:
    """Tokens per round of a chain of gamma draft tokens at per-token agreement a (accepted
    prefix + the target's own token): (1 - a^(gamma+1)) / (1 - a)."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (gamma + 1)) / (1 - a)


def phrase_gain(guesses: int, ngram: int) -> float:
    """Expected extra tokens from the best of `guesses` (N-1)-token phrases for a key: some
    phrase is right with 1 - (1 - PHRASE_HIT)^G, and then each of its tokens after the first
    continues with PHRASE_CONTINUES."""
    hit = 1 - (1 - PHRASE_HIT) ** guesses
    return hit * sum(PHRASE_CONTINUES ** j for j in range(ngram - 1))


@dataclasses.dataclass
class Choice:
    method: str  # the method the call runs: the asked one, or "vanilla" when nothing pays
    config: object
    predicted_speedup: float
    agreement: Optional[float]
    reason: str
    tables: tuple = (None, None)  # (target, draft) latency tables the choice was made with

    def as_stats(self, asked: str) -> dict:
        from .spec import recipe_of

        return {"asked": asked, "method": self.method,
                "config": recipe_of(self.config) if self.config is not None else None,
                "predicted_speedup": round(self.predicted_speedup, 3),
                "agreement": None if self.agreement is None else round(self.agreement, 3),
                "reason": self.reason}


def vanilla_rate(tt):
    return 1.0 / (lookup(tt, 1) * (1 + VANILLA_OVERHEAD))


def speculative_rate(a, gamma, tt, td):
    t_round = (gamma * lookup(td, 1) + lookup(tt, gamma + 1)
               + (ROUND_OVERHEAD + DRAFT_STEP_OVERHEAD * gamma) * lookup(tt, 1))
    return expected_tokens(a, gamma) / t_round


def lookahead_rate(window, ngram, guesses, tt):
    n_t = (window + guesses) * (ngram - 1)
    tokens = 1 + phrase_gain(guesses, ngram)
    # measured: a lookahead round costs no more than the probe's forward of its size (its pool
    # work overlaps the forward's), so no per-round term
    return tokens / lookup(tt, n_t)


def ouroboros_rate(a, gamma, window, ngram, guesses, suffixes, tt, td):
    m = ngram - 1
    n_t = 1 + gamma + suffixes * m
    n_s = (window + guesses) * m
    c = 1 + phrase_gain(guesses, ngram) * a  # draft tokens per draft forward (phrase drafting)
    draft_forwards = gamma / c  # on average: a forward yields 1 to N-1 tokens
    # lengthening: when the whole chain is accepted, one of X pool phrases may go on
    bonus = a ** gamma * (1 - (1 - PHRASE_HIT) ** suffixes) * sum(a ** j for j in range(1, m + 1))
    tokens = expected_tokens(a, gamma) + bonus
    t_round = (draft_forwards * lookup(td, n_s) + lookup(tt, n_t)
               + (ROUND_OVERHEAD + DRAFT_STEP_OVERHEAD * draft_forwards + POOL_OVERHEAD) * lookup(tt, 1))
    return tokens / t_round


def choose(method: str, tt: dict, td: Optional[dict], agreement: Optional[float]) -> Choice:
    """The predicted-fastest config of `method` from latency tables tt (target) and td (draft)
    {n: seconds} and the pair's agreement; vanilla when nothing beats it by MIN_GAIN. The
    candidates and their predicted rates are the method's own (`MethodSpec.auto_grid`,
    `MethodSpec.auto_rate`) over `GRID`."""
    spec = _spec(method)
    candidates = spec.auto_grid(GRID)
    rates = [spec.auto_rate(c, agreement, tt, td) for c in candidates]
    best_rate = max(rates)
    best = candidates[rates.index(best_rate)]  # the first of equals, in grid order
    gain = best_rate / vanilla_rate(tt)
    if gain < MIN_GAIN:
        return Choice("vanilla", None, 1.0, agreement,
                      f"no {method} setting is predicted to beat vanilla here (best {gain:.2f}x): "
                      "speculation is off for this call")
    return Choice(method, best, gain, agreement, f"predicted {gain:.2f}x vanilla")


def predicted_rate(method: str, cfg, tt: dict, td: Optional[dict], a: Optional[float]) -> float:
    """Predicted tokens/s of one config (vanilla's when cfg is None)."""
    if cfg is None:
        return vanilla_rate(tt)
    return _spec(method).auto_rate(cfg, a, tt, td)


def _spec(method: str):
    """The registered MethodSpec of a method `config="auto"` can size."""
    # imported here: the registry imports the method modules, which import this module's rates
    from . import METHODS

    spec = METHODS.get(method)
    if spec is None or spec.auto_grid is None:
        known = sorted(m for m, s in METHODS.items() if s.auto_grid is not None)
        raise ValueError(f"config='auto' knows {', '.join(known)}, not {method!r}")
    return spec


# Choices already made in this process, by (method, models, batch bucket, cache size): a new
# config is a new compiled loop (seconds on a CPU), so a choice is kept until another is
# predicted to be at least STICKY_GAIN faster (e.g. once calls have measured the pair's agreement).
_CHOICES: dict = {}
STICKY_GAIN = 1.10


def auto_config(method: str, target, draft, prompt, plens, slots: int, use_cache: bool = True) -> Choice:
    """Probe (or recall) the latencies and the pair's agreement, then `choose` (keeping this
    process's earlier choice for the same shapes unless the new one is clearly better)."""
    B = int(prompt.shape[0])
    new = _auto_choice(method, target, draft, prompt, plens, slots, use_cache)
    key = (method, model_signature(target), model_signature(draft) if draft is not None else None,
           batch_bucket(B), slots, str(cache_path()))
    old = _CHOICES.get(key)
    if old is not None and old.config != new.config:
        tt, td, a = new.tables + (new.agreement,)
        keep = predicted_rate(old.method, old.config, tt, td, a)
        if predicted_rate(new.method, new.config, tt, td, a) < STICKY_GAIN * keep:
            base = old.reason.split(_A_PRIORI)[0].split(" (kept")[0]
            note = _A_PRIORI if _A_PRIORI in new.reason else ""
            return dataclasses.replace(old, agreement=a, tables=new.tables,
                                       reason=base + " (kept: no other setting is clearly "
                                       "better)" + note)
    _CHOICES[key] = new
    return new


def _auto_choice(method, target, draft, prompt, plens, slots, use_cache) -> Choice:
    """With use_cache (generate's calls): measured tables and agreement from disk where they
    exist, else a prior (`prior_latency`, DEFAULT_AGREEMENT) while the probe runs one piece per
    later call (`DeferredProbe`): a process's first call costs what the method's own compile
    costs, never a probe. Without use_cache everything is measured now."""
    B = int(prompt.shape[0])
    _CALLS[0] += 1
    if use_cache:
        _advance_pending(prompt, plens)
    tt, measured = latency_table(target, B, slots, TARGET_SIZES, use_cache)
    td, a = None, None
    if draft is not None and _spec(method).needs_draft:
        td, d_measured = latency_table(draft, B, slots, DRAFT_SIZES, use_cache)
        measured = measured and d_measured
        if not use_cache:
            a, _ = pair_agreement(target, draft, prompt, plens, use_cache=False)
        else:
            a = known_agreement(target, draft)
            _defer_agreement(target, draft)
            if a is None:
                a, measured = DEFAULT_AGREEMENT, False
    choice = dataclasses.replace(_choose_memo(method, _frozen(tt), _frozen(td), a),
                                 tables=(tt, td))
    if not measured:
        choice = dataclasses.replace(choice, reason=choice.reason + _A_PRIORI)
    return choice


_A_PRIORI = " (a priori: the latency probe and agreement run over the next calls)"


def _frozen(table: Optional[dict]):
    return None if table is None else tuple(sorted(table.items()))


@functools.lru_cache(maxsize=256)
def _choose_memo(method, tt, td, a) -> Choice:
    """`choose` once per (method, tables, agreement): a grid search of a few ms per call is
    not repeated on every `generate` call once the tables and agreement have settled."""
    return choose(method, dict(tt), None if td is None else dict(td), a)
