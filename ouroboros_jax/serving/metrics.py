"""GET /metrics: the engine's counters and the server's latency histograms in Prometheus text.

Names follow vLLM's (`vllm:spec_decode_num_drafts`, `vllm:num_requests_running`,
`vllm:e2e_request_latency_seconds`, ...) under the prefix `ouroboros:`, so dashboards written
for vLLM's speculative-decoding panels read these unchanged but for the prefix. Counters carry
the `_total` suffix of the exposition format (version 0.0.4); histograms are cumulative
`_bucket{le=...}` lines plus `_sum` and `_count`.

Only the measures of the method that runs are exported: no spec-decode counters for plain
decoding, no pool counters for a method without a phrase pool; accepted draft tokens by source
(`spec_decode_num_accepted_tokens_by_source{source=...}`, `decoding.common.SOURCES`) for the
method's own sources, summing to `spec_decode_num_accepted_tokens`.

No prometheus_client dependency: the format is a few lines of text, and the engine already
keeps the counters (`Engine.metrics()`); this module only renders them.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Iterable, NamedTuple, Optional

import numpy as np

from ..decoding.common import SOURCES

PREFIX = "ouroboros:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; vLLM's request-latency buckets, cut to what a CPU-to-GPU server spans
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0)


class Histogram:
    """A thread-safe cumulative histogram over fixed upper bounds (+Inf implied)."""

    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.sum += v

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str, help_: str) -> list[str]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.bounds + (math.inf,), counts):
            acc += c
            le = "+Inf" if b == math.inf else _num(b)
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        out += [f"{name}_sum {_num(total)}", f"{name}_count {acc}"]
        return out


class ServerMetrics:
    """What the server measures itself (the engine counts the rest): request latency, time to
    first token, and finished requests by finish reason and endpoint."""

    def __init__(self):
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.finished: dict[tuple[str, str], int] = {}
        self.errors: dict[int, int] = {}
        self._lock = threading.Lock()

    def request_done(self, endpoint: str, finish_reason: str, latency_s: float,
                     ttft_s: Optional[float]) -> None:
        self.e2e.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        with self._lock:
            k = (endpoint, finish_reason)
            self.finished[k] = self.finished.get(k, 0) + 1

    def error(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def cancelled(self, endpoint: str) -> None:
        """A request that ended before it was accepted (its client left mid-upload): counted
        as cancelled, with no latency to observe."""
        with self._lock:
            k = (endpoint, "cancelled")
            self.finished[k] = self.finished.get(k, 0) + 1


def _num(v) -> str:
    """A sample value as Prometheus prints it (integers without '.0')."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2 ** 53 else repr(v)


def _family(name: str, kind: str, help_: str, samples) -> list[str]:
    """samples: [(labels dict or None, value)] -> the # HELP/# TYPE header and sample lines."""
    full = PREFIX + name
    out = [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
    suffix = "_total" if kind == "counter" else ""
    for labels, v in samples:
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{_escape(str(x))}"' for k, x in labels.items()) + "}"
        out.append(f"{full}{suffix}{lab} {_num(v)}")
    return out


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# (engine.metrics() key, metric name, kind, help): the scalar families
_ENGINE_SCALARS = (
    ("num_drafts", "spec_decode_num_drafts", "counter",
     "Number of spec decoding drafts (verification rounds that proposed tokens)."),
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "counter",
     "Number of draft tokens proposed."),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "counter",
     "Number of draft tokens accepted."),
    ("pool_hits", "pool_hits", "counter",
     "Phrase-pool lookups that found a phrase (Ouroboros; shared or per-request pools)."),
    ("pool_lookups", "pool_lookups", "counter", "Phrase-pool lookups."),
    ("pool_hit_rate", "pool_hit_rate", "gauge", "pool_hits / pool_lookups since start."),
    ("free_rounds", "spec_decode_num_free_rounds", "counter",
     "Row rounds whose draft came free from the context or the pool, with no draft forward "
     "(Ouroboros' free drafts)."),
    ("draft_rounds", "spec_decode_num_draft_rounds", "counter",
     "Row rounds whose draft the draft model drafted (Ouroboros)."),
    ("draft_forwards", "spec_decode_num_draft_forwards", "counter",
     "Draft-model forwards (Ouroboros; batch forwards, catch-up ones included)."),
    ("catch_up_forwards", "spec_decode_num_catch_up_forwards", "counter",
     "Draft forwards feeding the draft the tokens free rounds committed (Ouroboros)."),
    ("busy_slots", "num_requests_running", "gauge", "Slots serving a request now."),
    ("slots", "num_slots", "gauge", "Slots (rows of the device state) in the engine."),
    ("queue_length", "num_requests_waiting", "gauge", "Requests waiting for a free slot."),
    ("requests_cancelled", "num_requests_cancelled", "counter",
     "Requests cancelled (client disconnects, stops)."),
    ("prompt_tokens", "prompt_tokens", "counter", "Prefilled prompt tokens."),
    ("generation_tokens", "generation_tokens", "counter", "Generated tokens."),
    ("steps", "engine_steps", "counter", "Device steps (k rounds each) the engine ran."),
)


def render(engine_metrics: dict, server: Optional[ServerMetrics] = None,
           model_name: str = "") -> str:
    """Engine.metrics() (+ the server's own histograms) -> Prometheus text exposition."""
    m = engine_metrics
    lines: list[str] = []
    for key, name, kind, help_ in _ENGINE_SCALARS:
        if key in m and isinstance(m[key], (int, float)) and m[key] is not None:
            lines += _family(name, kind, help_, [(None, m[key])])
    per_pos = m.get("num_accepted_tokens_per_pos")
    if per_pos is not None:
        lines += _family("spec_decode_num_accepted_tokens_per_pos", "counter",
                         "Accepted draft tokens by their position in the draft (0 = first).",
                         [({"position": i}, int(v)) for i, v in enumerate(per_pos)])
    by_source = m.get("accepted_by_source")
    if by_source:
        lines += _family("spec_decode_num_accepted_tokens_by_source", "counter",
                         "Accepted draft tokens by where they came from (the draft model's "
                         "chain, phrase-pool phrases, spans of the context).",
                         [({"source": s}, int(v)) for s, v in by_source.items()])
    if server is not None:
        fam = [({"endpoint": e, "finished_reason": r}, n)
               for (e, r), n in sorted(server.finished.items())]
        lines += _family("request_success", "counter",
                         "Finished requests by endpoint and finish reason.", fam or [(None, 0)])
        lines += _family("request_errors", "counter", "Requests refused, by HTTP status.",
                         [({"status": s}, n) for s, n in sorted(server.errors.items())]
                         or [(None, 0)])
        lines += server.e2e.lines(PREFIX + "e2e_request_latency_seconds",
                                  "End-to-end request latency (arrival to last token).")
        lines += server.ttft.lines(PREFIX + "time_to_first_token_seconds",
                                   "Time from arrival to the first generated token.")
    if model_name:
        lines += _family("model_info", "gauge", "The model served (value 1).",
                         [({"model_name": model_name}, 1)])
    return "\n".join(lines) + "\n"


class _Row(NamedTuple):
    """A busy slot's rounds in a step, as `EngineCounters.rows` reads them."""

    kept: list
    proposed: list
    sources: dict


class EngineCounters:
    """The engine's cumulative counters (vLLM's spec-decode names), kept by the step loop;
    `snapshot` is what `Engine.metrics()` reports. hist: bins of a request's acceptance
    histogram (the most tokens one round gives a row, + 1); sources: the method's draft
    sources (`MethodSpec.sources`; none: plain decoding, no spec-decode counters); pool:
    whether it keeps a phrase pool (else no pool counters)."""

    SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "num_accepted_tokens_per_pos", "accepted_by_source")
    POOL_KEYS = ("pool_hits", "pool_lookups", "pool_hit_rate")
    # Ouroboros' rounds by kind (free drafts: verified with no draft forward / drafted) and
    # its draft forwards (of them, catch-up ones after free rounds): cumulative on the device
    KIND_KEYS = ("free_rounds", "draft_rounds", "draft_forwards", "catch_up_forwards")

    def __init__(self, hist: int, sources: tuple = ("draft_chain",), pool: bool = True):
        self.c = dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                      num_accepted_tokens_per_pos=[0] * (hist - 2 if hist > 2 else 0),
                      pool_hits=0, pool_lookups=0, requests_finished=0,
                      requests_cancelled=0, prompt_tokens=0, generation_tokens=0, steps=0)
        self.sources, self.pool = tuple(sources), pool
        self.by_source = {s: 0 for s in self.sources}
        self.hits_seen = 0
        # a method drafting with a draft model and keeping a pool (Ouroboros) reports its
        # rounds by kind
        self.kinds = pool and "draft_chain" in self.sources
        self.c.update({k: 0 for k in self.KIND_KEYS})
        self.own_seen = {k: 0 for k in self.KIND_KEYS}
        self.levels_used: dict = {}

    def step(self, busy: int, cfg_name: str, hits: int, lookups: int,
             own: Optional[dict] = None) -> None:
        """One device step with `busy` slots under the config named cfg_name; hits: the
        pool's cumulative hit counter; lookups: the rounds that looked the pool up; own: the
        method's cumulative counters (`executor.OWN_COUNTERS`), of which KIND_KEYS are kept
        as the step's increase."""
        self.c["steps"] += 1
        for k in self.KIND_KEYS:
            if own and k in own:
                self.c[k] += own[k] - self.own_seen[k]
                self.own_seen[k] = own[k]
        key = (busy, cfg_name)
        self.levels_used[key] = self.levels_used.get(key, 0) + 1
        self.c["pool_hits"] += hits - self.hits_seen
        self.hits_seen = hits
        self.c["pool_lookups"] += lookups

    def rows(self, rows: Iterable) -> None:
        """One step's busy slots: per slot (as `executor.RowOutput`) `kept` and `proposed`
        per round it took part in (tokens kept, draft tokens offered) and `sources`, its
        accepted draft tokens {source: n}. Plain Python over a few dozen rounds: a numpy
        operation per counter cost more host time per step than the whole loop."""
        c, pos, by_source = self.c, self.c["num_accepted_tokens_per_pos"], self.by_source
        for row in rows:
            for s, n in row.sources.items():
                if s in by_source:
                    by_source[s] += n
            for kept, offered in zip(row.kept, row.proposed):
                if offered > 0:
                    c["num_drafts"] += 1
                    c["num_draft_tokens"] += offered
                acc = kept - 1
                if acc > 0:
                    c["num_accepted_tokens"] += acc
                    for j in range(min(acc, len(pos))):
                        pos[j] += 1

    def rounds(self, kept: np.ndarray, live: np.ndarray, proposed: np.ndarray,
               sources: Optional[np.ndarray] = None) -> None:
        """`rows` from arrays over the busy slots: kept, live, proposed [k, busy] (tokens kept,
        whether the slot took part, draft tokens offered); sources int[busy, len(SOURCES)]."""
        src = np.zeros((kept.shape[1], len(SOURCES)), int) if sources is None else sources
        self.rows(_Row(k[a].tolist(), p[a].tolist(),
                       {s: int(x[SOURCES.index(s)]) for s in self.sources})
                  for k, a, p, x in zip(kept.T, live.T, proposed.T, np.asarray(src)))

    def ended(self, reason: str) -> None:
        self.c["requests_cancelled" if reason == "cancelled" else "requests_finished"] += 1

    def snapshot(self) -> dict:
        m = dict(self.c)
        m["num_accepted_tokens_per_pos"] = list(self.c["num_accepted_tokens_per_pos"])
        m["pool_hit_rate"] = m["pool_hits"] / m["pool_lookups"] if m["pool_lookups"] else 0.0
        m["accepted_by_source"] = dict(self.by_source)
        for k in ((() if self.sources else self.SPEC_KEYS) + (() if self.pool else self.POOL_KEYS)
                  + (() if self.kinds else self.KIND_KEYS)):
            m.pop(k, None)
        m["steps_per_level"] = {f"{b} busy: {c}": v for (b, c), v in
                                sorted(self.levels_used.items())}
        return m
