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
3. **choice** (`choose`): the cost model's predicted rate (decoding/cost.py: the paper's
   expected tokens per round at agreement a and gamma, (1 - a^(gamma+1)) / (1 - a), plus pool
   terms, over the round's predicted time from the latency tables) maximised over each method's
   knob grid (its config's `KNOBS`, decoding/knobs.py); vanilla's rate is 1 / t_T(1) (both
   with the work outside the forwards added). When no
   setting is predicted to beat vanilla by `MIN_GAIN`, speculation is turned off for the call
   (the call runs vanilla, and stats say so).

On an accelerator t_T(n) is nearly flat up to tens or hundreds of tokens, and the choice lands at
large trees (the paper's recipe: gamma ~12, W ~20, N ~7); on a 2-core CPU a forward's cost grows
with every token, and it lands at small trees (what `ouroboros-jax tune` finds there).

This module holds what touches a device or the disk (the probe, the agreement forwards, the
store) and the choice; the arithmetic is the pure cost model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import uuid
import warnings
from functools import partial
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

from ..distributed import broadcast, model_spans_processes
from ..models import causal_mask, forward
from ..models.timing import forward_timer
from ..pool.phrase_pool import shape_fits
from . import METHODS
from .cost import vanilla_rate
from .knobs import recipe_of

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


# ------------------------------------------------------------------------------------ disk cache
# The cache is a hint, never a dependency: every entry read is validated (`_valid_entry`), what
# is invalid is dropped with one warning and the file rewritten without it, and a cache that
# cannot be read or written only costs a re-measurement. Writers merge under an exclusive lock
# on a lock file beside it, re-reading the file inside the lock, so concurrent processes keep
# every entry (and pooled counts add up); each write goes to its own temp file, renamed over
# the cache, and removed when the rename fails.
def cache_path() -> Path:
    """$OUROBOROS_JAX_CACHE/auto.json, else ~/.cache/ouroboros_jax/auto.json."""
    root = os.environ.get("OUROBOROS_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ouroboros_jax")
    return Path(root) / "auto.json"


# In-process copy of what this process read or wrote, by cache path: no file reads per call.
_MEMO: dict = {}
_WARNED: set = set()  # (path, what) pairs already warned about in this process
SECTIONS = ("latency", "agreement", "realised")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _valid_entry(section: str, value) -> bool:
    """Whether one cached value can be used: latency {"n": seconds} with n >= 1 and finite
    seconds > 0; agreement [agreeing, positions] counts with agreeing <= positions; realised
    [sum of per-round agreements, rounds] with 0 <= sum <= rounds."""
    if section == "latency":
        return (isinstance(value, dict) and len(value) > 0
                and all(isinstance(k, str) and k.isdigit() and int(k) >= 1 for k in value)
                and all(_number(v) and v > 0 for v in value.values()))
    if not isinstance(value, list) or len(value) != 2:
        return False
    s, n = value
    if section == "agreement":
        return _count(s) and _count(n) and s <= n
    return _number(s) and _count(n) and 0 <= s <= n  # realised


def _validated(raw) -> tuple[dict, list[str]]:
    """(the usable part of a parsed cache file, descriptions of what was dropped)."""
    if not isinstance(raw, dict):
        return {}, [f"the file holds a JSON {type(raw).__name__}, not an object"]
    data, dropped = {}, []
    for section, entries in raw.items():
        if section not in SECTIONS:
            dropped.append(f"unknown section {section!r}")
            continue
        if not isinstance(entries, dict):
            dropped.append(f"section {section!r} is a {type(entries).__name__}, not an object")
            continue
        good = {k: v for k, v in entries.items() if _valid_entry(section, v)}
        if len(good) < len(entries):
            dropped.append(f"{len(entries) - len(good)} invalid {section} entr"
                           f"{'y' if len(entries) - len(good) == 1 else 'ies'}")
        data[section] = good
    return data, dropped


def _warn_once(path: str, what: str) -> None:
    if (path, what) not in _WARNED:
        _WARNED.add((path, what))
        warnings.warn(f"config='auto' cache {path}: {what}", RuntimeWarning, stacklevel=3)


def _load_file(p: Path) -> tuple[dict, list[str]]:
    """The validated contents of the cache file ({} when absent or unreadable) and what was
    dropped from it."""
    try:
        text = p.read_text()
    except FileNotFoundError:
        return {}, []
    except (OSError, UnicodeDecodeError) as e:
        _warn_once(str(p), f"cannot be read ({type(e).__name__}: {e}); measuring afresh")
        return {}, []
    try:
        raw = json.loads(text)
    except ValueError:
        return {}, ["the file is not valid JSON"]
    return _validated(raw)


def _read_cache() -> dict:
    p = str(cache_path())
    if p not in _MEMO:
        data, dropped = _load_file(Path(p))
        _MEMO[p] = data
        if dropped:  # repaired now, so later processes read a valid file
            _warn_once(p, "ignored and rewrote " + "; ".join(dropped))
            _update_cache(lambda d: None)
    return _MEMO[p]


@contextlib.contextmanager
def _locked(p: Path):
    """An exclusive advisory lock (fcntl.flock) on `<cache>.lock` beside the cache, held while
    a writer re-reads, merges and replaces the file. Where flock does not exist (Windows) the
    writes are still atomic, only concurrent merges may lose an entry."""
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(p.name + ".lock"), "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _replace_atomically(p: Path, text: str) -> None:
    """Writes text to a temp file of its own (unique name: concurrent writers never share one)
    and renames it over p; the temp file is removed whatever fails."""
    tmp = p.with_name(f"{p.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _update_cache(change, path: Optional[Path] = None):
    """Applies change(data) -> result to the cache's current contents under the lock (the file
    re-read inside it, so other processes' entries are kept) and writes the result back;
    returns change's result. The in-process copy follows. A cache that cannot be written
    (read-only home, a directory in its place) is warned about once and otherwise skipped.
    path: the cache file (default: `cache_path()` now)."""
    p = cache_path() if path is None else path
    try:
        with _locked(p):
            data, _ = _load_file(p)
            result = change(data)
            _replace_atomically(p, json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:
        _warn_once(str(p), f"cannot be written ({type(e).__name__}: {e}); results are kept "
                           "for this process only")
        data = _MEMO.get(str(p), {})
        result = change(data)
    _MEMO[str(p)] = data
    return result


def _put(section: str, key: str, value, path: Optional[Path] = None) -> None:
    def change(data):
        data.setdefault(section, {})[key] = value
    _update_cache(change, path)


def _add(section: str, key: str, counts: tuple, zero: tuple) -> list:
    """Adds counts to the entry (pooled with what every process has added before); returns
    the new total."""
    def change(data):
        old = data.setdefault(section, {}).get(key, list(zero))
        new = [type(z)(o + c) for o, c, z in zip(old, counts, zero)]
        data[section][key] = new
        return new
    return _update_cache(change)


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
        _put("latency", _latency_key(model, B, slots), {str(n): t for n, t in table.items()})
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
        # the store whose miss registered the probe: a later step may run while another is
        # in use (a changed $OUROBOROS_JAX_CACHE), and the table belongs where it was missing
        self.path = cache_path()
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
        _put("latency", _latency_key(self.model, self.batch, self.slots),
             {str(n): t for n, t in self.table.items()}, self.path)
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


# ------------------------------------------------------------------------------------ agreement
@partial(jax.jit, static_argnums=(1, 3))
def _agreement_counts(tparams, tcfg, dparams, dcfg, prompt, plens):
    """(positions where both models' argmax agree, positions) over the real prompt tokens."""
    B, P = prompt.shape
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
    mask = causal_mask(B, P)
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
    if use_cache:  # pooled under the lock with what every process has counted
        agree, n = _add("agreement", key, (agree, n), (0, 0))
    if n < MIN_AGREEMENT_TOKENS:  # shrink a few positions' estimate toward the prior
        w = n / MIN_AGREEMENT_TOKENS
        return w * (agree / max(n, 1)) + (1 - w) * DEFAULT_AGREEMENT, n
    return agree / n, n


MIN_REALISED_ROUNDS = 64  # speculative rounds before the realised agreement replaces the prompt's


def record_realised(target, draft, a: float, rounds: int) -> None:
    """After a call: pool the agreement a it realised over `rounds` rounds (what its method's
    `MethodSpec.learn` reports) with earlier calls' for the pair, weighted by rounds, on disk."""
    key = f"{model_signature(target)}|{model_signature(draft)}"
    _add("realised", key, (a * rounds, rounds), (0.0, 0))


def realised_agreement(target, draft) -> Optional[float]:
    key = f"{model_signature(target)}|{model_signature(draft)}"
    s, n = _read_cache().get("realised", {}).get(key, [0.0, 0])
    return s / n if n >= MIN_REALISED_ROUNDS else None


# ------------------------------------------------------------------------------------ the choice
@dataclasses.dataclass
class Choice:
    method: str  # the method the call runs: the asked one, or "vanilla" when nothing pays
    config: object
    predicted_speedup: float
    agreement: Optional[float]
    reason: str
    tables: tuple = (None, None)  # (target, draft) latency tables the choice was made with

    def as_stats(self, asked: str) -> dict:
        return {"asked": asked, "method": self.method,
                "config": recipe_of(self.config) if self.config is not None else None,
                "predicted_speedup": round(self.predicted_speedup, 3),
                "agreement": None if self.agreement is None else round(self.agreement, 3),
                "reason": self.reason}


def fits_pool(cfg, pool_shape: Optional[tuple]) -> bool:
    """Whether a pool of pool_shape (phrases per key, tokens per phrase) can serve cfg: its
    phrases are ngram - 1 tokens and it holds at least `guesses` per key (None: no pool given,
    anything fits; a config without a pool fits any)."""
    if pool_shape is None or not hasattr(cfg, "ngram"):
        return True
    return shape_fits(pool_shape, cfg.guesses, cfg.ngram - 1)


def choose(method: str, tt: dict, td: Optional[dict], agreement: Optional[float],
           pool_shape: Optional[tuple] = None) -> Choice:
    """The predicted-fastest config of `method` from latency tables tt (target) and td (draft)
    {n: seconds} and the pair's agreement; vanilla when nothing beats it by MIN_GAIN. The
    candidates are the method's knob grid (`MethodSpec.auto_grid`, from its config's `KNOBS`)
    and their rates the cost model's (`MethodSpec.rate`, decoding/cost.py); with pool_shape
    (a pool the call passes: phrases per key, tokens per phrase) only those it can serve."""
    spec = _spec(method)
    candidates = [c for c in spec.auto_grid() if fits_pool(c, pool_shape)]
    if not candidates:
        raise ValueError(f"pool: its phrases of {pool_shape[1]} tokens fit no {method} config "
                         "that config='auto' searches; pass the config the pool was made with")
    rates = [spec.rate(c, agreement, tt, td) for c in candidates]
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
    return _spec(method).rate(cfg, a, tt, td)


def _spec(method: str):
    """The registered MethodSpec of a method `config="auto"` can size."""
    spec = METHODS.get(method)
    if spec is None or spec.round_model is None:
        known = sorted(m for m, s in METHODS.items() if s.round_model is not None)
        raise ValueError(f"config='auto' knows {', '.join(known)}, not {method!r}")
    return spec


# Choices already made in this process, by (method, models, batch bucket, cache size): a new
# config is a new compiled loop (seconds on a CPU), so a choice is kept until another is
# predicted to be at least STICKY_GAIN faster (e.g. once calls have measured the pair's agreement).
_CHOICES: dict = {}
STICKY_GAIN = 1.10


def auto_config(method: str, target, draft, prompt, plens, slots: int, use_cache: bool = True,
                pool_shape: Optional[tuple] = None) -> Choice:
    """Probe (or recall) the latencies and the pair's agreement, then `choose` (keeping this
    process's earlier choice for the same shapes unless the new one is clearly better).
    pool_shape: (phrases per key, tokens per phrase) of a pool the call passes, which the
    chosen config must fit (`fits_pool`)."""
    B = int(prompt.shape[0])
    key = (method, model_signature(target), model_signature(draft) if draft is not None else None,
           batch_bucket(B), slots, str(cache_path()), pool_shape)
    if model_spans_processes(target):
        return _auto_spmd(key, method, target, draft, prompt, plens, slots, pool_shape)
    new = _auto_choice(method, target, draft, prompt, plens, slots, use_cache, pool_shape)
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


def _auto_spmd(key, method, target, draft, prompt, plens, slots, pool_shape=None) -> Choice:
    """auto_config over processes (one model on a mesh spanning them): every process runs the
    same probes (collective programs: a process skipping one on a disk-cache hit would leave
    the others waiting), so the disk cache, which differs per host, is not read; process 0's
    choice is broadcast, as timings differ per process and every process must run the same
    loop. Kept for the process's life per shape (the same call history on every process, so
    every process hits or misses together)."""
    old = _CHOICES.get(key)
    if old is None:
        old = broadcast(_auto_choice(method, target, draft, prompt, plens, slots, False,
                                     pool_shape))
        _CHOICES[key] = old
    return old


def _auto_choice(method, target, draft, prompt, plens, slots, use_cache, pool_shape=None
                 ) -> Choice:
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
    choice = dataclasses.replace(_choose_memo(method, _frozen(tt), _frozen(td), a, pool_shape),
                                 tables=(tt, td))
    if not measured:
        choice = dataclasses.replace(choice, reason=choice.reason + _A_PRIORI)
    return choice


_A_PRIORI = " (a priori: the latency probe and agreement run over the next calls)"


def _frozen(table: Optional[dict]):
    return None if table is None else tuple(sorted(table.items()))


@functools.lru_cache(maxsize=256)
def _choose_memo(method, tt, td, a, pool_shape=None) -> Choice:
    """`choose` once per (method, tables, agreement, pool shape): a grid search of a few ms
    per call is not repeated on every `generate` call once the tables and agreement have
    settled."""
    return choose(method, dict(tt), None if td is None else dict(td), a, pool_shape)
