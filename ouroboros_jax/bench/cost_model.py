"""Cost model: predict a method's time (and speedup) from counted forwards and a latency table.

    time(method) ~= target_calls * t_T(n_T) + draft_forwards * t_S(n_S)
                    + rounds * (t_S1(n_S1) - t_S(n_S))   (the round's first draft forward)
                    + prefill: per call, p_T(P) (+ p_S(P) with a draft), P = prompt bucket
    predicted speedup = (vanilla prefill + vanilla_target_calls * t_T(1)) / time(method)

n_T, n_S are the input lengths (tree sizes) of one target / draft forward of the method
(`forward_sizes`); n_S1 that of a round's first draft forward, which also catches the draft up on
tokens it has not processed (speculative: 2, Ouroboros: the Jacobi tree plus an N-slot prefix).
t_S1 is a draft forward timed right after a target forward: on a CPU the target streams its weights
through the last-level cache and evicts the draft's, so the first draft forward of every round is
slower than the back-to-back forwards t_S is timed on (measured on the demo pair: a 1-token draft
forward 0.51 ms back to back, 0.75 ms right after a target forward). t_T(n), t_S(n) and t_S1(n)
come from a `LatencyTable` (read through the pure cost model's interpolator,
decoding/cost.py): measured on this machine by
timing jitted forwards of each model (`measure_latency`), or loaded from JSON written on another
machine (e.g. a GPU) to predict what the same counts would give there. Prefill forwards (one
per call and model) are counted when the table has prefill timings. This is the paper's eq. 5/6
with the counts measured instead of modelled. Not modelled: per-round work outside the forwards
(acceptance walk, pool updates, cache commits, the loop itself); the engine keeps it small
(commits update the cache in place, attention reads only live cache blocks), so measured /
predicted time near 1 says the counted forwards explain the run. Attention cost follows the
live length (models/attention.py), so forwards are timed after the workload's median context.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np

from ..decoding import METHODS
from ..decoding.cost import interpolate
from ..models.timing import forward_timer as timer, sequence_timer
from ..request import prompt_bucket  # noqa: F401 (the bench's prompt widths are generate's)


@dataclasses.dataclass
class LatencyTable:
    """Seconds per forward by input length: target {n: s}, draft {n: s}."""

    target: dict
    draft: dict
    context: int = 0  # committed cache length the forwards were timed after
    note: str = ""
    target_prefill: dict = dataclasses.field(default_factory=dict)  # {prompt bucket P: s}
    draft_prefill: dict = dataclasses.field(default_factory=dict)
    # {n: s} a draft forward of n tokens right after a target forward (a round's first); empty:
    # the draft's warm timings stand in
    draft_first: dict = dataclasses.field(default_factory=dict)
    # seconds of work outside the forwards per round (per target forward, vanilla's steps
    # included): 0 for a table measured here, whose forwards explain the run within 10%
    # (`validate`); stated for a projection onto an accelerator (bench/accelerator.py)
    round_overhead: float = 0.0

    @staticmethod
    def _lookup(table: dict, n: int) -> float:
        return interpolate(table, n)  # the one interpolator (decoding/cost.py)

    def t_target(self, n: int) -> float:
        return self._lookup(self.target, n)

    def t_draft(self, n: int) -> float:
        return self._lookup(self.draft, n)

    def t_draft_first(self, n: int) -> float:
        """A round's first draft forward, after the target's (warm timing if none measured)."""
        return self._lookup(self.draft_first or self.draft, n)

    def prefill_seconds(self, prompt_tokens, with_draft: bool) -> float:
        """Prefill time of calls with these prompt lengths (0 when the table has none)."""
        if not self.target_prefill:
            return 0.0
        t = 0.0
        for n in prompt_tokens:
            P = prompt_bucket(n)
            t += self._lookup(self.target_prefill, P)
            if with_draft and self.draft_prefill:
                t += self._lookup(self.draft_prefill, P)
        return t

    def to_json(self) -> dict:
        j = lambda d: {str(k): v for k, v in d.items()}  # noqa: E731
        return {"target": j(self.target), "draft": j(self.draft), "context": self.context,
                "note": self.note, "target_prefill": j(self.target_prefill),
                "draft_prefill": j(self.draft_prefill), "draft_first": j(self.draft_first),
                "round_overhead": self.round_overhead}

    @classmethod
    def from_json(cls, obj) -> "LatencyTable":
        if isinstance(obj, str):
            with open(obj) as f:
                obj = json.load(f)
        if "cost_model" in obj:  # a whole results.json from a bench run elsewhere
            obj = obj["cost_model"]["latency"]
        elif "latency" in obj and "target" not in obj:  # the device script's device.json
            obj = obj["latency"]
        if "target" not in obj:
            raise ValueError("latency table: expected {\"target\": {n: seconds}, \"draft\": "
                             "{n: seconds}} or a bench results.json with a cost_model")
        d = lambda x: {int(k): float(v) for k, v in (x or {}).items()}  # noqa: E731
        return cls(target=d(obj["target"]), draft=d(obj.get("draft")),
                   context=int(obj.get("context", 0)), note=obj.get("note", ""),
                   target_prefill=d(obj.get("target_prefill")),
                   draft_prefill=d(obj.get("draft_prefill")),
                   draft_first=d(obj.get("draft_first")),
                   round_overhead=float(obj.get("round_overhead", 0.0)))


def weights_bound_table(target_params: int, draft_params: Optional[int]) -> LatencyTable:
    """A forward costs its model's parameter count (in units of the target's), whatever its
    input size: the regime of batch-1 decoding on an accelerator, where reading the weights
    dominates and a tree of tens of tokens costs about what one token costs (the paper's eq. 5
    assumption). Prefill is left out. Used to show what the counted forwards of a CPU run
    would give there; a prediction, never a measurement."""
    return LatencyTable(target={1: 1.0},
                        draft={1: float(draft_params) / target_params} if draft_params else {},
                        note="weights-bound: t_T(n) = 1, t_S(n) = draft/target parameters")


def forward_sizes(method: str, config) -> tuple[int, int, int]:
    """(tokens per target forward, per draft forward, per first draft forward of a round).

    Counts fixed-shape inputs as compiled: masked slots cost as much as real ones. Each
    method says it in its `MethodSpec.forward_sizes`."""
    spec = METHODS.get(method)
    if spec is None or spec.forward_sizes is None:
        raise ValueError(f"no forward sizes known for method {method!r}")
    return spec.forward_sizes(config)


def predict_seconds(target_calls: int, draft_forwards: int, n_target: int, n_draft: int,
                    table: LatencyTable, n_draft_first: Optional[int] = None,
                    prefill: float = 0.0) -> float:
    """prefill + target_calls * (t_T(n_T) + the table's round overhead) + draft_forwards *
    t_S(n_S); with n_draft_first, one draft forward per round (per target call) costs
    t_S1(n_draft_first) instead."""
    t = prefill + target_calls * (table.t_target(n_target) + table.round_overhead)
    if draft_forwards:
        t += draft_forwards * table.t_draft(n_draft)
        if n_draft_first is not None:
            t += min(target_calls, draft_forwards) * (table.t_draft_first(n_draft_first)
                                                      - table.t_draft(n_draft))
    return t


def predict_speedup(vanilla_target_calls: int, target_calls: int, draft_forwards: int,
                    n_target: int, n_draft: int, table: LatencyTable,
                    n_draft_first: Optional[int] = None, vanilla_prefill: float = 0.0,
                    prefill: float = 0.0) -> float:
    """(vanilla_prefill + vanilla_target_calls * (t_T(1) + round overhead)) /
    predict_seconds(...)."""
    base = vanilla_prefill + vanilla_target_calls * (table.t_target(1) + table.round_overhead)
    return base / predict_seconds(target_calls, draft_forwards, n_target, n_draft, table,
                                  n_draft_first, prefill)


def _slots(context: int, n: int, slots: Optional[int]) -> int:
    """At least `slots` and at least the next power of two above context + n."""
    return max(slots or 0, 64, 1 << (context + n).bit_length())


def forward_timer(model, n: int, context: int, inner: int = 8, slots: Optional[int] = None):
    """`models.timing.forward_timer` at batch 1, in a cache of `_slots` slots."""
    return timer(model, n, context, _slots(context, n, slots), batch=1, inner=inner)


def first_draft_timer(target, n_target: int, draft, n: int, context: int, inner: int = 8,
                      slots: Optional[int] = None):
    """Seconds of a target forward of n_target tokens followed by a draft forward of n (a
    round's verification, then the next round's first draft forward), at batch 1; subtract
    the target's own time to get t_S1(n)."""
    S = _slots(context, max(n, n_target), slots)
    return sequence_timer([(target, n_target), (draft, n)], context, S, batch=1, inner=inner)


def measure_latency(target, draft, target_sizes, draft_sizes, context: int = 128,
                    reps: int = 20, prefill_sizes=(), slots: Optional[int] = None,
                    draft_first_sizes=()) -> LatencyTable:
    """Seconds per forward of each model at each input size after `context` cached tokens
    (in a cache of `slots` slots, as the measured runs had; by default the next power of two):
    median over `reps` rounds, every round timing every (model, size) once in turn, so that
    load from other processes spreads over all sizes alike. Compile excluded.

    draft_first_sizes: draft sizes also timed as a round's first draft forward, right after a
    one-token target forward (t_S1 = that pair's median minus t_T(1)'s)."""
    timers = {("target", int(n)): forward_timer(target, int(n), context, slots=slots)
              for n in sorted(set(target_sizes) | {1})}
    if draft is not None:
        timers.update({("draft", int(n)): forward_timer(draft, int(n), context, slots=slots)
                       for n in sorted(set(draft_sizes)) if n > 0})
        timers.update({("pair", int(n)): first_draft_timer(target, 1, draft, int(n), context,
                                                           slots=slots)
                       for n in sorted(set(draft_first_sizes)) if n > 0})
    for P in sorted(set(prefill_sizes)):  # a causal forward of the whole prompt bucket
        timers[("target_prefill", int(P))] = forward_timer(target, int(P), 0, inner=2)
        if draft is not None:
            timers[("draft_prefill", int(P))] = forward_timer(draft, int(P), 0, inner=2)
    samples: dict = {k: [] for k in timers}
    for _ in range(reps):
        for k, timed in timers.items():
            samples[k].append(timed())
    med = {k: float(np.median(v)) for k, v in samples.items()}
    by = lambda kind: {n: v for (m, n), v in med.items() if m == kind}  # noqa: E731
    t1 = med[("target", 1)]
    return LatencyTable(target=by("target"), draft=by("draft"),
                        target_prefill=by("target_prefill"), draft_prefill=by("draft_prefill"),
                        draft_first={n: max(v - t1, 0.0) for n, v in by("pair").items()},
                        context=context,
                        note=f"measured here, median of {reps} interleaved rounds, batch 1"
                             + (f", {slots} cache slots" if slots else ""))


def forward_size_sets(results: dict, configs: dict) -> tuple[set, set, set]:
    """(target sizes, draft sizes, first-draft sizes) of every forward the bench's rows ran,
    METHOD@auto rows by what auto chose per call (`auto_rows.row_parts`): the sizes a
    latency table must hold to price them."""
    from .auto_rows import row_parts

    ts, ds, ds1 = {1}, set(), set()
    for label, r in results["methods"].items():
        if r.get("kind") != "oj" or label not in configs:
            continue
        for part in row_parts(r, configs[label]):
            try:
                nt, ns, ns1 = forward_sizes(part.method, part.config)
            except (ValueError, AttributeError):
                continue
            ts.add(nt)
            ds.update(n for n in (ns,) if n)
            ds1.update(n for n in (ns1,) if n)
    return ts, ds, ds1


def _priced_row(label: str, r: dict, config, table: LatencyTable) -> Optional[dict]:
    """One row's prediction: each part of it (`auto_rows.row_parts`: the whole row, or one per
    config auto chose) priced with its own forward sizes, summed; None for a row without
    known forward sizes."""
    from .auto_rows import is_auto, ran_label, row_parts

    parts = row_parts(r, config)
    priced = []
    for p in parts:
        spec = METHODS.get(p.method)
        if spec is None or spec.forward_sizes is None:
            return None
        priced.append((p, forward_sizes(p.method, p.config)))
    pre = secs = 0.0
    for p, (n_t, n_s, n_s1) in priced:
        p_pre = table.prefill_seconds(p.prompt_tokens, n_s > 0)
        pre += p_pre
        secs += predict_seconds(p.target_calls, p.draft_forwards, n_t, n_s, table, n_s1, p_pre)
    n_t, n_s, n_s1 = max(priced, key=lambda ps: ps[0].calls)[1]  # the most calls' sizes
    return {"method": label, "ran": ran_label(label, parts, is_auto(r, config)),
            "ran_parts": [{"method": p.method, "config": p.recipe, "calls": p.calls}
                          for p, _ in priced],
            "n_target": n_t, "n_draft": n_s, "n_draft_first": n_s1, "prefill_seconds": pre,
            "predicted_seconds": secs, "measured_seconds": r["seconds"],
            "target_calls": r["target_calls"], "draft_forwards": r["draft_forwards"]}


def cost_rows(results: dict, table: LatencyTable, configs: dict) -> list[dict]:
    """Predicted vs measured time and speedup for every method of a bench result (see
    runner), METHOD@auto rows priced by the configs auto ran (configs[label] == "auto", or
    the saved row's config {"auto": True})."""
    van = results["methods"].get("vanilla")
    if van is None:
        return []
    van_pre = table.prefill_seconds([c["prompt_tokens"] for c in van["per_call"]], False)
    base = van_pre + van["target_calls"] * (table.t_target(1) + table.round_overhead)
    rows = []
    for label, r in results["methods"].items():
        if r.get("kind") != "oj":
            continue
        row = _priced_row(label, r, configs.get(label), table)
        if row is None:
            continue
        pred = base / row["predicted_seconds"]
        row.update(predicted_speedup=pred, measured_speedup=r.get("speedup"),
                   ratio_measured_to_predicted=(r["speedup"] / pred) if r.get("speedup")
                   and pred else None)
        rows.append(row)
    return rows


# The CPU validation's bound: the cost model must predict a run's measured time within 10%
# (`validate`; how much of a run the counted forwards explain with each measurement paired with
# a latency measurement taken right after it: `python -m experiments.cost_check`).
TOLERANCE = 0.10


def relative_error(measured: float, predicted: float) -> Optional[float]:
    """measured / predicted - 1: how far the counted forwards' price is from the measured time
    (+0.05: the run took 5% longer than its forwards cost); None without both."""
    return measured / predicted - 1.0 if measured and predicted else None


def validate(rows: list[dict], tolerance: float = TOLERANCE) -> dict:
    """Marks each cost-model row (`cost_model.cost_rows`, priced with this CPU's latency table)
    with `cpu_error` (`relative_error` of its measured and predicted seconds) and
    `within_tolerance`; returns {"tolerance", "within", "rows", "summary"}."""
    n = 0
    for r in rows:
        r["cpu_error"] = relative_error(r.get("measured_seconds"), r.get("predicted_seconds"))
        r["within_tolerance"] = r["cpu_error"] is not None and abs(r["cpu_error"]) <= tolerance
        n += r["within_tolerance"]
    return {"tolerance": tolerance, "within": n, "rows": len(rows),
            "summary": f"CPU validation: {n} of {len(rows)} rows within {tolerance:.0%} "
                       "(measured time vs the cost model's price of the row's counted forwards "
                       "with this CPU's timed forwards)"}
