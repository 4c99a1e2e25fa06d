"""`config="auto"`: each method's configuration chosen for the device, models and batch at hand.

A speculative method pays off only where scoring many tokens in one forward costs about what
scoring one costs (an accelerator reading its weights at batch 1), and only as far as the draft
agrees with the target. Both are priced without charging the user's later calls anything:

1. **prices** (`latency_tables`): a forward of n tokens costs t(n) = scale * shape(n). The
   shape is the model's weight bytes and FLOPs at the device's rates (`cost.shape_latency`:
   reads and flops overlapping on an accelerator, adding up on a CPU), the rates a calibration
   of two small matmuls (`calibrate`: bandwidth at 1 row, flop rate at many) measured once per
   device kind and dtype and kept on disk (`cache_path()`). The scales are learned from the
   user's own calls (`record_call`): after each call whose loop compiled nothing, its wall time
   against the price of the forwards it counted, pooled by least squares per pair and batch
   bucket. So the loop's real costs (the LM head and its argmax, the cache writes, the loop's
   own work) enter the prices without a probe, from the second call on;
2. **agreement**: once greedy chain calls have run on the pair (speculative's, or Ouroboros'
   with phrase drafting and lengthening off), the agreement they realised
   (`agreement_from_eta`: the a whose expected tokens per round equal the measured eta,
   pooled over calls by rounds, on disk), by depth where they measured it; before that, the
   share of positions where the draft's and the target's argmax agree over the prompts
   (`pair_agreement`: two forwards, run in the pair's first call only, pooled on disk);
3. **choice** (`choose`): the cost model's predicted rate (decoding/cost.py: the paper's
   expected tokens per round at agreement a and gamma, (1 - a^(gamma+1)) / (1 - a), plus pool
   terms, over the round's predicted time from the latency tables) maximised over each method's
   knob grid (its config's `KNOBS`, decoding/knobs.py); vanilla's rate is 1 / t_T(1) (both
   with the work outside the forwards added). When no setting is predicted to beat vanilla by
   `MIN_GAIN`, speculation is turned off for the call (the call runs vanilla, and stats say
   so). A choice is kept, in the process and on disk for later processes, until another is
   predicted `STICKY_GAIN` faster: a new config costs a compile.

So the first call on a new device pays two matmul compiles, a model's first call its two
anchor timers (`model_anchor`: its 1-token and 8-token forwards), the first call of a pair its
two prompt forwards, and no later call pays a probe; `stats["auto"]` lists what was measured and
what was assumed.

On an accelerator t(n) is nearly flat up to tens or hundreds of tokens, and the choice lands at
large trees (the paper's recipe: gamma ~12, W ~20, N ~7); on a 2-core CPU a forward's cost grows
with every token, and it lands at small trees (what `ouroboros-jax tune` finds there).

This module holds what touches a device or the disk (the calibration, the agreement forwards,
the store, the learning) and the choice; the arithmetic is the pure cost model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import uuid
import warnings
import weakref
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
from ..models.timing import forward_timer, matmul_timer
from ..pool.phrase_pool import shape_fits
from . import METHODS
from .cost import (DepthAgreement, DeviceRates, ModelShape, interpolate,
                   loop_seconds, scaled, shape_latency, vanilla_overhead, vanilla_rate)
from .knobs import recipe_of
from .spec import chain_agreement

# Sizes (tokens per forward) the probe times; anything between is interpolated, anything past
# the last is extrapolated linearly from the last two.
TARGET_SIZES = (1, 4, 8, 16, 64)
DRAFT_SIZES = (1, 4, 16, 64)
# Predicted speedup a speculative setting needs, else the call runs vanilla. While vanilla's
# step overhead counted the LM head twice (VANILLA_STEP_SECONDS in cost.py), vanilla was priced
# 15-30% over its loop against the methods' rounds, and the margins were 1.15 (a
# realised rate) and 1.05 (TRY_GAIN: a rate estimated from the prompts or a prior, which runs
# low: the real pair's prompt argmax agreement 0.84, its chains' realised 0.91 by depth), so
# that a predicted gain within that error ran vanilla. With vanilla priced at its loop (the
# real pair's `pred x` 1.50 for gamma 6, measured 1.59; it was 2.47) the same margins turned
# speculation off on the demo pair, where it measures 1.3-1.6x (predicted 1.13x: first calls
# ran vanilla, and a later switch must pay its compile, `auto_switch.pays_off`). So the
# margins are now what remains of the error: 5% on a realised rate, none before one.
TRY_GAIN = 1.0
MIN_GAIN = 1.05
# A method whose loop fewer than TRY_CALLS calls have timed is tried from UNTIMED_GAIN (the
# first call's settle then keeps it, `auto_switch`): its price rests on anchors timed once, in
# the first call, and one anchor the machine slowed there (the real 1.5B's 2-token forward
# read 1.78 of its shape where it reads 1.25-1.3) priced every speculative round 25% over its
# loop; auto then predicted 0.91x for what measures 1.39-1.59x, ran vanilla, and vanilla's
# calls never teach a method's price. Tried, its calls teach its factor (`method_factor`).
UNTIMED_GAIN = 0.85
TRY_CALLS = 3
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
SECTIONS = ("latency", "agreement", "realised", "device", "timing", "choice", "anchor", "depth",
            "rounds")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _valid_entry(section: str, value) -> bool:
    """Whether one cached value can be used: latency {"n": seconds} with n >= 1 and finite
    seconds > 0; agreement [agreeing, positions] counts with agreeing <= positions; realised
    [sum of per-round agreements, rounds] with 0 <= sum <= rounds; device {"bandwidth",
    "flops"} finite and > 0; timing five finite sums (the two squares >= 0) and a count of
    calls; choice {"method": name, "config": {field: int or bool} or None}; anchor a finite
    ratio > 0; depth 1 to MAX_DEPTH [reached, accepted] counts with accepted <= reached;
    rounds three finite sums >= 0 and a count of calls."""
    if section == "device":
        return (isinstance(value, dict) and set(value) == {"bandwidth", "flops"}
                and all(_number(v) and v > 0 for v in value.values()))
    if section == "anchor":
        return _number(value) and value > 0
    if section == "depth":
        return (isinstance(value, list) and 1 <= len(value) <= MAX_DEPTH and all(
            isinstance(d, list) and len(d) == 2 and _count(d[0]) and _count(d[1])
            and d[1] <= d[0] for d in value))
    if section == "rounds":
        return (isinstance(value, list) and len(value) == 4
                and all(_number(v) and v >= 0 for v in value[:3]) and _count(value[3]))
    if section == "timing":
        return (isinstance(value, list) and len(value) == 6 and all(_number(v) for v in value[:5])
                and value[0] >= 0 and value[2] >= 0 and _count(value[5]))
    if section == "choice":
        cfg = value.get("config", 0) if isinstance(value, dict) else 0
        return (isinstance(value, dict) and set(value) == {"method", "config"}
                and isinstance(value["method"], str)
                and (cfg is None or (isinstance(cfg, dict) and all(
                    isinstance(k, str) and isinstance(v, (int, bool)) for k, v in cfg.items()))))
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
    return _add_all((section, key, counts, zero))[0]


def _add_all(*entries: tuple) -> list:
    """`_add` for several (section, key, counts, zero) entries in one locked write; returns
    their new totals."""
    def change(data):
        out = []
        for section, key, counts, zero in entries:
            old = data.setdefault(section, {}).get(key, list(zero))
            out.append([type(z)(o + c) for o, c, z in zip(old, counts, zero)])
            data[section][key] = out[-1]
        return out
    return _update_cache(change)


# id(embedding leaf) -> {config: signature}: auto reads a model's signature some 37 times a
# call (2-3 ms of `dataclasses.asdict` and hashing on a 0.3 s demo call); dropped with the leaf
_SIGNATURES: dict = {}


def model_signature(model) -> str:
    """Shape, dtype and placement of a model: what its forward's cost depends on. Remembered
    per embedding array and config (a model placed anew has new arrays)."""
    leaf = model.params["embed"]
    known = _SIGNATURES.get(id(leaf))
    if known is None:
        known = _SIGNATURES[id(leaf)] = {}
        weakref.finalize(leaf, _SIGNATURES.pop, id(leaf), None)
    sig = known.get(model.config)
    if sig is None:
        sig = known[model.config] = _signature(model)
    return sig


def _signature(model) -> str:
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


# ------------------------------------------------------------------------------------ compiles
# Programs built in this process, counted from jax's monitoring events: compiled by the backend,
# or read back from jax's persistent compilation cache. A call whose loop was built measured
# the compiler (or the cache) as well as the loop, so it teaches auto nothing.
_COMPILES = [0]
_COMPILE_SECONDS = [0.0, 0.0]  # the backend's compile seconds: in all, and the longest one


def _on_duration(name: str, secs: float, **kw) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1
        _COMPILE_SECONDS[0] += secs
        _COMPILE_SECONDS[1] = max(_COMPILE_SECONDS[1], secs)


def _on_event(name: str, **kw) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compiles() -> int:
    """Programs compiled (or read from the persistent compilation cache) in this process since
    auto was imported."""
    return _COMPILES[0]


def compile_seconds() -> float:
    """Seconds the backend spent compiling in this process (any thread) since auto was
    imported (programs read from the persistent cache add nothing)."""
    return _COMPILE_SECONDS[0]


def longest_compile_seconds() -> float:
    """The longest single compile by the backend in this process so far (0 where every
    program came from the persistent cache)."""
    return _COMPILE_SECONDS[1]


# ------------------------------------------------------------------------------------ latency
# A forward's price is t(n) = scale * anchor(n) * shape(n): the shape from the model's bytes
# and FLOPs at the device's calibrated rates (`shape_table`), the anchor its measured forwards
# of 1, 2 and WIDE_ANCHOR tokens over the shape's prices, read between them (`model_anchor`,
# `anchor_at`, once per device kind and model shape), the scale learned from the user's own
# calls (`record_call`: a call's loop time against the price of the forwards it counted). The
# calibration is two small matmuls, once per device kind and dtype; the anchor three forward
# timers per model; the scale costs no run at all. So a first call pays the calibration and
# the anchors of its models (three compiles each), and no later call, in any process, pays a
# probe.
def _forward_seconds(model, batch: int, n: int, slots: int, inner: int = 4):
    """A timer (`models.timing.forward_timer`) of n tokens per row at `batch` rows after
    slots/2 cached tokens (at most slots - n) in a cache of `slots` slots."""
    return forward_timer(model, n, max(0, min(slots - n, slots // 2)), slots, batch=batch, inner=inner)


# Ends every key whose value came from `models.timing`'s timers: since they read every logit
# and every new K/V (before, one logit let XLA skip the LM head; unread K/V changed the
# projections' fusion), entries timed the old ways are not reused.
TIMED = "kv"


def _latency_key(model, batch: int, slots: int) -> str:
    return f"{device_kind()}|{model_signature(model)}|B{batch_bucket(batch)}|S{slots}|{TIMED}"


def _stored_latency(model, batch: int, slots: int, sizes) -> Optional[dict]:
    """The measured {n: seconds} on disk for this device kind, model shape, batch bucket and
    cache size, or None."""
    hit = _read_cache().get("latency", {}).get(_latency_key(model, batch, slots))
    if hit and all(str(n) in hit for n in sizes):
        return {int(k): float(v) for k, v in hit.items()}
    return None


def _measure(timers: dict, reps: int, rank: int = 0) -> dict:
    """{n: timer} -> {n: seconds}: interleaved rounds, so background load spreads over all sizes
    alike; the fastest round (load from other processes only ever adds time), or with rank r
    the (r+1)-th fastest; monotone in n (a larger input never costs less: noise can make a
    measured table dip)."""
    sizes = sorted(timers)
    samples = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            samples[n].append(timers[n]())
    table = {n: float(sorted(v)[min(rank, len(v) - 1)]) for n, v in samples.items()}
    for n_prev, n in zip(sizes, sizes[1:]):
        table[n] = max(table[n], table[n_prev])
    return table


def probe_latency(model, batch: int, slots: int, sizes=TARGET_SIZES, reps: int = 5,
                  use_cache: bool = True) -> dict:
    """{n: seconds per bare forward} for this model at this batch bucket and cache size,
    measured now (one compile per size), or from the disk cache. Not part of a call's choice:
    a tool for benches and for anyone who wants a model's own table. With one stored,
    `config="auto"` takes its shape instead of the bytes-and-FLOPs one (`shape_table`)."""
    B = batch_bucket(batch)
    if use_cache:
        hit = _stored_latency(model, B, slots, sizes)
        if hit is not None:
            return hit
    table = _measure({n: _forward_seconds(model, B, n, slots) for n in sizes}, reps)
    if use_cache:
        _put("latency", _latency_key(model, B, slots), {str(n): t for n, t in table.items()})
    return table


# The calibration's matmul, by platform: (k, rows): a [rows, k] x [k, k] product timed at 1 row
# (weights streamed: the bandwidth) and at `rows` (the flop rate). A CPU's 64 MB fp32 matrix
# is past its last-level cache; an accelerator's is large enough that one read is not launch
# overhead, and its many rows are compute-bound.
CALIBRATION = {"cpu": (4096, 16)}
ACCELERATOR_CALIBRATION = (8192, 1024)
# On a CPU, what one more token per row adds to a forward, relative to the 1-token forward's
# read, lies between these (measured: 5-9% for fp32 models of 5M to 1.5B parameters, here and in
# llama.cpp); a calibration outside them was disturbed by load, and is clamped into them.
CPU_TOKEN_SHARE = (0.02, 0.25)
# Seconds of fixed work per layer per forward (not measured: small ops and dispatch), and
# whether reads and flops overlap (the roofline) or add up, by platform.
PER_LAYER = {"cpu": 30e-6}
ACCELERATOR_PER_LAYER = 10e-6


def calibrate(dtype, reps: int = 5) -> DeviceRates:
    """This device's `cost.DeviceRates` for weights of `dtype`, measured now: two compiled
    matmul loops (`models.timing.matmul_timer`), timed interleaved, the fastest of reps."""
    platform = jax.default_backend()
    k, rows = CALIBRATION.get(platform, ACCELERATOR_CALIBRATION)
    t = _measure({1: matmul_timer(1, k, dtype), rows: matmul_timer(rows, k, dtype)}, reps)
    bandwidth = k * k * np.dtype(dtype).itemsize / t[1]
    cpu = platform == "cpu"
    if cpu:  # the first row's flops ride along with the read: the rows past it cost the flops
        lo, hi = CPU_TOKEN_SHARE
        share = min(max((t[rows] - t[1]) / ((rows - 1) * t[1]), lo), hi)
        flops = 2.0 * k * k / (share * t[1])
    else:
        flops = 2.0 * rows * k * k / t[rows]
    return DeviceRates(bandwidth, flops, PER_LAYER.get(platform, ACCELERATOR_PER_LAYER),
                       overlap=not cpu)


def _device_key(dtype) -> str:
    return f"{device_kind()}|{np.dtype(dtype).name}"


def device_rates(dtype, use_cache: bool = True) -> tuple[DeviceRates, bool]:
    """(this device's rates for dtype, whether they were calibrated by this call): from disk
    when this device kind has been calibrated for dtype before, else measured now and kept."""
    platform = jax.default_backend()
    if use_cache:
        hit = _read_cache().get("device", {}).get(_device_key(dtype))
        if hit is not None:
            return DeviceRates(hit["bandwidth"], hit["flops"],
                               PER_LAYER.get(platform, ACCELERATOR_PER_LAYER),
                               overlap=platform != "cpu"), False
    rates = calibrate(dtype)
    if use_cache:
        _put("device", _device_key(dtype), {"bandwidth": rates.bandwidth, "flops": rates.flops})
    return rates, True


def model_shape(model) -> ModelShape:
    """The model's `cost.ModelShape` from its config and params (abstract params do)."""
    cfg = model.config
    item = np.dtype(model.params["embed"].dtype).itemsize
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params))
    # the LM head is a matmul over V x E; the embedding lookup of an untied model reads a row
    matmul = total - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item
    return ModelShape(matmul * item, matmul, cfg.num_layers, kv)


def shape_table(model, batch: int, slots: int, sizes, rates: DeviceRates) -> dict:
    """{n: seconds} of the model's forward before any scale: its own stored table when one was
    measured (`probe_latency`), else `cost.shape_latency` of its shape at the device's rates
    after slots/2 cached tokens."""
    hit = _stored_latency(model, batch, slots, sizes)
    if hit is not None:
        return hit
    return shape_latency(model_shape(model), rates, batch_bucket(batch), slots // 2, sizes)


# A-priori device figures (bytes/s, flop/s), for `prior_latency`: what a platform's forward
# looks like before its calibration (tests of the choice's shape; the bench's projections).
PRIOR_DEVICE = {"cpu": (20e9, 150e9), "gpu": (2e12, 400e12), "tpu": (1e12, 200e12)}


def prior_latency(model, batch: int, slots: int, sizes=TARGET_SIZES) -> dict:
    """{n: seconds} predicted from the model's shape and the platform's a-priori figures
    (`PRIOR_DEVICE`), nothing measured."""
    platform = jax.default_backend()
    bw, flops = PRIOR_DEVICE.get(platform, PRIOR_DEVICE["gpu"])
    rates = DeviceRates(bw, flops, PER_LAYER.get(platform, ACCELERATOR_PER_LAYER),
                        overlap=platform != "cpu")
    return shape_latency(model_shape(model), rates, batch_bucket(batch), slots // 2, sizes)


# ------------------------------------------------------------------------------------ learning
# What the user's calls teach: for each (device, pair, batch bucket), least-squares sums over
# the calls that compiled nothing of y = s_T * x_T + s_S * x_S, with y a call's measured
# seconds and x_T, x_S the unscaled price of the target's and the draft's forwards it counted
# (prefill included): [x_T^2, x_T x_S, x_S^2, x_T y, x_S y, calls].
def _timing_key(target, draft, batch: int) -> str:
    d = model_signature(draft) if draft is not None else "-"
    # "anchored": sums of prices from anchored tables (`model_anchor`); older sums priced the
    # bare shapes and would mis-scale these; TIMED: priced from anchors timed the current way;
    # "anchors": forwards priced at anchors timed at these sizes (before: 1 and 8 tokens)
    return (f"{device_kind()}|{model_signature(target)}|{d}|B{batch_bucket(batch)}"
            f"|anchored|{TIMED}|anchors{'-'.join(map(str, ANCHOR_SIZES))}")


# Two scales are fitted only where the calls' draft shares differ enough: 1 - rho^2 of their
# (x_T, x_S) above SEPARATION (vanilla calls beside speculative ones, or chains of 1 and 6).
# Calls of one config differ only by their prompts' prefills (1 - rho^2 of 0.01 on the real
# pair's γ 4 and γ 6 calls), and there a few % of noise in the wall clock moved the split to
# target x0.16, draft x2.32: auto then priced every round at a third of vanilla and ran vanilla.
SEPARATION = 0.1
# and a split further than this from the one common scale is noise, not a measurement
MAX_SPLIT = 2.0


# Beside the target's own calls, the draft's scale rests on the calls that ran it; one such
# call fixes it exactly, noise and all. On the real Qwen pair one first call 19% over its price
# (after 11 vanilla calls) gave the draft x1.37 against the target's x1.08, and auto priced
# every gamma under vanilla. Fewer pair calls than this: one scale for both.
MIN_SPLIT_CALLS = 3


def common_scale(sums) -> float:
    """The one scale for both models that prices the calls' forwards at their measured time,
    least squares (`solve_scales`' sums; calls present)."""
    tt, ts, ss, ty, sy, _ = sums
    return (ty + sy) / (tt + 2 * ts + ss)


def solve_scales(sums) -> tuple[float, float, bool]:
    """(s_T, s_S, separated) from the least-squares sums: the scales that price the calls'
    counted forwards at their measured time. Calls whose draft shares are too alike to tell
    the two models apart (`SEPARATION`), or a split past MAX_SPLIT of the common scale, give
    one scale for both (`separated` False: the ratio is the shape's, assumed). No calls:
    (1, 1, False)."""
    tt, ts, ss, ty, sy, n = sums
    if n <= 0 or tt <= 0:
        return 1.0, 1.0, False
    if ss <= 0:  # the draft never ran: its scale follows the target's
        s = ty / tt
        return s, s, False
    one = common_scale(sums)
    det = tt * ss - ts * ts
    if det <= SEPARATION * tt * ss:
        return one, one, False
    s_t, s_s = (ss * ty - ts * sy) / det, (tt * sy - ts * ty) / det
    if not all(one / MAX_SPLIT <= x <= one * MAX_SPLIT for x in (s_t, s_s)):
        return one, one, False
    return s_t, s_s, True


def learned_scales(target, draft, batch: int) -> tuple[float, float, int, bool]:
    """(s_T, s_S, calls learned from, separated) for this pair and batch bucket: `solve_scales`
    over the sums of the pair's calls and of the target's calls without the draft (vanilla,
    lookahead, prompt lookup, or speculation turned off), which price the target alone; one
    scale for both while fewer than MIN_SPLIT_CALLS calls ran the draft."""
    timing = _read_cache().get("timing", {})
    sums = list(timing.get(_timing_key(target, None, batch), [0.0] * 5 + [0]))
    pair_calls = 0
    if draft is not None:
        pair = timing.get(_timing_key(target, draft, batch), [0.0] * 5 + [0])
        sums = [a + b for a, b in zip(sums, pair)]
        pair_calls = int(pair[5])
    if sums[5] <= 0:
        return 1.0, 1.0, 0, False
    s_t, s_s, sep = solve_scales(sums)
    if sep and pair_calls < MIN_SPLIT_CALLS:
        s_t = s_s = common_scale(sums)
        sep = False
    return s_t, s_s, int(sums[5]), sep


def call_parts(method: str, cfg, stats: dict, prompt_len: int, tt: dict, td: Optional[dict],
               agreement: Optional[float]) -> tuple[float, float]:
    """(x_T, x_S): the unscaled price of a finished call's counted forwards, by model: its
    prefill (the padded prompt, through both models when the method ran the draft) and its
    loop (`cost.loop_seconds` over stats' target and draft forwards, each target forward with
    its round's work outside the forwards)."""
    if method == "vanilla":
        sizes, overhead, drafts = (1, 0, 0), vanilla_overhead(tt), 0.0
    else:
        spec = METHODS[method]
        sizes = spec.forward_sizes(cfg)
        overhead = spec.round_model(cfg, chain_agreement(agreement, cfg)).overhead
        drafts = float(stats["draft_calls"])
    x_t, x_s = loop_seconds(sizes, overhead, float(stats["target_calls"]), drafts, tt, td)
    x_t += interpolate(tt, prompt_len)
    if drafts:
        x_s += interpolate(td, prompt_len)
    return x_t, x_s


def record_call(method: str, cfg, target, draft, stats: dict, seconds: float, batch: int,
                prompt_len: int, slots: int, agreement: Optional[float] = None) -> None:
    """After a `config="auto"` call that compiled nothing: what it teaches about this device's
    prices. method / cfg: what ran (auto's choice); stats: its counters (`summarize_stats`);
    seconds: its loop's wall time (prefill to fetched result); prompt_len: the padded prompt
    length; slots: the cache size auto chose with. Pooled on disk with every earlier call's."""
    if seconds <= 0 or not math.isfinite(seconds):
        return
    used_draft = method != "vanilla" and draft is not None and METHODS[method].needs_draft
    tt, td, _ = _base_tables(target, draft if used_draft else None, batch, slots, True)
    x_t, x_s = call_parts(method, cfg, stats, prompt_len, tt, td, agreement)
    if x_t <= 0:
        return
    y = float(seconds)
    used = draft if used_draft else None
    key = _timing_key(target, used, batch)
    y_f = _clipped(y, x_t, x_s, target, used, batch, method)  # (at the prices before it)
    # one locked write of the store for both entries
    _add_all(("timing", key, (x_t * x_t, x_t * x_s, x_s * x_s, x_t * y, x_s * y, 1),
              (0.0, 0.0, 0.0, 0.0, 0.0, 0)),
             ("rounds", f"{key}|{method}", (x_t, x_s, y_f, 1), (0.0, 0.0, 0.0, 0)))


def _clipped(y: float, x_t: float, x_s: float, target, draft, batch: int, method: str) -> float:
    """A call's measured seconds as its method's factor pools them: within FACTOR_CLIP of what
    the factor so far predicts, once FACTOR_CLIP_CALLS calls back it (one call the machine
    stalled, 2.2x its row's median on the demo pair, moved Ouroboros' factor 10%)."""
    f, n = method_factor(target, draft, batch, method)
    if n < FACTOR_CLIP_CALLS:
        return y
    s_t, s_s, _, _ = learned_scales(target, draft, batch)
    expect = f * (s_t * x_t + s_s * x_s)
    return min(max(y, expect / FACTOR_CLIP), expect * FACTOR_CLIP)


# The learned scales price each model's forwards; what is left between a method's priced and
# measured loop is its own work outside the forwards, which the round models price from a fit
# on one pair (`cost.ROUND_OVERHEAD`, `VANILLA_STEP_SECONDS`): on the demo pair prompt lookup's
# rounds measure 0.89 of their price against vanilla's steps (5.63 ms for a 5-token round
# priced 5.00, vanilla's 5.25 priced 4.60, t(1) 3.70 ms), so auto priced the 1.13-1.26x it
# measures at 1.01-1.03x, under the margin, and ran vanilla. So each method's timed calls teach
# a factor of their own over the scaled price, pooled with one call at the price (a first call
# moves it half way; a noisy call cannot lock a method out).
FACTOR_PRIOR_CALLS = 1
FACTOR_CLIP, FACTOR_CLIP_CALLS = 1.25, 2


def method_factor(target, draft, batch: int, method: str) -> tuple[float, int]:
    """(factor, calls): what `method`'s timed calls of this pair measured over their price at
    the learned scales (`learned_scales`), pooled with FACTOR_PRIOR_CALLS calls at their price;
    (1.0, 0) before any. draft: the draft the method runs, None without one."""
    key = f"{_timing_key(target, draft, batch)}|{method}"
    x_t, x_s, y, n = _read_cache().get("rounds", {}).get(key, (0.0, 0.0, 0.0, 0))
    s_t, s_s, _, _ = learned_scales(target, draft, batch)
    priced = s_t * x_t + s_s * x_s
    if n <= 0 or priced <= 0:
        return 1.0, 0
    prior = FACTOR_PRIOR_CALLS * priced / n
    return (y + prior) / (priced + prior), int(n)


def relative_factor(target, draft, batch: int, method: str) -> tuple[float, int, int]:
    """(factor of `method` over vanilla's, method's timed calls, vanilla's): what auto divides
    a config's predicted speedup by (`predicted_speedup`'s price_factor)."""
    used = draft if METHODS[method].needs_draft else None
    f_m, n_m = method_factor(target, used, batch, method)
    f_v, n_v = method_factor(target, None, batch, "vanilla")
    return f_m / f_v, n_m, n_v


def prices_known(target, draft, batch: int) -> bool:
    """Whether this device's rates and these models' anchors are on disk, so a call can be
    priced without measuring anything (`record_call` from a call with an explicit config)."""
    data = _read_cache()
    models = [m for m in (target, draft) if m is not None]
    return (all(_device_key(m.params["embed"].dtype) in data.get("device", {}) for m in models)
            and all(_anchor_key(m, batch, n) in data.get("anchor", {})
                    for m in models for n in ANCHOR_SIZES))


def _anchor_key(model, batch: int, n: int = 1) -> str:
    wide = "" if n == 1 else f"|T{n}"
    return f"{device_kind()}|{model_signature(model)}|B{batch_bucket(batch)}|{TIMED}{wide}"


# The sizes a model's anchor times. A multi-token forward runs other kernels than the 1-token
# one (a matrix product, not a matrix-vector one), and on this CPU costs more than its shape
# prices from the 1-token forward, by a factor that falls as the forward widens: measured over
# the shape anchored at t(1), the real Qwen 1.5B's forwards of 3 / 5 / 7 / 9 tokens cost
# 1.23 / 1.15 / 1.13 / 1.11x; the demo target's 2 / 3 / 4 / 5 / 6 / 8 tokens 1.18 / 1.10 /
# 1.08 / 1.00 / 0.98 / 0.98x its shape anchored at t(8) (a jump from 1 to 2 tokens, then
# nearly flat to 8). So the factor is timed at 1, 2 and WIDE_ANCHOR tokens and read between
# 2 and WIDE_ANCHOR linearly in log n (`anchor_at`): within 5% on both from 2 to 9 tokens,
# where one wide anchor at 8 priced the demo target's 2-token forward 15% low and drew auto's
# speculative choice to gamma 1 (1.19x vanilla measured, gamma 4 1.32x).
WIDE_ANCHOR = 8
ANCHOR_SIZES = (1, 2, WIDE_ANCHOR)


def model_anchor(model, batch: int, slots: int, rates: DeviceRates, use_cache: bool = True
                 ) -> tuple[tuple, bool]:
    """((a_1, a_2, a_w), whether they were measured by this call): this model's measured
    forwards of `ANCHOR_SIZES` tokens over its shape's prices at `rates`, from disk when this
    model's shape was timed on this device kind at this batch bucket before, else timed now
    (three compiles) and kept. Keyed without the cache size, so a model is timed once per
    device, in its first call, whatever shapes follow.

    Why: the shape prices weights and FLOPs, but a small model's fixed work per layer weighs
    more than its bytes say, and a call's scale learned from one config cannot tell the
    target's share from the draft's. On the real Qwen pair here the 0.5B draft's forward is
    about 0.47 of the 1.5B's, where their shapes say 0.34: priced by shape, long drafts looked
    cheap (auto chose gamma 12 where 6 ran 1.4x faster). And a forward of several tokens is
    not the 1-token one's shape away from it (`ANCHOR_SIZES`)."""
    keys = tuple(_anchor_key(model, batch, n) for n in ANCHOR_SIZES)
    if use_cache:
        hits = [_read_cache().get("anchor", {}).get(k) for k in keys]
        if all(h is not None for h in hits):
            return tuple(float(h) for h in hits), False
    B = batch_bucket(batch)
    priced = shape_latency(model_shape(model), rates, B, slots // 2, ANCHOR_SIZES)
    # the second fastest of 5, interleaved (load from other processes only ever adds time; one
    # of 3 moved the demo target's anchor between 1.6 and 3.3 on a shared 2-core machine). Not
    # the fastest: the real Qwen 1.5B's 1-token timer once read 187 ms in one round of five
    # whose median was 234 (its decode step: 222), an anchor 20% low that the vanilla calls'
    # learned scale then carried onto every wider forward, pricing speculation under vanilla
    timed = _measure({n: _forward_seconds(model, B, n, slots) for n in ANCHOR_SIZES}, 5, rank=1)
    ratios = tuple(timed[n] / priced[n] for n in ANCHOR_SIZES)
    if use_cache:
        for k, r in zip(keys, ratios):
            _put("anchor", k, r)
    return ratios, True


def anchor_at(anchor: tuple, n: int) -> float:
    """A model's anchor factor at n tokens from its factors at `ANCHOR_SIZES` (a_1, a_2, a_w):
    a_1 at one token, a_w from WIDE_ANCHOR tokens on, and between 2 and WIDE_ANCHOR linear in
    log n from a_2 to a_w."""
    a_1, a_2, a_w = anchor
    if n <= 1:
        return a_1
    if n >= WIDE_ANCHOR:
        return a_w
    f = math.log(n / 2) / math.log(WIDE_ANCHOR / 2)
    return a_2 + (a_w - a_2) * f


def anchored(table: dict, anchor: tuple) -> dict:
    """A shape table {n: seconds} priced at a model's anchor factors (`anchor_at`)."""
    return {n: t * anchor_at(anchor, int(n)) for n, t in table.items()}


def _base_tables(target, draft, batch: int, slots: int, use_cache: bool
                 ) -> tuple[dict, Optional[dict], list]:
    """The unscaled (target, draft) tables and the anchors applied ([target's, draft's], each
    (a_1, a_2, a_w)): `shape_table` at the calibrated rates, each forward scaled by the
    model's measured forwards of `ANCHOR_SIZES` tokens (`model_anchor`, `anchor_at`; a table
    probed whole, `probe_latency`, is used as measured: anchors 1). The shape is also priced
    at the anchors' sizes and at 3 tokens, where the anchor factor bends."""
    tables, anchors = [], []
    for model, sizes in ((target, TARGET_SIZES), (draft, DRAFT_SIZES)):
        if model is None:
            tables.append(None)
            continue
        rates, _ = device_rates(model.params["embed"].dtype, use_cache)
        anchor = (1.0, 1.0, 1.0)
        if _stored_latency(model, batch, slots, sizes) is None:
            sizes = tuple(sorted(set(sizes) | set(ANCHOR_SIZES) | {3}))
            anchor = model_anchor(model, batch, slots, rates, use_cache)[0]
        tables.append(anchored(shape_table(model, batch, slots, sizes, rates), anchor))
        anchors.append(anchor)
    return tables[0], tables[1], anchors


def latency_tables(target, draft, batch: int, slots: int, use_cache: bool = True
                   ) -> tuple[dict, Optional[dict], dict]:
    """(target table, draft table or None, notes): the prices a choice is made with, `shape_table`
    times the learned scales (`learned_scales`; none without use_cache), and notes = {"measured":
    [...], "assumed": [...]}: what stands behind them, for `stats["auto"]`."""
    rates, now = device_rates(target.params["embed"].dtype, use_cache)
    tt, td, anchors = _base_tables(target, draft, batch, slots, use_cache)
    measured = [f"device: {rates.bandwidth / 1e9:.1f} GB/s, {rates.flops / 1e9:.0f} GFLOP/s "
                f"(two matmuls, {'calibrated in this call' if now else 'stored'})",
                f"each model's forwards of {' / '.join(map(str, ANCHOR_SIZES))} tokens, timed "
                "once on this device: " + ", ".join(
                    f"{who} " + " / ".join(f"x{x:.2f}" for x in a)
                    for who, a in zip(("target", "draft"), anchors)) + " their shape's prices"]
    assumed = ["each forward's t(T) shaped by its weight bytes and FLOPs at those rates, "
               f"plus {rates.per_layer * 1e6:.0f} us per layer, scaled to its measured "
               f"t({'), t('.join(map(str, ANCHOR_SIZES))}) and between 2 and {WIDE_ANCHOR} "
               "tokens by a factor read between those (linear in log T)"]
    s_t, s_s, calls = 1.0, 1.0, 0
    if use_cache:
        s_t, s_s, calls, separated = learned_scales(target, draft, batch)
    if calls:
        measured.append(f"loop time of {calls} earlier call{'s' if calls > 1 else ''}: "
                        f"target x{s_t:.2f}" + (f", draft x{s_s:.2f}" if draft is not None else ""))
        if draft is not None and not separated:
            assumed.append("the draft's share of a round as its shape gives it (no calls of "
                           "other configs have told the two apart)")
    else:
        assumed.append("no earlier call: prices at the calibrated rates, unscaled")
    return (scaled(tt, _steps(s_t)), scaled(td, _steps(s_s)),
            {"measured": measured, "assumed": assumed})


def _steps(scale: float, step: float = 1.02) -> float:
    """scale rounded to a power of `step`: prices that moved by less than a step between calls
    are the same prices, so the grid search is not repeated (`_choose_memo`)."""
    return step ** round(math.log(scale) / math.log(step))


_AGREED: set = set()  # (store, pair) whose prompt agreement this process measured


def known_agreement(target, draft):
    """The pair's agreement from disk without running anything: realised by greedy chain calls
    (by depth where they measured it, `depth_agreement`), else the prompts' pooled counts;
    None when neither has been measured."""
    a = depth_agreement(target, draft) or realised_agreement(target, draft)
    if a is not None:
        return a
    key = f"{model_signature(target)}|{model_signature(draft)}"
    agree, n = _read_cache().get("agreement", {}).get(key, [0, 0])
    if int(n) <= 0:
        return None
    if n < MIN_AGREEMENT_TOKENS:  # shrink a few positions' estimate toward the prior
        w = n / MIN_AGREEMENT_TOKENS
        return partly_realised(w * (agree / n) + (1 - w) * DEFAULT_AGREEMENT, key)
    return partly_realised(agree / n, key)


def partly_realised(prompt_estimate: float, key: str) -> float:
    """The prompts' agreement moved toward what fewer than MIN_REALISED_ROUNDS rounds of
    earlier calls realised, by their share of MIN_REALISED_ROUNDS (unchanged without any).

    Why: the prompts' argmax agreement runs low (the real Qwen pair: 0.64 over two short code
    prompts, where its chains realise 0.92), and a first call that explored gamma 4 over 64
    tokens ran 15 rounds, one short of both thresholds; priced at the prompts' 0.64 every
    later call ran vanilla (predicted 0.86x), so the pair never realised the rounds that
    would have corrected it."""
    s, rounds = realised_counts(key)
    if rounds <= 0:
        return prompt_estimate
    w = min(1.0, rounds / MIN_REALISED_ROUNDS)
    return w * (s / rounds) + (1 - w) * prompt_estimate

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


# speculative rounds before the realised agreement replaces the prompt's: one 64-token call at
# gamma <= 1 realises 32 or more, so the end of a first call can plan with it (`auto_switch`)
MIN_REALISED_ROUNDS = 32


def _realised_key(target, draft, method: Optional[str] = None) -> str:
    """The store's key of what calls realised: a pair's agreement, or, for a method without a
    draft (prompt lookup: its copy hit rate), that method's on this target."""
    return f"{model_signature(target)}|{model_signature(draft) if draft is not None else method}"


def record_realised(target, draft, a: float, rounds: int, depth: Optional[list] = None,
                    method: Optional[str] = None) -> None:
    """After a call: pool the agreement a it realised over `rounds` rounds (what its method's
    `MethodSpec.learn` reports) with earlier calls' for the pair, weighted by rounds, on disk;
    and its acceptance by depth (`cost.depth_counts`: [reached, accepted] per depth of its
    chain) with theirs, depth by depth. Without a draft: the method's own rate (its `learn`'s,
    e.g. prompt lookup's copy hit rate) on this target, keyed by `method`."""
    key = _realised_key(target, draft, method)

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
    _update_cache(change)


# A depth of the chain is planned with its own measured agreement once this many rounds have
# reached it; deeper ones with the pooled agreement of every depth past the first.
MIN_DEPTH_ROUNDS = 16
MAX_DEPTH = 64
# A greedy call whose chosen chain is shorter than this, for a pair whose depths past the first
# have not been measured, drafts this deep instead (`explore`): a 1-token chain measures the
# first token's agreement only, which on pairs whose agreement comes in runs underprices every
# longer chain. Not past EXPLORE_ROUNDS rounds of the pair (a pair that rarely passes its first
# token is not explored for ever).
EXPLORE_DEPTH = 4
EXPLORE_ROUNDS = 128


def _depth_counts(target, draft) -> list:
    return _read_cache().get("depth", {}).get(
        f"{model_signature(target)}|{model_signature(draft)}", [])


def depth_agreement(target, draft) -> Optional[DepthAgreement]:
    """The pair's agreement by depth from disk (`cost.DepthAgreement`): each depth from the
    first on that MIN_DEPTH_ROUNDS rounds have reached, and past them the pooled agreement of
    every depth past the first (the first's where they are not measured yet); None until the
    first depth is measured."""
    counts = _depth_counts(target, draft)
    if not counts or counts[0][0] < MIN_DEPTH_ROUNDS:
        return None
    by_depth = []
    for reached, accepted in counts:
        if reached < MIN_DEPTH_ROUNDS:
            break
        by_depth.append(round(accepted / reached, 2))
    deep_r, deep_a = (sum(c[i] for c in counts[1:]) for i in (0, 1))
    # to 2 decimals (a chain's tokens move by under 1%): the choice is searched again only
    # when the agreement has moved that much (`_choose_memo`)
    beyond = round(deep_a / deep_r, 2) if deep_r >= MIN_DEPTH_ROUNDS else by_depth[-1]
    return DepthAgreement(tuple(by_depth), beyond)


def _teaches(method: str, cfg) -> bool:
    """Whether a greedy call of `cfg` teaches auto the pair's agreement (its method's `learn`
    reads a call of one round; Ouroboros' only where its round is a plain chain)."""
    learn = METHODS[method].learn
    one_round = {"target_calls": 1, "new_tokens": 1, "eta": 1.0, "acceptance_histogram": [0, 1]}
    return learn is not None and learn(cfg, one_round, True) is not None


def explore(choice: "Choice", target, draft, asked: Optional[str] = None,
            pool_shape: Optional[tuple] = None) -> "Choice":
    """The choice a greedy call that teaches auto runs: `choice`, or, where it drafts a chain
    shorter than EXPLORE_DEPTH and the pair's depths past the first are not measured yet, the
    same config with a chain of EXPLORE_DEPTH, so that the next choice is priced with the
    agreement of every depth it weighs (a first call at gamma 1 would otherwise settle there).

    Where `choice` is vanilla for a drafting method (`asked`) whose pair has never been
    measured on its own outputs, the call runs the method's best-priced config that teaches
    (`_teaches`) at a chain of EXPLORE_DEPTH instead: the only agreement known then is the
    prompts' argmax one, and on chat prompts that is the template's. The real Qwen pair read
    0.41 on one chat prompt's 39 positions (its outputs realise 0.91-0.94), was priced at
    0.75x vanilla, ran vanilla, and as vanilla teaches nothing, ran vanilla for ever."""
    cfg = choice.config
    off = cfg is None and asked is not None
    short = (cfg is not None and _teaches(choice.method, cfg)
             and getattr(cfg, "gamma", EXPLORE_DEPTH) < EXPLORE_DEPTH)
    if draft is None or not (off or short):
        return choice
    counts = _depth_counts(target, draft)  # read only where a case applies
    if (sum(c[0] for c in counts[1:]) >= MIN_DEPTH_ROUNDS
            or (counts and counts[0][0] >= EXPLORE_ROUNDS)):
        return choice
    if off:
        return _explore_method(choice, asked, pool_shape)
    return dataclasses.replace(
        choice, config=dataclasses.replace(cfg, gamma=EXPLORE_DEPTH),
        reason=choice.reason + f" (exploring: a chain of {EXPLORE_DEPTH} measures the pair's "
        "agreement past the first token; later calls run the choice priced with it)")


def _explore_method(choice: "Choice", method: str, pool_shape: Optional[tuple]) -> "Choice":
    """`explore`'s vanilla case: the best-priced config of `method` whose greedy calls teach
    (among those a passed pool can serve, `_candidates`), at a chain of at least
    EXPLORE_DEPTH; `choice` itself where the method has none."""
    spec = METHODS.get(method)
    if spec is None or not spec.needs_draft or spec.learn is None:
        return choice
    teach = [c for c in _candidates(spec, pool_shape) if _teaches(method, c)]
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


def realised_counts(key: str) -> tuple:
    """(sum of realised agreement x rounds, rounds) pooled on disk under a `_realised_key`
    ((0.0, 0) before any call)."""
    s, n = _read_cache().get("realised", {}).get(key, [0.0, 0])
    return s, n


def realised_agreement(target, draft, method: Optional[str] = None) -> Optional[float]:
    key = _realised_key(target, draft, method)
    s, n = realised_counts(key)
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
    # {"measured": [...], "assumed": [...]}: what stands behind the prices and the agreement
    notes: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0  # host time auto took in this call (calibration, agreement, search)
    # the method's rounds' learned cost over their price, relative to vanilla's steps'
    # (`relative_factor`): the predicted speedups above are divided by it
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
                "seconds": round(self.seconds, 4)}


def fits_pool(cfg, pool_shape: Optional[tuple]) -> bool:
    """Whether a pool of pool_shape (phrases per key, tokens per phrase) can serve cfg: its
    phrases are ngram - 1 tokens and it holds at least `guesses` per key (None: no pool given,
    anything fits; a config without a pool fits any)."""
    if pool_shape is None or not hasattr(cfg, "ngram"):
        return True
    return shape_fits(pool_shape, cfg.guesses, cfg.ngram - 1)


def _candidates(spec, pool_shape: Optional[tuple]) -> list:
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
    calls have timed it: `_auto_choice`). The
    candidates are the method's knob grid (`MethodSpec.auto_grid`, from its config's `KNOBS`)
    and their rates the cost model's (`MethodSpec.rate`, decoding/cost.py); with pool_shape
    (a pool the call passes: phrases per key, tokens per phrase) only those it can serve;
    price_factor: the method's rounds' measured cost over their price relative to vanilla's
    (`relative_factor`), dividing every config's predicted speedup."""
    spec = _spec(method)
    candidates = _candidates(spec, pool_shape)
    if not candidates:
        raise ValueError(f"pool: its phrases of {pool_shape[1]} tokens fit no {method} config "
                         "that config='auto' searches; pass the config the pool was made with")
    tt, td = dense_tables({spec.forward_sizes(c) for c in candidates}, tt, td)
    rates = [spec.rate(c, agreement, tt, td) for c in candidates]
    best_rate = max(rates)
    best = candidates[rates.index(best_rate)]  # the first of equals, in grid order
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
    return _spec(method).rate(cfg, a, tt, td)


def predicted_speedup(method: str, cfg, tt: dict, td: Optional[dict], a: Optional[float],
                      price_factor: float = 1.0) -> float:
    """`predicted_rate` over vanilla's at the same tables (1 for vanilla), over price_factor
    (the method's rounds' learned factor over vanilla's, `relative_factor`)."""
    if cfg is None or method == "vanilla":
        return 1.0
    return predicted_rate(method, cfg, tt, td, a) / vanilla_rate(tt) / price_factor


def _spec(method: str):
    """The registered MethodSpec of a method `config="auto"` can size."""
    spec = METHODS.get(method)
    if spec is None or spec.round_model is None:
        known = sorted(m for m, s in METHODS.items() if s.round_model is not None)
        raise ValueError(f"config='auto' knows {', '.join(known)}, not {method!r}")
    return spec


# Choices already made, by (method, models, batch bucket, cache size, pool shape): in this
# process (`_CHOICES`) and on disk (the "choice" section), so a later process starts from the
# same one. A choice is kept until another is predicted faster by the switch's gain:
# - STICKY_GAIN where switching costs a compile that staying would not: a later call (the new
#   loop compiles in the background, `auto_switch`, on the host cores the user's calls run
#   on), or a process's first call against the store's choice (whose loop the persistent
#   compilation cache likely holds);
# - SETTLE_GAIN where auto is asked again at the end of a kind's first call in a process
#   (`auto_switch.settle`), which compiles what it settles on before any later call runs:
#   there the margin only keeps noise in the prices from flipping the choice. (With
#   STICKY_GAIN there, the real Qwen pair kept gamma 4, explored by its first call, where
#   gamma 6 ran 1.18x faster and was predicted 1.08x.)
_CHOICES: dict = {}
STICKY_GAIN = 1.10
SETTLE_GAIN = 1.02


def _choice_key(method, target, draft, B, slots, pool_shape) -> str:
    d = model_signature(draft) if draft is not None else "-"
    return (f"{device_kind()}|{method}|{model_signature(target)}|{d}|B{batch_bucket(B)}"
            f"|S{slots}|{pool_shape}")


def _stored_choice(key: str) -> Optional[Choice]:
    """The choice an earlier process stored under key, or None (none, or its config no longer
    builds: the config class changed)."""
    hit = _read_cache().get("choice", {}).get(key)
    if hit is None:
        return None
    if hit["config"] is None:
        return Choice("vanilla", None, 1.0, None, "speculation off (an earlier process's choice)")
    spec = METHODS.get(hit["method"])
    try:
        cfg = spec.config_type(**hit["config"])
    except (AttributeError, TypeError, ValueError):
        return None
    return Choice(hit["method"], cfg, 1.0, None, "an earlier process's choice")


def _store_choice(key: str, choice: Choice) -> None:
    cfg = (None if choice.config is None else
           {f.name: getattr(choice.config, f.name) for f in dataclasses.fields(choice.config)
            if isinstance(getattr(choice.config, f.name), (int, bool))})
    _put("choice", key, {"method": choice.method, "config": cfg})


def auto_config(method: str, target, draft, prompt, plens, slots: int, use_cache: bool = True,
                pool_shape: Optional[tuple] = None, explore_depth: bool = False,
                switch_gain: float = STICKY_GAIN, timed: bool = False) -> Choice:
    """Price (`latency_tables`) and recall the pair's agreement, then `choose`, keeping the
    earlier choice for the same shapes (this process's, else the store's) unless the new one
    is predicted switch_gain faster (STICKY_GAIN, or SETTLE_GAIN at the end of a kind's first
    call, `auto_switch.settle`). pool_shape: (phrases per key, tokens per phrase) of a pool
    the call passes, which the chosen config must fit (`fits_pool`). explore_depth: the call
    is greedy and teaches auto, so it may draft deeper once (`explore`). timed: the call's
    loop will be timed and teach its method's factor (`generate`'s calls, `record_call`), so a
    method fewer than TRY_CALLS calls have timed is tried from UNTIMED_GAIN (`_auto_choice`)."""
    t0 = time.perf_counter()
    B = int(prompt.shape[0])
    key = _choice_key(method, target, draft, B, slots, pool_shape) + "|" + str(cache_path())
    if model_spans_processes(target):
        return _auto_spmd(key, method, target, draft, prompt, plens, slots, pool_shape)
    new = _auto_choice(method, target, draft, prompt, plens, slots, use_cache, pool_shape,
                       timed)
    stored_key = key.rsplit("|", 1)[0]
    old = _CHOICES.get(key)
    if old is None and use_cache:
        old = _stored_choice(stored_key)
    out = new
    if old is not None and (old.method, old.config) != (new.method, new.config) and (
            fits_pool(old.config, pool_shape)):
        tt, td, a = new.tables + (new.agreement,)
        # at the prices now, not those it was chosen at
        f = new.price_factor
        kept = predicted_speedup(old.method, old.config, tt, td, a, f)
        rival = predicted_speedup(new.method, new.config, tt, td, a, f)
        if rival < switch_gain * kept:
            other = ("vanilla" if new.method == "vanilla" else
                     f"{rival:.2f}x vanilla for another setting")
            out = dataclasses.replace(
                new, method=old.method, config=old.config, predicted_speedup=kept,
                reason=f"predicted {kept:.2f}x vanilla (kept: {other} is not "
                f"{switch_gain:.2f}x better)")
    if explore_depth and use_cache:  # past the sticky rule: exploring is once, on purpose
        out = explore(out, target, draft, method, pool_shape)
    if use_cache and (old is None or (old.method, old.config) != (out.method, out.config)):
        _store_choice(stored_key, out)
    _CHOICES[key] = out
    return dataclasses.replace(out, seconds=time.perf_counter() - t0)


def _auto_spmd(key, method, target, draft, prompt, plens, slots, pool_shape=None) -> Choice:
    """auto_config over processes (one model on a mesh spanning them): the disk store, which
    differs per host, is not read (every process must make the same calls: the agreement's
    forwards are collective programs); process 0's choice is broadcast, as timings differ per
    process and every process must run the same loop. Kept for the process's life per shape
    (the same call history on every process, so every process hits or misses together)."""
    old = _CHOICES.get(key)
    if old is None:
        old = broadcast(_auto_choice(method, target, draft, prompt, plens, slots, False,
                                     pool_shape))
        _CHOICES[key] = old
    return old


def _auto_choice(method, target, draft, prompt, plens, slots, use_cache, pool_shape=None,
                 timed: bool = False) -> Choice:
    """The predicted-fastest config now. With use_cache (generate's calls): the device's
    calibration and the learned scales from disk (`latency_tables`), the agreement realised by
    earlier calls or counted on earlier prompts; only where this pair's agreement has never
    been measured (its first call) do its two prompt forwards run, and only where this device
    was never calibrated (its first call) do the two calibration matmuls. Without use_cache
    everything is measured now and nothing learned is used."""
    B = int(prompt.shape[0])
    spec = _spec(method)
    with_draft = draft is not None and spec.needs_draft
    tt, td, notes = latency_tables(target, draft if with_draft else None, B, slots, use_cache)
    a, realised = None, False
    if not spec.needs_draft and spec.learn is not None and use_cache:
        a = realised_agreement(target, None, method)  # e.g. prompt lookup's copy hit rate
        realised = a is not None
        if a is not None:
            n = _read_cache()["realised"][_realised_key(target, None, method)][1]
            notes["measured"].append(f"{method}'s rate {a:.3f} (`MethodSpec.learn`): realised "
                                     f"over {n} rounds of earlier calls")
        else:
            notes["assumed"].append(f"{method}'s prior rates (fewer than "
                                    f"{MIN_REALISED_ROUNDS} rounds of earlier calls)")
    elif with_draft:
        a = known_agreement(target, draft) if use_cache else None
        pair = (str(cache_path()), model_signature(target), model_signature(draft))
        # (one read of the store for both: the notes' branch below and the margin)
        realised = isinstance(a, DepthAgreement) or (
            use_cache and realised_agreement(target, draft) is not None)
        if isinstance(a, DepthAgreement):
            n = _read_cache()["depth"][f"{pair[1]}|{pair[2]}"][0][0]
            notes["measured"].append(
                f"agreement by depth {', '.join(f'{x:.3f}' for x in a.by_depth)}, then "
                f"{a.beyond:.3f}: realised over {n} rounds of earlier calls")
        elif realised:
            s, n = _read_cache()["realised"][f"{pair[1]}|{pair[2]}"]
            notes["measured"].append(f"agreement {a:.3f}: realised over {n} rounds of "
                                     "earlier calls")
        elif a is not None:
            n = _read_cache()["agreement"][f"{pair[1]}|{pair[2]}"][1]
            r = realised_counts(f"{pair[1]}|{pair[2]}")[1]
            notes["measured"].append(
                f"agreement {a:.3f}: the pair's argmax over {n} prompt positions of earlier "
                "calls" + (f", moved {r}/{MIN_REALISED_ROUNDS} of the way to the {r} rounds "
                           "they realised" if r else ""))
        elif pair not in _AGREED or not use_cache:
            _AGREED.add(pair)
            a, n = pair_agreement(target, draft, prompt, plens, use_cache=use_cache)
            notes["measured"].append(f"agreement {a:.3f}: the pair's argmax over this call's "
                                     f"{n} prompt positions (measured now, once per pair)")
        else:
            a = DEFAULT_AGREEMENT
            notes["assumed"].append(f"agreement {a} (not measured)")
    # to 3 decimals: a realised agreement moves a little with every call (`_choose_memo`)
    if a is not None and not isinstance(a, DepthAgreement):  # (by depth: rounded already)
        a = round(a, 3)
    f, n_timed = _price_factor(method, target, draft if with_draft else None, B, use_cache,
                               notes, timed)
    # a method whose calls would teach its rate is tried on a smaller predicted gain
    # (TRY_GAIN), and one whose rounds fewer than TRY_CALLS calls have timed (where this one
    # will be: `timed`) on a smaller still (UNTIMED_GAIN): what its calls measure then decides
    trying = timed and n_timed < TRY_CALLS
    min_gain = (UNTIMED_GAIN if trying else
                TRY_GAIN if spec.learn is not None and not realised else MIN_GAIN)
    choice = _choose_memo(method, _frozen(tt), _frozen(td), a, pool_shape, min_gain, f)
    if trying and choice.method != "vanilla" and choice.predicted_speedup < MIN_GAIN:
        choice = dataclasses.replace(choice, reason=choice.reason + (
            f" (trying it: {n_timed} of its calls timed, {TRY_CALLS} teach its price)"))
    return dataclasses.replace(choice, tables=(tt, td), notes=notes)


def _price_factor(method, target, draft, B: int, use_cache: bool, notes: dict, timed: bool
                  ) -> tuple[float, int]:
    """(`relative_factor` to 3 decimals, how many calls of the method were timed), said in
    notes (timed: this call will be); (1.0, TRY_CALLS) without use_cache (nothing learned is
    used)."""
    if not use_cache:
        return 1.0, TRY_CALLS
    f, n_m, n_v = relative_factor(target, draft, B, method)
    if n_m:
        notes["measured"].append(
            f"{method}'s loops x{f:.3f} their price against vanilla's: {n_m} timed call"
            f"{'s' if n_m != 1 else ''} of it and {n_v} of vanilla, each pooled with "
            f"{FACTOR_PRIOR_CALLS} at its price")
    else:
        notes["assumed"].append(f"{method}'s rounds at their price (no call of it timed yet"
                                + (f": tried from {UNTIMED_GAIN:.2f}x)" if timed else ")"))
    return round(f, 3), n_m


def _frozen(table: Optional[dict]):
    return None if table is None else tuple(sorted(table.items()))


@functools.lru_cache(maxsize=256)
def _choose_memo(method, tt, td, a, pool_shape=None, min_gain: float = MIN_GAIN,
                 price_factor: float = 1.0) -> Choice:
    """`choose` once per (method, tables, agreement, pool shape, margin): a grid search of a
    few ms per call is not repeated on every `generate` call once the tables and agreement
    have settled."""
    return choose(method, dict(tt), None if td is None else dict(td), a, pool_shape, min_gain,
                  price_factor)
