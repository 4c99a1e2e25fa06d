"""config="auto"'s prices: what a forward of n tokens costs each model on this device.

A forward's price is t(n) = scale * anchor(n) * shape(n):

- the shape from the model's bytes and FLOPs at the device's rates (`cost.shape_latency`:
  reads and flops overlapping on an accelerator, adding up on a CPU), the rates a calibration
  of two small matmuls (`calibrate`: bandwidth at 1 row, flop rate at many), once per device
  kind and dtype;
- the anchor its measured forwards of 1, 2 and WIDE_ANCHOR tokens over the shape's prices,
  read between them (`Prices.model_anchor`, `anchor_at`), once per device kind and model
  shape;
- the scale learned from the user's own calls (`Prices.record_call`: after each call whose
  loop compiled nothing, its wall time against the price of the forwards it counted, pooled
  by least squares per pair and batch bucket), and each method's own factor over that
  (`Prices.method_factor`). So the loop's real costs (the LM head and its argmax, the cache
  writes, the loop's own work) enter the prices without a probe, from the second call on.

The calibration is two small matmuls and the anchors three forward timers per model; the
scale costs no run at all. A `generate` call never runs them (issue 53: on the real Qwen pair
they and the agreement's forwards cost a CLI user's first answer 84 s): where the store has
no calibration or no anchors, the call is priced from priors (`PRIOR_DEVICE`, `PRIOR_ANCHOR`:
the models' bytes and FLOPs at a-priori rates), and its own wall time teaches the scales as
the calls after it run (`record_call`). The priced basis is part of the key the scales are
pooled under (`Prices.timing_key`), so scales learned against priors never price measured
tables. Only a caller that asks (`probe=True`: a tuner's `measure_prices`, `probe_latency`, calls
without the store) measures, and says so on stderr with an estimate of the seconds
(`announce`). Everything is kept in the tuner's `store.Store`.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import jax
import numpy as np

from ..decoding import METHODS
from ..decoding.cost import (DeviceRates, ModelShape, interpolate, loop_seconds, scaled,
                             shape_latency, vanilla_overhead)
from ..decoding.spec import chain_agreement
from ..models.timing import forward_timer, matmul_timer
from .keys import Signatures, batch_bucket, device_kind
from .measuring import announce, spent
from .store import Store

# Sizes (tokens per forward) the probe times; anything between is interpolated, anything past
# the last is extrapolated linearly from the last two.
TARGET_SIZES = (1, 4, 8, 16, 64)
DRAFT_SIZES = (1, 4, 16, 64)
# Ends every key whose value came from `models.timing`'s timers: since they read every logit
# and every new K/V (before, one logit let XLA skip the LM head; unread K/V changed the
# projections' fusion), entries timed the old ways are not reused.
TIMED = "kv"


def timed_tag(model) -> str:
    """TIMED, and for a mixture of experts "-routed": its entries timed before the timers took
    distinct tokens (`models.timing.timing_tokens`) timed T copies of one token, which reach
    k experts only, and are not reused."""
    return TIMED + ("-routed" if model.config.is_moe else "")


# ------------------------------------------------------------------------------------ timing
def forward_seconds(model, batch: int, n: int, slots: int, inner: int = 4):
    """A timer (`models.timing.forward_timer`) of n tokens per row at `batch` rows after
    slots/2 cached tokens (at most slots - n) in a cache of `slots` slots."""
    return forward_timer(model, n, max(0, min(slots - n, slots // 2)), slots, batch=batch,
                         inner=inner)


def measure(timers: dict, reps: int, rank: int = 0) -> dict:
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


# ------------------------------------------------------------------------------------ the device
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
# A-priori device figures (bytes/s, flop/s), for `prior_latency`: what a platform's forward
# looks like before its calibration (tests of the choice's shape; the bench's projections).
PRIOR_DEVICE = {"cpu": (20e9, 150e9), "gpu": (2e12, 400e12), "tpu": (1e12, 200e12)}
def calibrate(dtype, reps: int = 5) -> DeviceRates:
    """This device's `cost.DeviceRates` for weights of `dtype`, measured now: two compiled
    matmul loops (`models.timing.matmul_timer`), timed interleaved, the fastest of reps."""
    platform = jax.default_backend()
    k, rows = CALIBRATION.get(platform, ACCELERATOR_CALIBRATION)
    t = measure({1: matmul_timer(1, k, dtype), rows: matmul_timer(rows, k, dtype)}, reps)
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


def params_size(params) -> tuple[int, int]:
    """(elements, bytes) of a params tree as held: a quantized leaf (`quant.QuantArray`)
    counts the float array it stands for as elements and its codes, scales and offsets as
    bytes (`quant.params_nbytes`: an int8 or w8a8 draft reads a byte a weight, not the four
    its float32 embedding would price it at; the real 0.5B w8a8 draft was priced at 2.0 GB a
    forward where it reads 0.54)."""
    from ..models.quant import is_quantized, params_nbytes

    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params, is_leaf=is_quantized))
    return n, params_nbytes(params)


def model_shape(model) -> ModelShape:
    """The model's `cost.ModelShape` from its config and params (abstract params do), its
    bytes as held (`params_size`)."""
    cfg = model.config
    item = np.dtype(model.params["embed"].dtype).itemsize
    total, total_bytes = params_size(model.params)
    # the LM head is a matmul over V x E; the embedding lookup of an untied model reads a row
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    matmul, matmul_bytes = total - embed, total_bytes - embed * item
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item
    if not cfg.is_moe or cfg.moe_dispatch != "grouped":  # one-hot: every expert, every token
        return ModelShape(matmul_bytes, matmul, cfg.num_layers, kv)
    # grouped experts: a forward reads the experts its tokens route to (`cost.expected_experts`)
    experts = cfg.expert_params()
    return ModelShape(matmul_bytes, matmul, cfg.num_layers, kv,
                      expert_bytes=int(experts * matmul_bytes / max(matmul, 1)),
                      expert_params=experts, experts=cfg.num_experts,
                      experts_per_token=cfg.experts_per_token)


def prior_rates() -> DeviceRates:
    """This platform's a-priori `cost.DeviceRates` (`PRIOR_DEVICE`), nothing measured: what a
    call is priced with before the device is calibrated (only ratios of prices decide a
    choice, and the scales learned from calls carry the device's own speed)."""
    platform = jax.default_backend()
    bw, flops = PRIOR_DEVICE.get(platform, PRIOR_DEVICE["gpu"])
    return DeviceRates(bw, flops, PER_LAYER.get(platform, ACCELERATOR_PER_LAYER),
                       overlap=platform != "cpu")


def prior_latency(model, batch: int, slots: int, sizes=TARGET_SIZES) -> dict:
    """{n: seconds} predicted from the model's shape and the platform's a-priori figures
    (`PRIOR_DEVICE`), nothing measured."""
    return shape_latency(model_shape(model), prior_rates(), batch_bucket(batch), slots // 2,
                         sizes)


# ------------------------------------------------------------------------------------ anchors
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
# A model's anchors before its forwards are timed (`Prices.model_anchor` without measure):
# the real Qwen 1.5B's measured factors over its shape anchored at t(1), read at 2 and 8 tokens
# (3 / 5 / 7 / 9 tokens: 1.23 / 1.15 / 1.13 / 1.11x); the 1-token anchor is 1 (the prior rates
# set the absolute price, and the learned scales correct it).
PRIOR_ANCHOR = (1.0, 1.25, 1.11)


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


def steps(scale: float, step: float = 1.02) -> float:
    """scale rounded to a power of `step`: prices that moved by less than a step between calls
    are the same prices, so the grid search is not repeated (`choice.Chooser`'s memo)."""
    return step ** round(math.log(scale) / math.log(step))


# ------------------------------------------------------------------------------------ scales
# What the user's calls teach: for each (device, pair, batch bucket), least-squares sums over
# the calls that compiled nothing of y = s_T * x_T + s_S * x_S, with y a call's measured
# seconds and x_T, x_S the unscaled price of the target's and the draft's forwards it counted
# (prefill included): [x_T^2, x_T x_S, x_S^2, x_T y, x_S y, calls].
#
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


class Prices:
    """The prices of one tuner: measured and learned through its store, keyed by its
    signatures."""

    def __init__(self, store: Store, signatures: Signatures):
        self.store, self.sig = store, signatures

    # -------------------------------------------------------------------------------- keys
    def latency_key(self, model, batch: int, slots: int) -> str:
        return (f"{device_kind()}|{self.sig(model)}|B{batch_bucket(batch)}|S{slots}"
                f"|{timed_tag(model)}")

    def anchor_key(self, model, batch: int, n: int = 1) -> str:
        wide = "" if n == 1 else f"|T{n}"
        return (f"{device_kind()}|{self.sig(model)}|B{batch_bucket(batch)}"
                f"|{timed_tag(model)}{wide}")

    @staticmethod
    def device_key(dtype) -> str:
        return f"{device_kind()}|{np.dtype(dtype).name}"

    def timing_key(self, target, draft, batch: int) -> str:
        d = self.sig(draft) if draft is not None else "-"
        # "anchored": sums of prices from anchored tables (`model_anchor`); older sums priced
        # the bare shapes and would mis-scale these; TIMED: priced from anchors timed the
        # current way; "anchors": forwards priced at anchors timed at these sizes (before: 1
        # and 8 tokens); "prior": priced from `prior_rates` or `PRIOR_ANCHOR` (something was
        # not measured), whose scales would mis-price measured tables, and back
        prior = "" if self.prices_known(target, draft, batch) else "|prior"
        return (f"{device_kind()}|{self.sig(target)}|{d}|B{batch_bucket(batch)}"
                f"|anchored|{timed_tag(target)}"
                f"|anchors{'-'.join(map(str, ANCHOR_SIZES))}{prior}")

    # -------------------------------------------------------------------------------- measured
    def stored_latency(self, model, batch: int, slots: int, sizes) -> Optional[dict]:
        """The measured {n: seconds} in the store for this device kind, model shape, batch
        bucket and cache size, or None."""
        hit = self.store.read().get("latency", {}).get(self.latency_key(model, batch, slots))
        if hit and all(str(n) in hit for n in sizes):
            return {int(k): float(v) for k, v in hit.items()}
        return None

    def probe_latency(self, model, batch: int, slots: int, sizes=TARGET_SIZES, reps: int = 5,
                      use_cache: bool = True) -> dict:
        """{n: seconds per bare forward} for this model at this batch bucket and cache size,
        measured now (one compile per size), or from the store. Not part of a call's choice:
        a tool for benches and for anyone who wants a model's own table. With one stored,
        `config="auto"` takes its shape instead of the bytes-and-FLOPs one (`shape_table`)."""
        B = batch_bucket(batch)
        if use_cache:
            hit = self.stored_latency(model, B, slots, sizes)
            if hit is not None:
                return hit
        announce(f"the model's forwards of {', '.join(map(str, sizes))} tokens",
                 reps * 4 * sum(prior_latency(model, B, slots, sizes).values()), len(sizes))
        table = measure({n: forward_seconds(model, B, n, slots) for n in sizes}, reps)
        if use_cache:
            self.store.put("latency", self.latency_key(model, B, slots),
                           {str(n): t for n, t in table.items()})
        return table

    def device_rates(self, dtype, use_cache: bool = True, probe: bool = False,
                     log: Optional[list] = None) -> tuple[DeviceRates, str]:
        """(this device's rates for dtype, where they come from: "stored", "calibrated" or
        "prior"): from the store when this device kind has been calibrated for dtype before;
        else measured now (`calibrate`, said on stderr, logged in `log`, kept) where the
        caller asks (probe) or uses no store; else the platform's priors (`prior_rates`):
        a call never waits for a calibration it did not ask for."""
        platform = jax.default_backend()
        if use_cache:
            hit = self.store.read().get("device", {}).get(self.device_key(dtype))
            if hit is not None:
                return DeviceRates(hit["bandwidth"], hit["flops"],
                                   PER_LAYER.get(platform, ACCELERATOR_PER_LAYER),
                                   overlap=platform != "cpu"), "stored"
        if use_cache and not probe:
            return prior_rates(), "prior"
        k = CALIBRATION.get(platform, ACCELERATOR_CALIBRATION)[0]
        announce("the device's rates (two matmuls)",
                 5 * 2 * k * k * np.dtype(dtype).itemsize / prior_rates().bandwidth, 2)
        t0 = time.perf_counter()
        rates = calibrate(dtype)
        spent(log, "device calibration (two matmuls)", t0)
        if use_cache:
            self.store.put("device", self.device_key(dtype),
                           {"bandwidth": rates.bandwidth, "flops": rates.flops})
        return rates, "calibrated"

    def shape_table(self, model, batch: int, slots: int, sizes, rates: DeviceRates) -> dict:
        """{n: seconds} of the model's forward before any scale: its own stored table when one
        was measured (`probe_latency`), else `cost.shape_latency` of its shape at the device's
        rates after slots/2 cached tokens."""
        hit = self.stored_latency(model, batch, slots, sizes)
        if hit is not None:
            return hit
        return shape_latency(model_shape(model), rates, batch_bucket(batch), slots // 2, sizes)

    def model_anchor(self, model, batch: int, slots: int, rates: DeviceRates,
                     use_cache: bool = True, probe: bool = False,
                     log: Optional[list] = None) -> tuple[tuple, str]:
        """((a_1, a_2, a_w), where they come from: "stored", "timed" or "prior"): this
        model's measured forwards of `ANCHOR_SIZES` tokens over its shape's prices at `rates`,
        from the store when this model's shape was timed on this device kind at this batch
        bucket before; else timed now (three compiles; said on stderr, logged in `log`, kept)
        where the caller asks (probe) or uses no store; else `PRIOR_ANCHOR`. Keyed without
        the cache size, so a model is timed once per device, whatever shapes follow.

        Why: the shape prices weights and FLOPs, but a small model's fixed work per layer
        weighs more than its bytes say, and a call's scale learned from one config cannot tell
        the target's share from the draft's. On the real Qwen pair here the 0.5B draft's
        forward is about 0.47 of the 1.5B's, where their shapes say 0.34: priced by shape,
        long drafts looked cheap (auto chose gamma 12 where 6 ran 1.4x faster). And a forward
        of several tokens is not the 1-token one's shape away from it (`ANCHOR_SIZES`)."""
        keys = tuple(self.anchor_key(model, batch, n) for n in ANCHOR_SIZES)
        if use_cache:
            hits = [self.store.read().get("anchor", {}).get(k) for k in keys]
            if all(h is not None for h in hits):
                return tuple(float(h) for h in hits), "stored"
            if not probe:
                return PRIOR_ANCHOR, "prior"
        B = batch_bucket(batch)
        priced = shape_latency(model_shape(model), rates, B, slots // 2, ANCHOR_SIZES)
        announce(f"a model's forwards of {' / '.join(map(str, ANCHOR_SIZES))} tokens",
                 5 * 4 * sum(prior_latency(model, B, slots, ANCHOR_SIZES).values()),
                 len(ANCHOR_SIZES))
        t0 = time.perf_counter()
        # the second fastest of 5, interleaved (load from other processes only ever adds time;
        # one of 3 moved the demo target's anchor between 1.6 and 3.3 on a shared 2-core
        # machine). Not the fastest: the real Qwen 1.5B's 1-token timer once read 187 ms in
        # one round of five whose median was 234 (its decode step: 222), an anchor 20% low
        # that the vanilla calls' learned scale then carried onto every wider forward, pricing
        # speculation under vanilla
        timed = measure({n: forward_seconds(model, B, n, slots) for n in ANCHOR_SIZES}, 5,
                        rank=1)
        ratios = tuple(timed[n] / priced[n] for n in ANCHOR_SIZES)
        spent(log, f"anchors of a {model.config.num_layers}-layer model (forwards of "
                   f"{' / '.join(map(str, ANCHOR_SIZES))} tokens)", t0)
        if use_cache:
            for k, r in zip(keys, ratios):
                self.store.put("anchor", k, r)
        return ratios, "timed"

    def base_tables(self, target, draft, batch: int, slots: int, use_cache: bool,
                    probe: bool = False, log: Optional[list] = None
                    ) -> tuple[dict, Optional[dict], list]:
        """The unscaled (target, draft) tables and the anchors applied ([target's, draft's],
        each (a_1, a_2, a_w)): `shape_table` at the device's rates (`device_rates`), each
        forward scaled by the model's anchors (`model_anchor`, `anchor_at`; a table probed
        whole, `probe_latency`, is used as measured: anchors 1). The shape is also priced at
        the anchors' sizes and at 3 tokens, where the anchor factor bends. probe: calibrate
        and time what the store lacks now (else priors stand in); log: where what was measured
        is listed with its seconds."""
        tables, anchors = [], []
        for model, sizes in ((target, TARGET_SIZES), (draft, DRAFT_SIZES)):
            if model is None:
                tables.append(None)
                continue
            rates, _ = self.device_rates(model.params["embed"].dtype, use_cache, probe, log)
            anchor = (1.0, 1.0, 1.0)
            if self.stored_latency(model, batch, slots, sizes) is None:
                sizes = tuple(sorted(set(sizes) | set(ANCHOR_SIZES) | {3}))
                anchor = self.model_anchor(model, batch, slots, rates, use_cache, probe,
                                           log)[0]
            tables.append(anchored(self.shape_table(model, batch, slots, sizes, rates), anchor))
            anchors.append(anchor)
        return tables[0], tables[1], anchors

    def latency_tables(self, target, draft, batch: int, slots: int, use_cache: bool = True,
                       probe: bool = False) -> tuple[dict, Optional[dict], dict]:
        """(target table, draft table or None, notes): the prices a choice is made with,
        `base_tables` times the learned scales (`learned_scales`; none without use_cache), and
        notes = {"measured": [...], "assumed": [...], "measured_now": [{"what", "seconds"}]}:
        what stands behind them, and what this call measured (nothing, unless probe or
        no store: `device_rates`), for `stats["auto"]`."""
        log: list = []
        rates, source = self.device_rates(target.params["embed"].dtype, use_cache, probe, log)
        tt, td, anchors = self.base_tables(target, draft, batch, slots, use_cache, probe, log)
        known = [m for m, a in zip((target, draft), anchors) if a != PRIOR_ANCHOR]
        measured, assumed = [], []
        if source == "prior":
            assumed.append(f"device: {rates.bandwidth / 1e9:.0f} GB/s, {rates.flops / 1e9:.0f} "
                           f"GFLOP/s, the {jax.default_backend()}'s priors (never calibrated "
                           "here: no call waits for it; the calls' times scale the prices)")
        else:
            measured.append(f"device: {rates.bandwidth / 1e9:.1f} GB/s, "
                            f"{rates.flops / 1e9:.0f} GFLOP/s (two matmuls, "
                            f"{'calibrated in this call' if source == 'calibrated' else 'stored'})")
        said = ", ".join(f"{who} " + " / ".join(f"x{x:.2f}" for x in a)
                         for who, a in zip(("target", "draft"), anchors))
        if len(known) == len(anchors):
            measured.append(f"each model's forwards of {' / '.join(map(str, ANCHOR_SIZES))} "
                            f"tokens, timed once on this device: {said} their shape's prices")
        else:
            assumed.append(f"forwards of {' / '.join(map(str, ANCHOR_SIZES))} tokens at "
                           f"{said} their shape's prices (x{' / x'.join(map(str, PRIOR_ANCHOR))}"
                           ": priors, for a model never timed here)")
        assumed.append("each forward's t(T) shaped by its weight bytes and FLOPs at those rates, "
                       f"plus {rates.per_layer * 1e6:.0f} us per layer, scaled to its anchors "
                       f"at t({'), t('.join(map(str, ANCHOR_SIZES))}) and between 2 and "
                       f"{WIDE_ANCHOR} tokens by a factor read between those (linear in log T)")
        if model_shape(target).expert_bytes:
            assumed.append("the target's experts read per forward: the expected distinct "
                           "experts its tokens route to under uniform routing "
                           f"(top {target.config.experts_per_token} of "
                           f"{target.config.num_experts}: Y (1 - (1 - k/Y)^(B T)) of Y "
                           "per layer for T tokens at B rows)")
        s_t, s_s, calls = 1.0, 1.0, 0
        if use_cache:
            s_t, s_s, calls, separated = self.learned_scales(target, draft, batch)
        if calls:
            measured.append(f"loop time of {calls} earlier call{'s' if calls > 1 else ''}: "
                            f"target x{s_t:.2f}" + (f", draft x{s_s:.2f}" if draft is not None
                                                    else ""))
            if draft is not None and not separated:
                assumed.append("the draft's share of a round as its shape gives it (no calls "
                               "of other configs have told the two apart)")
        else:
            assumed.append("no earlier call: prices at those rates, unscaled")
        return (scaled(tt, steps(s_t)), scaled(td, steps(s_s)),
                {"measured": measured, "assumed": assumed, "measured_now": log})

    def prices_known(self, target, draft, batch: int) -> bool:
        """Whether this device's rates and these models' anchors are in the store: the call's
        prices are measured ones, not priors (`timing_key`'s basis)."""
        data = self.store.read()
        models = [m for m in (target, draft) if m is not None]
        return (all(self.device_key(m.params["embed"].dtype) in data.get("device", {})
                    for m in models)
                and all(self.anchor_key(m, batch, n) in data.get("anchor", {})
                        for m in models for n in ANCHOR_SIZES))

    # -------------------------------------------------------------------------------- learned
    def learned_scales(self, target, draft, batch: int) -> tuple[float, float, int, bool]:
        """(s_T, s_S, calls learned from, separated) for this pair and batch bucket:
        `solve_scales` over the sums of the pair's calls and of the target's calls without the
        draft (vanilla, lookahead, prompt lookup, or speculation turned off), which price the
        target alone; one scale for both while fewer than MIN_SPLIT_CALLS calls ran the
        draft."""
        timing = self.store.read().get("timing", {})
        sums = list(timing.get(self.timing_key(target, None, batch), [0.0] * 5 + [0]))
        pair_calls = 0
        if draft is not None:
            pair = timing.get(self.timing_key(target, draft, batch), [0.0] * 5 + [0])
            sums = [a + b for a, b in zip(sums, pair)]
            pair_calls = int(pair[5])
        if sums[5] <= 0:
            return 1.0, 1.0, 0, False
        s_t, s_s, sep = solve_scales(sums)
        if sep and pair_calls < MIN_SPLIT_CALLS:
            s_t = s_s = common_scale(sums)
            sep = False
        return s_t, s_s, int(sums[5]), sep

    def record_call(self, method: str, cfg, target, draft, stats: dict, seconds: float,
                    batch: int, prompt_len: int, slots: int,
                    agreement: Optional[float] = None) -> None:
        """After a `config="auto"` call that compiled nothing: what it teaches about this
        device's prices. method / cfg: what ran (auto's choice); stats: its counters
        (`summarize_stats`); seconds: its loop's wall time (prefill to fetched result);
        prompt_len: the padded prompt length; slots: the cache size auto chose with. Pooled in
        the store with every earlier call's."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        used_draft = method != "vanilla" and draft is not None and METHODS[method].needs_draft
        tt, td, _ = self.base_tables(target, draft if used_draft else None, batch, slots, True)
        x_t, x_s = call_parts(method, cfg, stats, prompt_len, tt, td, agreement)
        if x_t <= 0:
            return
        y = float(seconds)
        used = draft if used_draft else None
        key = self.timing_key(target, used, batch)
        y_f = self.clipped(y, x_t, x_s, target, used, batch, method)  # (at the prices before)
        # one locked write of the store for both entries
        self.store.add_all(
            ("timing", key, (x_t * x_t, x_t * x_s, x_s * x_s, x_t * y, x_s * y, 1),
             (0.0, 0.0, 0.0, 0.0, 0.0, 0)),
            ("rounds", f"{key}|{method}", (x_t, x_s, y_f, 1), (0.0, 0.0, 0.0, 0)))

    def clipped(self, y: float, x_t: float, x_s: float, target, draft, batch: int,
                method: str) -> float:
        """A call's measured seconds as its method's factor pools them: within FACTOR_CLIP of
        what the factor so far predicts, once FACTOR_CLIP_CALLS calls back it (one call the
        machine stalled, 2.2x its row's median on the demo pair, moved Ouroboros' factor
        10%)."""
        f, n = self.method_factor(target, draft, batch, method)
        if n < FACTOR_CLIP_CALLS:
            return y
        s_t, s_s, _, _ = self.learned_scales(target, draft, batch)
        expect = f * (s_t * x_t + s_s * x_s)
        return min(max(y, expect / FACTOR_CLIP), expect * FACTOR_CLIP)

    def method_factor(self, target, draft, batch: int, method: str) -> tuple[float, int]:
        """(factor, calls): what `method`'s timed calls of this pair measured over their price
        at the learned scales (`learned_scales`), pooled with FACTOR_PRIOR_CALLS calls at
        their price; (1.0, 0) before any. draft: the draft the method runs, None without
        one."""
        key = f"{self.timing_key(target, draft, batch)}|{method}"
        x_t, x_s, y, n = self.store.read().get("rounds", {}).get(key, (0.0, 0.0, 0.0, 0))
        s_t, s_s, _, _ = self.learned_scales(target, draft, batch)
        priced = s_t * x_t + s_s * x_s
        if n <= 0 or priced <= 0:
            return 1.0, 0
        prior = FACTOR_PRIOR_CALLS * priced / n
        return (y + prior) / (priced + prior), int(n)

    def relative_factor(self, target, draft, batch: int, method: str) -> tuple[float, int, int]:
        """(factor of `method` over vanilla's, method's timed calls, vanilla's): what auto
        divides a config's predicted speedup by (`choice.predicted_speedup`'s
        price_factor)."""
        used = draft if METHODS[method].needs_draft else None
        f_m, n_m = self.method_factor(target, used, batch, method)
        f_v, n_v = self.method_factor(target, None, batch, "vanilla")
        return f_m / f_v, n_m, n_v
