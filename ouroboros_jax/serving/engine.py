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

Several processes (one model over hosts, `jax.distributed`): every device call runs on every
process, in the same order (SPMD). Process 0 leads: it holds the queue and the scheduler, and
before each device call (a prompt into a slot, a step, a pool read, the end) it broadcasts the
host decision as an `_Op` record (`distributed.broadcast`); the other processes follow
(`Engine.follow`): receive a record, run the same jitted call, repeat until the "stop" record.
A step's small outputs are replicated on every device, so each process reads them locally; an
idle leader sends an "idle" record every `IDLE_HEARTBEAT_S` so no follower waits in a
collective for long. On one process nothing is broadcast.

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
from ..distributed import (broadcast, check_same, fetch, is_leader, local, mesh_id, model_id,
                           model_spans_processes, spans_processes)
from ..request import (EOS_BUCKET, bucket, cache_slots, check_call, check_draft, check_model,
                       default_eos_ids, eos_array, is_int, is_real, prompt_ids)
from ..models.kv_cache import KVCache
from ..pool import PhrasePool, init_pool
from ..sampling import SamplingParams
from ..sharding import LOGICAL_AXES, spec_for

OFF = "off"  # a load level without speculation
# seconds an idle multi-process leader lets pass between records: a follower waits for the
# next one inside a collective, and a bounded wait stays clear of whatever timeout a backend's
# collectives have (gloo on CPU waited 200 s here without one)
IDLE_HEARTBEAT_S = 10.0


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


@dataclasses.dataclass(frozen=True)
class _Op:
    """One device call as the leader decided it: on a multi-process engine it is broadcast
    before the call, and every process runs the same call from it (plain numbers and numpy
    arrays, so it pickles small).

    kind: "insert" (a prompt into a slot), "step" (k rounds on every slot), "pool" (gather
    the phrase pool), "save_pool" / "restore_pool" (warmup keeps the pool as it was), "idle" (no device call: keeps a follower's wait short) or "stop" (the
    followers return).
    insert: slot; prompt int32[1,P] (padded to its bucket); prompt_len; knobs (temperature,
    top_k, top_p, seed, greedy, max_tokens); eos int32[EOS_BUCKET] (-1 pads).
    step: level (index into Engine.levels); greedy (every busy slot greedy); stop_rows bool[B]
    (slots freed since the last step).
    """

    kind: str
    slot: int = 0
    prompt: Optional[np.ndarray] = None
    prompt_len: int = 0
    knobs: tuple = ()
    eos: Optional[np.ndarray] = None
    level: int = 0
    greedy: bool = True
    stop_rows: Optional[np.ndarray] = None


def _place(target, draft, mesh, multi: bool):
    """The models placed on mesh (`shard_model`; models `load_sharded` onto it stay as they
    are). Over processes the 'model' axis must divide the query heads (`check_heads`), else
    every host would hold whole attention weights."""
    from ..sharding import check_heads, shard_model

    if multi:
        check_heads(target, mesh, "target")
        if draft is not None:
            check_heads(draft, mesh, "draft")
    return shard_model(target, mesh), None if draft is None else shard_model(draft, mesh)


def _placed(mesh, logical: tuple, x: jax.Array) -> jax.Array:
    """x constrained to the placement its logical axes (`sharding.RULES`) give on mesh."""
    spec = spec_for(logical + (None,) * (x.ndim - len(logical)), x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def _replicated(pair, tree):
    """tree's arrays replicated over the pair's mesh (as they are without one): a step's small
    outputs and the gathered pool, which every process then reads from its own devices."""
    if pair.mesh is None:
        return tree
    return jax.tree_util.tree_map(lambda x: _placed(pair.mesh, (), x), tree)


def dev_placements(mesh, dev: "_Device"):
    """The placement of every leaf of dev (or of its abstract shapes) on mesh, a pytree of
    `NamedSharding` shaped like dev: KV caches as `sharding.cache_spec` lays them out, leaves
    with a slot axis [B, ...] split over "data", the rest replicated. What `_pinned` pins, and
    what lowering a device call for a mesh gives its abstract state (`lowering.py`)."""
    B = dev.limits.max_new_tokens.shape[0]

    def at(logical: tuple, x):
        spec = spec_for(logical + (None,) * (len(x.shape) - len(logical)), x.shape, mesh)
        return jax.sharding.NamedSharding(mesh, spec)

    def one(x):
        if isinstance(x, KVCache):
            return KVCache(k=at(LOGICAL_AXES["cache"], x.k), v=at(LOGICAL_AXES["cache"], x.v),
                           lengths=at(("batch",), x.lengths))
        return at(("batch",) if len(x.shape) and x.shape[0] == B else (), x)

    return jax.tree_util.tree_map(one, dev, is_leaf=lambda x: isinstance(x, KVCache))


def _pinned(pair, dev: "_Device") -> "_Device":
    """dev with every leaf at one fixed placement on the pair's mesh (`dev_placements`; as it
    is without one). Each device call returns the placements it was given, so it compiles once
    (left to XLA's propagation, some leaves land elsewhere after an insert or a step, and the
    next call would compile again for them)."""
    if pair.mesh is None:
        return dev
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, dev,
                                  dev_placements(pair.mesh, dev))


@jax.jit
def _copy(tree):
    """A copy of tree in buffers of its own, placed as tree is (a device call donates the
    engine's state, so anything kept across calls must be a copy)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


@jax.jit
def _copy_replicated(pair, tree):
    """A copy of tree, replicated over the pair's mesh (a plain copy without one)."""
    return _replicated(pair, jax.tree_util.tree_map(jnp.copy, tree))


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
    return _pinned(pair, _Device(state, set_rows(dev.sp, rows, row.sp),
                                 set_rows(dev.limits, rows, row.limits)))


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
    return (_pinned(pair, dev.replace(state=st)),) + _replicated(
        pair, (toks, counts, kept, live, prop, st.seq.done, hits))


class Engine:
    """Continuous batching over `slots` rows; see the module docstring.

    target, draft: `oj.load_model` models (draft for speculative and Ouroboros). method: a
    `decoding.METHODS` name. config: "auto", a method config, None (the paper's recipe) or
    {busy slots: config or "off"}. max_cache_len: prompt + max_tokens allowed per request
    (default: the target's max_position_embeddings); it fixes the cache size. rounds_per_step:
    rounds per device step (k). pool: a phrase pool to start from (shared_pool only).
    max_queue: waiting requests beyond which submit raises QueueFull. mesh: a
    `sharding.make_mesh` mesh to place the models and the state on (None: as the models lie).

    Over several processes (a mesh, or models loaded with `load_sharded`, spanning processes
    joined by `jax.distributed`): every process builds the Engine with the same arguments
    (checked, `ValueError` naming what differs); process 0 leads (submit, step, start, warmup,
    stop: its scheduler decides) and every other process calls `follow()`, which runs the
    device calls the leader broadcasts before each one, until the leader's `stop()`.
    """

    def __init__(self, target, draft=None, *, method: str = "vanilla", config: Any = "auto",
                 slots: int = 8, max_cache_len: Optional[int] = None, rounds_per_step: int = 4,
                 pool: Optional[PhrasePool] = None, shared_pool: bool = True,
                 max_queue: int = 256, mesh: Optional[jax.sharding.Mesh] = None):
        check_model(target, "target")
        if draft is not None:
            check_model(draft, "draft")
        multi = spans_processes(mesh) or model_spans_processes(target)
        if multi:  # SPMD: engines that differ would pair their collectives wrongly and hang
            check_same("Engine", target=model_id(target), draft=model_id(draft), method=method,
                       config=repr(config), slots=slots, max_cache_len=max_cache_len,
                       rounds_per_step=rounds_per_step, shared_pool=shared_pool,
                       pool=None if pool is None else jax.tree_util.tree_leaves(fetch(pool)),
                       mesh=mesh_id(mesh) if isinstance(mesh, jax.sharding.Mesh) else None)
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
        # sizes against the models and device before auto's probes allocate (issue 24)
        check_call(spec, None, target, draft, int(slots), 16, 0, limit, mesh,
                   batch_name="slots")
        if mesh is not None:  # placed before auto: its probes time the models as steps run them
            target, draft = _place(target, draft, mesh, multi)
        self.target, self.draft = target, draft
        self.mesh, self._multi = mesh, multi
        self.tokenizer = target.tokenizer
        self.model_name = target.path or "model"
        self.slots, self.rounds, self.max_queue = int(slots), int(rounds_per_step), int(max_queue)
        self.limit = limit
        self.shared_pool = shared_pool
        V = target.config.vocab_size
        self.vocab = V
        levels = self._levels(method, spec, config, target, draft)
        cfgs = [c for _, c in levels if c is not OFF]
        if not cfgs and method != "vanilla":  # speculation off at every load: plain decoding
            method, spec, levels = "vanilla", METHODS["vanilla"], [(1, None)]
            cfgs = [None]
        self.method, self.spec = method, spec
        for c in cfgs:  # each load level's tree and pool against the cache and vocabulary
            check_call(spec, c, target, draft, self.slots, 16, 0, limit, mesh,
                       batch_name="slots")
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
        if self._pair.mesh is not None:  # the placements every device call keeps
            self._dev = jax.jit(_pinned)(self._pair, self._dev)

        self._lock = threading.RLock()
        self._dev_lock = threading.Lock()  # the device state: donated by every device call
        self._cv = threading.Condition(self._lock)
        self._waiting: collections.deque = collections.deque()
        self._running: list = [None] * B
        self._stop_rows = np.zeros((B,), bool)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._closed = False  # multi-process: the followers were sent "stop"
        self._broken: Optional[Exception] = None  # multi-process: a device call failed
        self._last_op = time.monotonic()
        self._saved_pool = None  # warmup: the pool as it was before its dummy inserts
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

    def _level(self, busy: int) -> int:
        """The load level that runs with `busy` slots busy: an index into self.levels."""
        level = 0
        for i, (n, _) in enumerate(self.levels):
            if n <= busy:
                level = i
        return level

    # ------------------------------------------------------------------ requests
    def _tokens(self, prompt) -> list:
        # one validation and chat rendering for generate and the engine (request.prompt_ids)
        return prompt_ids(self.target, prompt, "prompt")

    def submit(self, prompt, params: RequestParams = RequestParams()) -> RequestHandle:
        """prompt: token ids, a string, or chat messages (list of {"role","content"} dicts).
        Thread-safe. ValueError naming the problem (empty prompt, ids outside the vocabulary,
        prompt + max_tokens past the cache); QueueFull when the queue is full."""
        self._leader_only("submit")
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
            if self._broken is not None:
                raise RuntimeError(f"the engine's processes are out of step after an error: "
                                   f"{self._broken!r}")
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
        prompt = np.zeros((1, bucket(len(h.prompt))), np.int32)
        prompt[0, :len(h.prompt)] = h.prompt
        knobs = (float(p.temperature), int(p.top_k), float(p.top_p), int(p.seed),
                 p.temperature == 0, int(p.max_tokens))
        with self._dev_lock:
            self._lead(_Op("insert", slot=slot, prompt=prompt, prompt_len=len(h.prompt),
                           knobs=knobs, eos=np.asarray(h._eos[:EOS_BUCKET], np.int32)))
        self._m["prompt_tokens"] += len(h.prompt)

    def _apply_insert(self, op: _Op) -> None:
        """Prefills op.prompt into slot op.slot with the request's knobs."""
        temperature, top_k, top_p, seed, greedy, max_tokens = op.knobs
        row = _Row(
            SamplingParams(temperature=jnp.asarray([temperature if not greedy else 1.0],
                                                   jnp.float32),
                           top_k=jnp.asarray([min(top_k, self.vocab)], jnp.int32),
                           top_p=jnp.asarray([top_p], jnp.float32),
                           seed=jnp.asarray([seed], jnp.uint32),
                           stream=jnp.zeros((1,), jnp.int32),
                           greedy_rows=jnp.asarray([greedy])),
            Limits(max_new_tokens=jnp.asarray([max_tokens], jnp.int32),
                   eos_token_id=jnp.asarray(op.eos[None], jnp.int32)))
        self._dev = _device_insert(self._pair, self._dev, jnp.asarray([op.slot], jnp.int32),
                                   jnp.asarray(op.prompt),
                                   jnp.asarray([op.prompt_len], jnp.int32), row,
                                   insert_fn=self.spec.insert, cfg=self._base, vocab=self.vocab,
                                   shared=self.shared_pool or self._pool0 is None)

    def step(self) -> bool:
        """One scheduler iteration on the calling thread (prefill waiting requests into free
        slots, one device step of k rounds, stream tokens, free finished slots). Returns
        whether anything is in flight or waiting."""
        self._leader_only("step")
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
        level = self._level(len(busy))
        cfg = self.levels[level][1]
        greedy = all(self._running[i].params.temperature == 0 for i in busy)
        toks, counts, kept, live, prop, done, hits = self._device_step(level, greedy)
        with self._lock:
            return self._host_update(busy, cfg, toks, counts, kept, live, prop, done, hits)

    def _device_step(self, level: int, greedy: bool):
        """k rounds on every slot under load level `level` (an index into self.levels) ->
        the step's outputs on the host (see `_device_step`, the jitted one)."""
        with self._dev_lock:
            out = self._lead(_Op("step", level=level, greedy=greedy,
                                 stop_rows=self._stop_rows.copy()))
            self._stop_rows[:] = False
        return out

    def _apply_step(self, op: _Op):
        cfg = self.levels[op.level][1]
        if cfg is OFF:
            round_fn, cfg_used = self.spec.plain_round, self._base
        else:
            round_fn, cfg_used = self.spec.round, cfg
        out = _device_step(self._pair, self._dev, jnp.asarray(op.stop_rows),
                           round_fn=round_fn, cfg=cfg_used, greedy=op.greedy,
                           rounds=self.rounds, width=self._width)
        self._dev = out[0]
        # replicated over the mesh: every process reads them from its own devices
        return fetch(out[1:])

    # ------------------------------------------------------------------ lockstep
    def _leader_only(self, what: str) -> None:
        if self._multi and not is_leader():
            raise RuntimeError(f"{what}: process {jax.process_index()} follows process 0, "
                               "which serves the requests; call follow() here instead")

    def _lead(self, op: _Op):
        """Runs op's device call here; on a multi-process engine op is first broadcast, so
        every follower runs the same call (the caller holds _dev_lock: one call at a time)."""
        if self._multi:
            if self._closed:
                raise RuntimeError("the engine has stopped: its followers have returned")
            if self._broken is not None:
                raise RuntimeError(f"the engine's processes may be out of step after an "
                                   f"error: {self._broken!r}") from self._broken
            try:
                broadcast(op)
                self._last_op = time.monotonic()
                if op.kind == "stop":
                    self._closed = True
                    return None
                return self._apply(op)
            except Exception as e:  # a collective failed midway: no further call is safe
                self._broken = e
                raise
        return self._apply(op)

    def _apply(self, op: _Op):
        """The device call op stands for (the caller holds _dev_lock)."""
        if op.kind == "insert":
            return self._apply_insert(op)
        if op.kind == "step":
            return self._apply_step(op)
        if op.kind == "pool":
            pool = getattr(self._dev.state, "pool", None)
            if pool is None:
                return None
            # a copy (every step donates the engine's own); on a mesh replicated in one call,
            # then read from this process's devices and placed on its default device
            pool = _copy_replicated(self._pair, pool)
            return local(pool) if self._pair.mesh is not None else pool
        if op.kind == "save_pool":  # every process keeps its own part of the same copy
            pool = getattr(self._dev.state, "pool", None)
            self._saved_pool = None if pool is None else _copy(pool)
            return None
        if op.kind == "restore_pool":
            if self._saved_pool is not None:
                self._dev = self._dev.replace(
                    state=self._dev.state.replace(pool=self._saved_pool))
            self._saved_pool = None
            return None
        if op.kind == "idle":
            return None
        raise ValueError(f"unknown engine op {op.kind!r}")

    def follow(self) -> int:
        """On every process but 0 of a multi-process engine: runs the device calls process 0
        broadcasts, in its order, until its stop(); returns how many ran. A leader that dies
        ends the wait with an error (jax.distributed notices the lost peer)."""
        if not self._multi:
            raise RuntimeError("follow() is for an engine whose mesh spans processes")
        if is_leader():
            raise RuntimeError("follow(): process 0 leads (submit, step, start); the other "
                               "processes follow")
        n = 0
        while True:
            op = broadcast(None)
            if op.kind == "stop":
                self._closed = True
                return n
            with self._dev_lock:
                self._apply(op)
            n += op.kind != "idle"

    def _heartbeat(self) -> None:
        """An idle leader's "idle" record, every IDLE_HEARTBEAT_S: followers never wait in a
        collective for long, whatever the collectives' timeouts are."""
        if self._multi and not self._closed and self._broken is None \
                and time.monotonic() - self._last_op > IDLE_HEARTBEAT_S:
            with self._dev_lock:
                self._lead(_Op("idle"))

    def warmup(self, prompt_widths: Sequence[int] = (16,)) -> None:
        """Compiles, while idle, the device step of every load level in both sampling modes
        and the insert of each prompt-width bucket, so the first requests wait for none."""
        self._leader_only("warmup")
        with self._lock:
            if self._waiting or any(h is not None for h in self._running):
                raise RuntimeError("warmup() needs an idle engine")
            with self._dev_lock:  # the dummy prompts' n-grams (context phrases) must not stay
                self._lead(_Op("save_pool"))
            for w in sorted({bucket(int(w)) for w in prompt_widths}):
                h = RequestHandle(self, [0] * min(w, self.limit - 1), RequestParams(max_tokens=1),
                                  self._default_eos, set())
                self._insert(0, h)
                self._m["prompt_tokens"] -= len(h.prompt)
                self._stop_rows[0] = True  # the dummy row ends before any round
            for level in range(len(self.levels)):
                for greedy in (True, False):
                    self._device_step(level, greedy)
                    self._stop_rows[0] = False
            with self._dev_lock:
                self._lead(_Op("restore_pool"))

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
        self._leader_only("start")
        if self._closed:
            raise RuntimeError("a multi-process engine cannot start again after stop(): its "
                               "followers have returned")
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
            try:
                if idle:
                    self._heartbeat()
                else:
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
        finish_reason "cancelled"); waiting requests are cancelled. Also a context manager.
        On a multi-process engine it then sends the followers "stop" (their follow() returns),
        and the engine cannot start again."""
        self._leader_only("stop")
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
        self._release_followers()

    def _release_followers(self) -> None:
        """The "stop" record, once; not after an error (the followers have failed with it, and
        a collective now might never return)."""
        if self._multi and not self._closed and self._broken is None:
            with self._dev_lock:
                self._lead(_Op("stop"))

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ reporting
    @property
    def running(self) -> bool:
        """False once a multi-process engine can run no more device calls (stopped, or a call
        failed, e.g. a peer process died): the server's /health then answers 503."""
        return not self._closed and self._broken is None

    @property
    def pool(self) -> Optional[PhrasePool]:
        """A copy of the shared phrase pool as it is now (save with oj.save_pool); None for
        methods without one. (A copy: every device step donates the engine's own. Over
        processes: gathered from every process, on process 0's default device.)"""
        self._leader_only("pool")
        with self._dev_lock:
            return self._lead(_Op("pool"))

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
