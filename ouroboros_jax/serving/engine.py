"""A continuous-batching engine over the method seam (`decoding/spec.py`).

The engine holds a fixed number of slots (rows) and one device state: the method's state over
all slots (sequences, caches, windows, the phrase pool) plus each slot's sampling knobs and
limits. It loops, on the calling thread (`step`) or a background one (`start`):

  1. requests waiting in the queue are prefilled into free slots (`insert` of that row only;
     the other rows keep going);
  2. one device step runs k = rounds_per_step rounds of the method on every slot in one
     jitted call (`common.run_rounds`; finished and empty slots are masked) and returns the
     tokens each slot received (`common.read_emitted`);
  3. the host streams those tokens to their requests, applies stop strings, and frees the
     slots whose request finished.

Compiled programs: one device step per (load-level config, sampling mode) and one insert per
prompt-width bucket, all at fixed shapes (slots, cache size); requests arriving and leaving
never recompile. The sampling mode is greedy (every busy slot greedy: no sort over the
vocabulary) or mixed (greedy and sampled requests in one batch, `SamplingParams.greedy_rows`).

Exactness: a slot's row runs the same rounds as `generate` on that prompt alone, so greedy
output equals `generate`'s whatever else is in the batch. A request samples from stream 0 of
its own seed (keys fold (seed, 0, position)), which is row 0 of `generate([prompt], seed=...)`:
its draws depend on neither its slot nor its neighbours. (Speculative decoding's accept rule
draws differently per gamma, so its sampled output is batch-independent under one load level.)

Phrase pool: one pool for every slot (shared_pool=True), kept across the engine's life
(`pool`, saved with `oj.save_pool`, given back with `pool=`); shared_pool=False gives each slot
its own key range of one pool (cleared when a new request takes the slot): per-request pools.

Speculation fitted to the load: `config` may map busy-slot counts to configs, e.g.
{1: OuroborosConfig(...), 4: "off"}; the level with the largest threshold <= busy slots runs.
"off" runs the method's plain round (one target token per row, the draft's cache kept in
step). config="auto" asks `decoding.auto` once per load level (1, 2, 4, .. slots). Levels
must share a state layout (`MethodSpec.family`).

Letters (package glossary): B slots, S cache slots, P prompt width, E tokens one step can give
a slot, k rounds per step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import queue
import threading
import time
from functools import partial
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..decoding import METHODS
from ..decoding.common import (Limits, make_pair, read_emitted, run_rounds, set_rows)
from ..request import (EOS_BUCKET, bucket, cache_slots, check_call, check_draft, check_model,
                       default_eos_ids, eos_array, is_int, is_real, prompt_ids)
from ..pool import PhrasePool, init_pool
from ..sampling import SamplingParams

OFF = "off"  # a load level without speculation


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's knobs. validate() (run on construction) raises ValueError naming the field.

    Attributes:
        max_tokens: the most tokens generated.
        temperature: 0 = greedy.
        top_p, top_k: nucleus and top-k filtering (1.0 and 0 = off).
        seed: the request's random stream (sampled tokens depend on it alone).
        stop_token_ids: ids that end the request (None: the model's default EOS ids, as
            generate picks them; () for none); at most 8.
        stop: stop strings, matched on the decoded text; the output is cut before the match.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: Optional[tuple] = None
    stop: tuple = ()

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not is_int(self.max_tokens) or not 0 < self.max_tokens < 2**31:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        t = self.temperature
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        ids = self.stop_token_ids
        if ids is not None:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)) \
                    or not all(is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0 (or None), "
                                 f"got {ids!r}")
            if len(ids) > EOS_BUCKET:
                raise ValueError(f"stop_token_ids holds {len(ids)} ids; at most {EOS_BUCKET}")
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, (tuple, list)) \
                or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")


class QueueFull(Exception):
    """submit() when max_queue requests are already waiting."""


@dataclasses.dataclass
class Delta:
    """Tokens that arrived for a request: token_ids and their newly decoded text (stop strings
    already cut; "" without a tokenizer)."""

    token_ids: list
    text: str


@dataclasses.dataclass
class RequestResult:
    """A finished request.

    Attributes:
        token_ids: the generated tokens (a stop id included when produced).
        text: their decoded text, cut before a stop string (None without a tokenizer).
        finish_reason: "stop" (a stop id or stop string), "length" (max_tokens) or "cancelled".
        prompt_tokens, completion_tokens: token counts.
        spec: this request's own speculative figures: mean_acceptance_length (tokens per
            round), acceptance_histogram (rounds by tokens kept), draft_tokens (draft tokens
            offered for verification), accepted_tokens (tokens past the target's own one per
            round).
        ttft_s, latency_s: seconds from submit to the first token and to the end.
    """

    token_ids: list
    text: Optional[str]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spec: dict
    ttft_s: float
    latency_s: float


_ids = itertools.count()


class RequestHandle:
    """A submitted request: iterate for its Deltas, `result()` for the whole, `cancel()`."""

    def __init__(self, engine: "Engine", prompt: list, params: RequestParams, eos: np.ndarray,
                 stop_ids: set):
        self.id = f"req-{next(_ids)}"
        self._engine = engine
        self.prompt = prompt
        self.params = params
        self._eos = eos
        self._stop_ids = stop_ids
        self._deltas: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._result: Optional[RequestResult] = None
        self._cancel = False
        self.t_submit = time.perf_counter()
        self.t_first: Optional[float] = None
        self.tokens: list = []
        self.text_sent = 0  # characters of decoded text already streamed
        self.kept: list = []  # tokens per round this request took part in
        self.proposed = 0

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Frees the slot at the next step (a disconnected client)."""
        self._cancel = True
        self._engine._wake()

    def __iter__(self):
        while True:
            d = self._deltas.get()
            if d is None:
                self._deltas.put(None)  # a second iteration ends at once
                return
            yield d

    def result(self, timeout: Optional[float] = None) -> RequestResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._result


@struct.dataclass
class _Device:
    """The engine's device state: the method's state over all slots, with each slot's knobs."""

    state: Any
    sp: SamplingParams
    limits: Limits


@struct.dataclass
class _Row:
    """One inserted request's knobs, [R] (or [R, n_eos])."""

    sp: SamplingParams
    limits: Limits


def _forget_keys(pool: PhrasePool, lo: jax.Array, hi: jax.Array) -> PhrasePool:
    """The pool with every slot whose key lies in [lo, hi) emptied (a per-request pool's key
    range, when a new request takes the slot)."""
    gone = (pool.keys >= lo) & (pool.keys < hi)
    return pool.replace(keys=jnp.where(gone, -1, pool.keys),
                        stamps=jnp.where(gone, 0, pool.stamps))


@partial(jax.jit, static_argnames=("insert_fn", "cfg", "vocab", "shared"), donate_argnums=(1,))
def _device_insert(pair, dev: _Device, rows, prompt, prompt_lengths, row: _Row, *, insert_fn,
                   cfg, vocab: int, shared: bool) -> _Device:
    state = dev.state
    if not shared:  # before the insert, which may fill the slot's range (context phrases)
        lo = rows[0] * vocab
        state = state.replace(pool=_forget_keys(state.pool, lo, lo + vocab * rows.shape[0]))
    state = insert_fn(pair, cfg, state, rows, prompt, prompt_lengths)
    return _Device(state, set_rows(dev.sp, rows, row.sp), set_rows(dev.limits, rows, row.limits))


@partial(jax.jit, static_argnames=("round_fn", "cfg", "greedy", "rounds", "width"),
         donate_argnums=(1,))
def _device_step(pair, dev: _Device, stop, *, round_fn, cfg, greedy: bool, rounds: int,
                 width: int):
    """stop bool[B]: slots freed since the last step (their rows end here). -> (device state,
    tokens int32[B,E], counts int32[B], kept int32[k,B], live bool[k,B], proposed int32[k,B],
    done bool[B], pool_hits int32[])."""
    st = dev.state
    st = st.replace(seq=st.seq.replace(done=st.seq.done | stop))
    since = st.seq.lengths
    st, kept, live, prop = run_rounds(partial(round_fn, pair, cfg, greedy, dev.sp, dev.limits),
                                      rounds, st)
    toks, counts = read_emitted(st.seq, since, width)
    hits = getattr(st.stats.own, "pool_hits", jnp.zeros((), jnp.int32))
    return dev.replace(state=st), toks, counts, kept, live, prop, st.seq.done, hits


class Engine:
    """Continuous batching over `slots` rows; see the module docstring.

    target, draft: `oj.load_model` models (draft for speculative and Ouroboros). method: a
    `decoding.METHODS` name. config: "auto", a method config, None (the paper's recipe) or
    {busy slots: config or "off"}. max_cache_len: prompt + max_tokens allowed per request
    (default: the target's max_position_embeddings); it fixes the cache size. rounds_per_step:
    rounds per device step (k). pool: a phrase pool to start from (shared_pool only).
    max_queue: waiting requests beyond which submit raises QueueFull.
    """

    def __init__(self, target, draft=None, *, method: str = "vanilla", config: Any = "auto",
                 slots: int = 8, max_cache_len: Optional[int] = None, rounds_per_step: int = 4,
                 pool: Optional[PhrasePool] = None, shared_pool: bool = True,
                 max_queue: int = 256):
        check_model(target, "target")
        if draft is not None:
            check_model(draft, "draft")
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
        for name, v, lo in (("slots", slots, 1), ("rounds_per_step", rounds_per_step, 1),
                            ("max_queue", max_queue, 1)):
            if not is_int(v) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not isinstance(shared_pool, bool):
            raise ValueError(f"shared_pool must be a bool, got {shared_pool!r}")
        spec = METHODS[method]
        check_draft(target, draft, method, spec.needs_draft)
        limit = target.config.max_position_embeddings
        if max_cache_len is not None:
            if not is_int(max_cache_len) or max_cache_len < 2:
                raise ValueError(f"max_cache_len must be an integer >= 2, got {max_cache_len!r}")
            limit = min(limit, int(max_cache_len))
        self.target, self.draft = target, draft
        self.tokenizer = target.tokenizer
        self.model_name = target.path or "model"
        self.slots, self.rounds, self.max_queue = int(slots), int(rounds_per_step), int(max_queue)
        self.limit = limit
        self.shared_pool = shared_pool
        V = target.config.vocab_size
        self.vocab = V
        # sizes against the models and device before auto's probes allocate (issue 24)
        check_call(spec, None, target, draft, self.slots, 16, 0, limit, batch_name="slots")
        levels = self._levels(method, spec, config, target, draft)
        cfgs = [c for _, c in levels if c is not OFF]
        if not cfgs and method != "vanilla":  # speculation off at every load: plain decoding
            method, spec, levels = "vanilla", METHODS["vanilla"], [(1, None)]
            cfgs = [None]
        self.method, self.spec = method, spec
        for c in cfgs:  # each load level's tree and pool against the cache and vocabulary
            check_call(spec, c, target, draft, self.slots, 16, 0, limit, batch_name="slots")
        base = cfgs[0]
        if spec.family is not None:
            fam = {spec.family(c) for c in cfgs}
            if len(fam) > 1:
                raise ValueError(f"config: the load levels' configs must share "
                                 f"{method}'s state layout (window, ngram, guesses, ...), got "
                                 f"{[c for c in cfgs]}")
        if spec.prepare is not None:
            if pool is not None and not shared_pool:
                raise ValueError("pool: a starting pool needs shared_pool=True")
            loop = lambda c: spec.prepare(c, None, V)[0]
            base_loop, self._pool0 = spec.prepare(base, pool, V)
            if not shared_pool:
                p = self._pool0
                self._pool0 = init_pool(V, p.guesses, p.phrase_len,
                                        min(V * self.slots, 65536), p.policy)
        else:
            if pool is not None:
                raise ValueError(f"pool: method={method!r} keeps no phrase pool")
            loop = lambda c: c
            base_loop, self._pool0 = base, None
        self.levels = [(n, OFF if c is OFF else loop(c)) for n, c in levels]
        self._base = base_loop
        margin = max(spec.margin(c) for c in cfgs)
        self.cache_slots = cache_slots(0, 0, margin, limit)
        self._width = self.rounds * max(spec.max_emit(c) for c in cfgs)
        self._pair = make_pair(target, draft)

        B, S = self.slots, self.cache_slots
        state = jax.jit(spec.init, static_argnums=(1, 2, 3))(self._pair, base_loop, B, S,
                                                             self._pool0)
        if not shared_pool and self._pool0 is not None:  # per-request pools: one key range a slot
            state = state.replace(key_offset=jnp.arange(B, dtype=jnp.int32) * V)
        self._default_eos = eos_array(default_eos_ids(target), V)
        self._dev = _Device(
            state,
            SamplingParams(temperature=jnp.ones((B,), jnp.float32),
                           top_k=jnp.zeros((B,), jnp.int32), top_p=jnp.ones((B,), jnp.float32),
                           seed=jnp.zeros((B,), jnp.uint32), stream=jnp.zeros((B,), jnp.int32),
                           greedy_rows=jnp.ones((B,), bool)),
            Limits(max_new_tokens=jnp.ones((B,), jnp.int32),
                   eos_token_id=jnp.full((B, EOS_BUCKET), -1, jnp.int32)))

        self._lock = threading.RLock()
        self._dev_lock = threading.Lock()  # the device state: donated by every device call
        self._cv = threading.Condition(self._lock)
        self._waiting: collections.deque = collections.deque()
        self._running: list = [None] * B
        self._stop_rows = np.zeros((B,), bool)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        hist = max(spec.max_emit(c) for c in cfgs) + 1
        self._m = dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                       num_accepted_tokens_per_pos=[0] * (hist - 2 if hist > 2 else 0),
                       pool_hits=0, pool_lookups=0, requests_finished=0,
                       requests_cancelled=0, prompt_tokens=0, generation_tokens=0, steps=0)
        self._hits_seen = 0
        self._levels_used: dict = {}

    # ------------------------------------------------------------------ configuration
    def _levels(self, method, spec, config, target, draft) -> list:
        """[(busy slots threshold, config or OFF)], thresholds ascending from 1."""
        if method == "vanilla":
            return [(1, None)]
        if isinstance(config, str) and config == "auto":
            return self._auto_levels(method, target, draft)
        if isinstance(config, dict):
            if not config or not all(is_int(k) and k >= 1 for k in config):
                raise ValueError("config: a load-level map needs integer keys >= 1 (busy slots)"
                                 f", got {sorted(config, key=str)}")
            if 1 not in config:
                raise ValueError("config: a load-level map needs a level for 1 busy slot")
            out = []
            for n in sorted(config):
                c = config[n]
                if isinstance(c, str) and c in (OFF, "vanilla"):
                    out.append((n, OFF))
                    continue
                out.append((n, self._one_config(method, spec, c)))
            return out
        return [(1, self._one_config(method, spec, config))]

    @staticmethod
    def _one_config(method, spec, c):
        if c is None:
            return spec.default_config()
        if not isinstance(c, spec.config_type):
            raise ValueError(f"config for method={method!r} must be a "
                             f"{spec.config_type.__name__}, 'auto', None, or a load-level map, "
                             f"got {c!r}")
        return c

    def _auto_levels(self, method, target, draft) -> list:
        """decoding.auto's choice per load level: batches of 1, 2, 4, .. slots. A level whose
        choice has another state layout than the first speculative one reuses that one."""
        from ..decoding.auto import auto_config

        V = target.config.vocab_size
        probe = [(7 * i + 3) % V for i in range(32)]
        out, first = [], None
        spec = METHODS[method]
        n = 1
        while True:
            prompt = jnp.asarray([probe] * n, jnp.int32)
            plens = jnp.full((n,), len(probe), jnp.int32)
            ch = auto_config(method, target, draft, prompt, plens,
                             cache_slots(0, 0, 0, self.limit))
            c = OFF if ch.method == "vanilla" else ch.config
            if c is not OFF:
                if first is None:
                    first = c
                elif spec.family is not None and spec.family(c) != spec.family(first):
                    c = first
            out.append((n, c))
            if n >= self.slots:
                break
            n = min(2 * n, self.slots)
        return out

    def _level(self, busy: int):
        cfg = self.levels[0][1]
        for n, c in self.levels:
            if n <= busy:
                cfg = c
        return cfg

    # ------------------------------------------------------------------ requests
    def _tokens(self, prompt) -> list:
        # one validation and chat rendering for generate and the engine (request.prompt_ids)
        return prompt_ids(self.target, prompt, "prompt")

    def submit(self, prompt, params: RequestParams = RequestParams()) -> RequestHandle:
        """prompt: token ids, a string, or chat messages (list of {"role","content"} dicts).
        Thread-safe. ValueError naming the problem (empty prompt, ids outside the vocabulary,
        prompt + max_tokens past the cache); QueueFull when the queue is full."""
        if not isinstance(params, RequestParams):
            raise ValueError(f"params must be a RequestParams, got {type(params).__name__}")
        params.validate()
        ids = self._tokens(prompt)
        if len(ids) + params.max_tokens > self.limit:
            raise ValueError(f"max_tokens: the prompt's {len(ids)} tokens + max_tokens="
                             f"{params.max_tokens} exceed the cache limit of {self.limit} tokens")
        if params.stop_token_ids is None:
            eos = self._default_eos
        else:
            bad = [i for i in params.stop_token_ids if i >= self.vocab]
            if bad:
                raise ValueError(f"stop_token_ids: id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.vocab})")
            eos = eos_array(list(params.stop_token_ids))
        h = RequestHandle(self, ids, params, eos, {int(i) for i in eos if i >= 0})
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is stopping; it takes no new requests")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(max_queue={self.max_queue})")
            self._waiting.append(h)
            self._cv.notify_all()
        return h

    def _wake(self):
        with self._lock:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the loop
    def _insert(self, slot: int, h: RequestHandle) -> None:
        p = h.params
        P = bucket(len(h.prompt))
        prompt = np.zeros((1, P), np.int32)
        prompt[0, :len(h.prompt)] = h.prompt
        greedy = p.temperature == 0
        row = _Row(
            SamplingParams(temperature=jnp.asarray([p.temperature if not greedy else 1.0],
                                                   jnp.float32),
                           top_k=jnp.asarray([min(p.top_k, self.vocab)], jnp.int32),
                           top_p=jnp.asarray([p.top_p], jnp.float32),
                           seed=jnp.asarray([p.seed], jnp.uint32),
                           stream=jnp.zeros((1,), jnp.int32),
                           greedy_rows=jnp.asarray([greedy])),
            Limits(max_new_tokens=jnp.asarray([p.max_tokens], jnp.int32),
                   eos_token_id=jnp.asarray(h._eos[None, :EOS_BUCKET], jnp.int32)))
        with self._dev_lock:
            self._dev = _device_insert(self._pair, self._dev, jnp.asarray([slot], jnp.int32),
                                       jnp.asarray(prompt),
                                       jnp.asarray([len(h.prompt)], jnp.int32), row,
                                       insert_fn=self.spec.insert, cfg=self._base,
                                       vocab=self.vocab,
                                       shared=self.shared_pool or self._pool0 is None)
        self._m["prompt_tokens"] += len(h.prompt)

    def step(self) -> bool:
        """One scheduler iteration on the calling thread (prefill waiting requests into free
        slots, one device step of k rounds, stream tokens, free finished slots). Returns
        whether anything is in flight or waiting."""
        with self._lock:
            for h in [h for h in self._waiting if h._cancel]:
                self._waiting.remove(h)
                self._finish(h, "cancelled")
            for i, h in enumerate(self._running):
                if h is not None and h._cancel:
                    self._finish(h, "cancelled")
                    self._free(i)
            admit = []
            for i in range(self.slots):
                if self._running[i] is None and self._waiting:
                    h = self._waiting.popleft()
                    self._running[i] = h
                    admit.append((i, h))
        for i, h in admit:
            self._insert(i, h)
            self._stop_rows[i] = False
        busy = [i for i, h in enumerate(self._running) if h is not None]
        if not busy:  # freed rows that are not done yet end at the next step
            return bool(self._waiting)
        cfg = self._level(len(busy))
        greedy = all(self._running[i].params.temperature == 0 for i in busy)
        toks, counts, kept, live, prop, done, hits = self._device_step(cfg, greedy)
        with self._lock:
            return self._host_update(busy, cfg, toks, counts, kept, live, prop, done, hits)

    def _device_step(self, cfg, greedy: bool):
        if cfg is OFF:
            round_fn, cfg_used = self.spec.plain_round, self._base
        else:
            round_fn, cfg_used = self.spec.round, cfg
        with self._dev_lock:
            out = _device_step(self._pair, self._dev, jnp.asarray(self._stop_rows),
                               round_fn=round_fn, cfg=cfg_used, greedy=greedy,
                               rounds=self.rounds, width=self._width)
            self._dev = out[0]
            self._stop_rows[:] = False
        return jax.device_get(out[1:])

    def warmup(self, prompt_widths: Sequence[int] = (16,)) -> None:
        """Compiles, while idle, the device step of every load level in both sampling modes
        and the insert of each prompt-width bucket, so the first requests wait for none."""
        with self._lock:
            if self._waiting or any(h is not None for h in self._running):
                raise RuntimeError("warmup() needs an idle engine")
            pool = self.pool  # the dummy prompts' n-grams (context phrases) must not stay
            for w in sorted({bucket(int(w)) for w in prompt_widths}):
                h = RequestHandle(self, [0] * min(w, self.limit - 1), RequestParams(max_tokens=1),
                                  self._default_eos, set())
                self._insert(0, h)
                self._m["prompt_tokens"] -= len(h.prompt)
                self._stop_rows[0] = True  # the dummy row ends before any round
            for _, c in self.levels:
                for greedy in (True, False):
                    self._device_step(c, greedy)
                    self._stop_rows[0] = False
            if pool is not None:
                with self._dev_lock:
                    self._dev = self._dev.replace(state=self._dev.state.replace(pool=pool))

    def _host_update(self, busy, cfg, toks, counts, kept, live, prop, done, hits) -> bool:
        self._m["steps"] += 1
        key = (len(busy), "off" if cfg is OFF else repr(cfg))
        self._levels_used[key] = self._levels_used.get(key, 0) + 1
        hits = int(hits)
        self._m["pool_hits"] += hits - self._hits_seen
        self._hits_seen = hits
        if cfg is not OFF and self.spec.prepare is not None:
            self._m["pool_lookups"] += int(live[:, busy].sum())
        now = time.perf_counter()
        for i in busy:
            h = self._running[i]
            n = int(counts[i])
            new = toks[i, :n].tolist()
            rk = kept[:, i][live[:, i]]
            h.kept.extend(int(x) for x in rk)
            pr = prop[:, i][live[:, i]]
            h.proposed += int(pr.sum())
            self._count_spec(rk, pr)
            reason = None
            if done[i]:
                reason = "stop" if new and new[-1] in h._stop_ids else "length"
            self._deliver(h, new, now, reason)
            if h.done:
                self._free(i, device_done=bool(done[i]))
        with self._lock:
            return any(h is not None for h in self._running) or bool(self._waiting)

    def _count_spec(self, kept: np.ndarray, proposed: np.ndarray) -> None:
        m = self._m
        for k, p in zip(kept.tolist(), proposed.tolist()):
            if p > 0:
                m["num_drafts"] += 1
                m["num_draft_tokens"] += p
            acc = max(k - 1, 0)
            m["num_accepted_tokens"] += acc
            pos = m["num_accepted_tokens_per_pos"]
            for j in range(min(acc, len(pos))):
                pos[j] += 1

    def _free(self, slot: int, device_done: bool = False) -> None:
        self._running[slot] = None
        if not device_done:
            self._stop_rows[slot] = True

    def _text(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _deliver(self, h: RequestHandle, new: list, now: float, reason: Optional[str]) -> None:
        """Streams new tokens to h (stop strings cut), finishing it with `reason` or at a stop
        string."""
        if new and h.t_first is None:
            h.t_first = now
        h.tokens.extend(new)
        self._m["generation_tokens"] += len(new)
        if self.tokenizer is None:
            if new:
                h._deltas.put(Delta(new, ""))
            if reason is not None:
                self._finish(h, reason)
            return
        text = self._text(h.tokens)
        stops = h.params.stop
        cut = None
        if stops:
            hits = [j for j in (text.find(s, max(h.text_sent - len(s) + 1, 0)) for s in stops)
                    if j >= 0]
            if hits:
                cut = min(hits)
        if cut is not None:
            text, reason = text[:cut], "stop"
            safe = len(text)
        elif reason is not None:
            safe = len(text)
        else:
            # hold back what may still become a stop string, or an unfinished UTF-8 character
            hold = max((len(s) - 1 for s in stops), default=0)
            safe = max(len(text) - hold, h.text_sent)
            while safe > h.text_sent and text[safe - 1] == "\ufffd":
                safe -= 1
        piece = text[h.text_sent:safe]
        h.text_sent = max(h.text_sent, safe)
        if new or piece:
            h._deltas.put(Delta(new, piece))
        if reason is not None:
            h.final_text = text
            self._finish(h, reason)

    def _finish(self, h: RequestHandle, reason: str) -> None:
        if h.done:
            return
        now = time.perf_counter()
        text = None
        if self.tokenizer is not None:
            text = getattr(h, "final_text", None)
            if text is None:
                text = self._text(h.tokens)
        rounds = len(h.kept)
        hist_len = max(self.spec.max_emit(c) for _, c in self.levels if c is not OFF) + 1 \
            if any(c is not OFF for _, c in self.levels) else 2
        hist = [0] * hist_len
        for k in h.kept:
            hist[min(k, hist_len - 1)] += 1
        spec = dict(mean_acceptance_length=(sum(h.kept) / rounds) if rounds else 0.0,
                    acceptance_histogram=hist, draft_tokens=h.proposed,
                    accepted_tokens=sum(max(k - 1, 0) for k in h.kept))
        h._result = RequestResult(
            token_ids=list(h.tokens), text=text, finish_reason=reason,
            prompt_tokens=len(h.prompt), completion_tokens=len(h.tokens), spec=spec,
            ttft_s=(h.t_first or now) - h.t_submit, latency_s=now - h.t_submit)
        if reason == "cancelled":
            self._m["requests_cancelled"] += 1
        else:
            self._m["requests_finished"] += 1
        h._done.set()
        h._deltas.put(None)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Runs step() on a background thread until stop()."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="ouroboros-engine",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                idle = not self._waiting and all(h is None for h in self._running)
                if idle and self._stopping:
                    return
                if idle:
                    self._cv.wait(0.05)
                    continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 -- a fault fails the requests in flight, not the thread
                self._fail_all(e)

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            for i, h in enumerate(self._running):
                if h is not None:
                    h.error = err
                    self._finish(h, "cancelled")
                    self._free(i)

    def stop(self, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """Stops the thread: finishes in-flight requests (or cancels them with cancel=True,
        finish_reason "cancelled"); waiting requests are cancelled. Also a context manager."""
        with self._lock:
            self._stopping = True
            while self._waiting:
                self._finish(self._waiting.popleft(), "cancelled")
            if cancel:
                for h in self._running:
                    if h is not None:
                        h._cancel = True
            self._cv.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            self._thread = None
        else:  # no thread: finish in-flight work here
            deadline = None if timeout is None else time.perf_counter() + timeout
            while self.step():
                if deadline is not None and time.perf_counter() > deadline:
                    break

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ reporting
    @property
    def pool(self) -> Optional[PhrasePool]:
        """A copy of the shared phrase pool as it is now (save with oj.save_pool); None for
        methods without one. (A copy: every device step donates the engine's own.)"""
        with self._dev_lock:
            pool = getattr(self._dev.state, "pool", None)
            return None if pool is None else jax.tree_util.tree_map(jnp.copy, pool)

    def metrics(self) -> dict:
        """Cumulative counters (vLLM's spec-decode names), pool hit rate, load and the config
        in use per load level."""
        with self._lock:
            m = dict(self._m)
            m["num_accepted_tokens_per_pos"] = list(self._m["num_accepted_tokens_per_pos"])
            m["pool_hit_rate"] = m["pool_hits"] / m["pool_lookups"] if m["pool_lookups"] else 0.0
            m["busy_slots"] = sum(h is not None for h in self._running)
            m["slots"] = self.slots
            m["queue_length"] = len(self._waiting)
            m["method"] = self.method
            m["configs"] = {n: ("off" if c is OFF else repr(c)) for n, c in self.levels}
            m["steps_per_level"] = {f"{b} busy: {c}": v for (b, c), v in
                                    sorted(self._levels_used.items())}
        return m
