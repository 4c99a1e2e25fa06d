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

On the background thread step k+1 is dispatched before step k's outputs are read (3. runs
while the device computes the next step): a slot freed in 3. is then refilled one step later.

The jobs live in modules of their own: `scheduler` (queue, slots, load levels), `executor`
(device state, its placement, the jitted insert and step), `lockstep` (the multi-process
protocol), `handle` and `output` (a request's deltas, text and stop strings), `metrics`,
`warmup` (every program compiled before the first request) and `sizing` (serve's slots and
cache from a memory budget).

Exactness: a slot's row runs the same rounds as `generate` on that prompt alone, so greedy
output equals `generate`'s whatever else is in the batch. A request samples from stream 0 of
its own seed (keys fold (seed, 0, position)), which is row 0 of `generate([prompt], seed=...)`:
its draws depend on neither its slot nor its neighbours. (Speculative decoding's accept rule
draws differently per gamma, so its sampled output is batch-independent under one load level.)

Phrase pool: one pool for every slot (shared_pool=True), kept across the engine's life
(`pool`, saved with `oj.save_pool`, given back with `pool=`); shared_pool=False gives each slot
its own key range of one pool (cleared when a new request takes the slot): per-request pools.

Several processes (one model over hosts, `jax.distributed`): process 0 leads and the others
`follow()` (see `lockstep`). On one process nothing is broadcast.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from ..auto import AutoTuner
from ..decoding import METHODS, PLAIN
from ..decoding.common import make_pair
from ..distributed import fetch, is_leader
from ..pool import PhrasePool, ranged_pool
from ..request import (RequestParams, ValidRequest, cache_slots, check_call,
                       default_eos_ids, default_method, eos_array, place_models, prompt_ids,
                       validate_request)
from .executor import (OFF, DeviceState, Executor, blank_knobs, device_insert,
                       device_step, engine_state, pinned)
from .engine_args import check_args
from .handle import Delta, QueueFull, RequestHandle, RequestResult  # noqa: F401  (re-exported)
from .lockstep import Lockstep, Op
from .metrics import EngineCounters
from .row_buckets import buckets
from .scheduler import Plan, Scheduler, auto_levels, check_family, load_levels
from .structured import blank_limits, constrain, insert_ops, with_table
from .warmup import Progress, compile_programs

# the jitted calls by the names tests count their compiles by
_device_step, _device_insert = device_step, device_insert


class Engine:
    """Continuous batching over `slots` rows; see the module docstring.

    target, draft: `oj.load_model` models (draft for speculative and Ouroboros). method: a
    `decoding.METHODS` name (None: Ouroboros with a draft, else plain decoding). config:
    "auto", a method config, None (the paper's recipe) or {busy slots: config or "off"}.
    max_cache_len: prompt + max_tokens allowed per request (default: the target's
    max_position_embeddings); it fixes the cache size. rounds_per_step:
    rounds per device step (k). pool: a phrase pool to start from (shared_pool only).
    max_queue: waiting requests beyond which submit raises QueueFull. mesh: a
    `sharding.make_mesh` mesh to place the models and the state on (None: as the models lie).
    constraint_states, constraint_classes: each slot's share of the structured-output table
    (`serving/structured.py`; 0: response_format refused).

    Over several processes (a mesh, or models loaded with `load_sharded`, spanning processes
    joined by `jax.distributed`): every process builds the Engine with the same arguments
    (checked, `ValueError` naming what differs); process 0 leads (submit, step, start, warmup,
    stop: its scheduler decides) and every other process calls `follow()`, which runs the
    device calls the leader broadcasts before each one, until the leader's `stop()`.
    """

    def __init__(self, target, draft=None, *, method: Optional[str] = None, config: Any = "auto",
                 slots: int = 8, max_cache_len: Optional[int] = None, rounds_per_step: int = 4,
                 pool: Optional[PhrasePool] = None, shared_pool: bool = True,
                 max_queue: int = 256, mesh: Optional[jax.sharding.Mesh] = None,
                 constraint_states: int = 512, constraint_classes: int = 1024):
        method = default_method(method, draft is not None)  # None: Ouroboros with a draft
        spec, multi, limit = check_args(target, draft, method, config, slots, max_cache_len,
                                         rounds_per_step, pool, shared_pool, max_queue, mesh)
        # placed before auto: its probes time the models as steps run them
        target, draft = place_models(target, draft, mesh, multi)
        self.target, self.draft, self.mesh, self._multi = target, draft, mesh, multi
        self.tokenizer = target.tokenizer
        self.model_name = target.path or "model"
        self.slots, self.rounds, self.max_queue = int(slots), int(rounds_per_step), int(max_queue)
        self.limit, self.shared_pool, self.vocab = limit, shared_pool, target.config.vocab_size
        self.constraint_region = (int(constraint_states), int(constraint_classes))
        self._default_eos = eos_array(default_eos_ids(target), self.vocab)
        self.tuner = AutoTuner()  # config="auto"'s: this engine's own prices and choices
        levels = load_levels(method, spec, config, lambda: auto_levels(
            self.tuner, method, spec, target, draft, self.slots, limit))
        cfgs = [c for _, c in levels if c is not OFF]
        if not cfgs:  # speculation off at every load: plain decoding
            method, spec, levels, cfgs = PLAIN, METHODS[PLAIN], [(1, None)], [None]
        self.method, self.spec = method, spec
        for c in cfgs:  # each load level's tree and pool against the cache and vocabulary
            check_call(spec, c, target, draft, self.slots, 16, 0, limit, mesh,
                       batch_name="slots")
        check_family(method, spec, cfgs)
        self.levels, base, pool0 = self._loop_configs(spec, levels, cfgs[0], pool)
        self._labels = ["off" if c is OFF else repr(c) for _, c in self.levels]  # per level
        self.cache_slots = cache_slots(0, 0, max(spec.margin(c) for c in cfgs), limit)
        self._hist = max(spec.max_emit(c) for c in cfgs) + 1
        pair = make_pair(target, draft)
        self._executor = Executor(pair, spec, base, self.levels, self.rounds,
                                  self.rounds * (self._hist - 1), self.vocab,
                                  shared_pool or pool0 is None,
                                  self._blank(pair, spec, base, pool0))
        self._lockstep = Lockstep(self._apply, multi, on_lost=self._fail_all)
        self.row_sizes = buckets(self.slots, sharded=pair.mesh is not None)
        self._sched = Scheduler(self.slots, self.max_queue, self.levels, self.row_sizes)
        self._counters = EngineCounters(self._hist, spec.sources, spec.keeps_pool)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def _loop_configs(self, spec, levels, base, pool):
        """The configs the compiled steps see and the pool the state starts from (a method
        that keeps one: `MethodSpec.prepare`) -> (levels, base loop config, pool)."""
        if not spec.keeps_pool:
            if pool is not None:
                raise ValueError(f"pool: method={self.method!r} keeps no phrase pool")
            return levels, base, None
        if pool is not None and not self.shared_pool:
            raise ValueError("pool: a starting pool needs shared_pool=True")
        base_loop, pool0 = spec.prepare(base, pool, self.vocab)
        if not self.shared_pool:  # per-request pools: one key range a slot
            pool0 = ranged_pool(pool0, self.slots)
        levels = [(n, OFF if c is OFF else spec.prepare(c, None, self.vocab)[0])
                  for n, c in levels]
        return levels, base_loop, pool0

    def _blank(self, pair, spec, base, pool0) -> DeviceState:
        """The device state before any request, placed on the mesh."""
        B = self.slots
        state = engine_state(jax.jit(spec.init, static_argnums=(1, 2, 3))(
            pair, base, B, self.cache_slots, pool0), min(self.constraint_region) > 0)
        if not self.shared_pool and pool0 is not None:  # slot i's keys start at i * vocab
            state = state.replace(key_offset=jnp.arange(B, dtype=jnp.int32) * self.vocab)
        sp, limits = blank_knobs(B)
        dev = DeviceState(state, sp, blank_limits(limits, B, self.vocab, self.constraint_region))
        return jax.jit(pinned)(pair, dev) if pair.mesh is not None else dev

    @property
    def default_stop_ids(self) -> tuple:
        """The model's own EOS ids (what a request without stop_token_ids stops at)."""
        e = default_eos_ids(self.target)
        return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    # ------------------------------------------------------------------ requests
    def tokens(self, prompt) -> list:
        """prompt (token ids, a string or chat messages) -> its token ids, a chat rendered
        once (`request.prompt_ids`); FieldError naming the prompt."""
        return prompt_ids(self.target, prompt, "prompt")

    def validate(self, ids: list, params: RequestParams) -> ValidRequest:
        """Token ids (from `tokens`) and knobs -> the request as submit queues it; FieldError
        naming the field (prompt or max_tokens past the cache, stop ids outside the
        vocabulary)."""
        req = validate_request(ids, params, limit=self.limit, vocab_size=self.vocab,
                               default_eos=self._default_eos)
        return with_table(req, self.tokenizer, self.vocab, self.constraint_region)

    def submit(self, prompt, params: RequestParams = RequestParams()) -> RequestHandle:
        """prompt: token ids, a string, chat messages (list of {"role","content"} dicts), or a
        ValidRequest (`validate`; params then unused). Thread-safe. ValueError (a FieldError)
        naming the problem (empty prompt, ids outside the vocabulary, prompt + max_tokens past
        the cache); QueueFull when the queue is full."""
        self._leader_only("submit")
        req = prompt if isinstance(prompt, ValidRequest) else self.validate(
            self.tokens(prompt), params)
        h = RequestHandle(req, self.tokenizer, self._wake)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is stopping; it takes no new requests")
            if self._lockstep.broken is not None:
                raise RuntimeError(f"the engine's processes are out of step after an error: "
                                   f"{self._lockstep.broken!r}")
            self._sched.enqueue(h)
            self._cv.notify_all()
        return h

    def _wake(self) -> None:
        with self._lock:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the loop
    def _apply(self, op: Op):
        """The device call op stands for, on this process (the lockstep serializes them)."""
        ex = self._executor
        calls = {"insert": lambda: ex.insert(op.packed),
                 "constraint": lambda: constrain(ex, op.packed),
                 "step": lambda: ex.step(op.level, op.greedy, op.stop_rows, op.logprobs,
                                         op.rows, op.constrained),
                 "pool": ex.pool_copy, "save_pool": ex.save_pool,
                 "restore_pool": ex.restore_pool, "idle": lambda: None}
        if op.kind not in calls:
            raise ValueError(f"unknown engine op {op.kind!r}")
        return calls[op.kind]()

    def step(self) -> bool:
        """One scheduler iteration on the calling thread (prefill waiting requests into free
        slots, one device step of k rounds, stream tokens, free finished slots). Returns
        whether anything is in flight or waiting."""
        self._leader_only("step")
        launched = self._launch()
        if launched is not None:
            self._process(*launched)
        with self._lock:
            return not self._sched.idle

    def _launch(self) -> Optional[tuple[Plan, jax.Array]]:
        """Cancelled requests out, waiting ones in, and the next step dispatched (not waited
        for) -> (its plan, its outputs on the device), or None with no slot busy."""
        with self._lock:
            for h in self._sched.reap():
                self._end(h, "cancelled")
            admitted = self._sched.admit()
        for slot, h in admitted:
            for op in insert_ops(slot, h.request, self.constraint_region):
                self._lockstep.lead(op)
            self._counters.c["prompt_tokens"] += len(h.prompt)
        with self._lock:
            plan = self._sched.plan()
        if plan is None:
            return None
        return plan, self._lockstep.lead(Op("step", level=plan.level, greedy=plan.greedy,
                                             stop_rows=plan.stop_rows, logprobs=plan.logprobs,
                                             rows=plan.rows, constrained=plan.constrained))

    def _process(self, plan: Plan, packed: jax.Array) -> None:
        """A step's outputs on the host (waiting for the device): tokens streamed to their
        requests, spec counters kept, finished requests ended and their slots freed."""
        # replicated over the mesh: every process reads its own devices
        out = self._executor.read(fetch(packed), plan.logprobs)
        now = time.perf_counter()
        pooled = self.levels[plan.level][1] is not OFF and self.spec.keeps_pool
        rows = out.rows(plan.busy, self.spec.sources)
        with self._lock:
            self._counters.step(len(rows), self._labels[plan.level], out.hits,
                                sum(len(r.kept) for r in rows) if pooled else 0, out.own)
            self._counters.rows(rows)
            for i, h, row in zip(plan.busy, plan.handles, rows):
                if self._sched.running[i] is not h:  # ended since (cancelled, or overlapped)
                    continue
                new = row.tokens
                h.record(row.kept, sum(row.proposed), row.sources)
                self._counters.c["generation_tokens"] += len(new)
                reason = ("stop" if new and new[-1] in h.request.stop_ids else "length") \
                    if row.done else None
                reason = h.deliver(new, now, reason,
                                   out.row_logprobs(i, len(new), h.params.logprobs))
                if reason is not None:
                    self._end(h, reason)
                    self._sched.free(i, device_done=row.done)

    def _end(self, h: RequestHandle, reason: str,
             error: Optional[BaseException] = None) -> None:
        if h.finish(reason, self._hist, error) is not None:
            self._counters.ended(reason)

    # ------------------------------------------------------------------ lockstep
    def _leader_only(self, what: str) -> None:
        if self._multi and not is_leader():
            raise RuntimeError(f"{what}: process {jax.process_index()} follows process 0, "
                               "which serves the requests; call follow() here instead")

    def follow(self) -> int:
        """On every process but 0 of a multi-process engine: runs the device calls process 0
        broadcasts, in its order, until its stop(); returns how many ran. A leader that dies
        ends the wait with an error (jax.distributed notices the lost peer)."""
        if not self._multi:
            raise RuntimeError("follow() is for an engine whose mesh spans processes")
        if is_leader():
            raise RuntimeError("follow(): process 0 leads (submit, step, start); the others follow")
        return self._lockstep.follow()

    def warmup(self, prompt_widths: Sequence[int] = (16,),
               progress: Optional[Progress] = None) -> None:
        """Compiles, while idle, the device step of every load level in both sampling modes
        and the insert of each prompt-width bucket, so the first requests wait for none.
        progress(name, None) as each program starts and progress(name, seconds) when done
        (`warmup.compile_programs`)."""
        self._leader_only("warmup")
        with self._lock:
            if not self._sched.idle:
                raise RuntimeError("warmup() needs an idle engine")
            compile_programs(self._lockstep.lead, slots=self.slots, limit=self.limit,
                             eos=self._default_eos, levels=self.levels,
                             prompt_widths=prompt_widths, progress=progress,
                             row_sizes=self.row_sizes)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Runs the step loop on a background thread until stop()."""
        self._leader_only("start")
        if self._lockstep.closed:
            raise RuntimeError("a multi-process engine cannot start again after stop(): its "
                               "followers have returned (build a new Engine on every "
                               "process instead)")
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="ouroboros-engine",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        """step() with the host's work overlapped: step k+1 is dispatched, then step k's
        outputs are read and streamed while the device runs it."""
        inflight = None
        while True:
            with self._lock:
                idle = self._sched.idle and inflight is None
                if idle and self._stopping:
                    return
                if idle:
                    self._cv.wait(0.05)
            try:
                if idle:
                    self._lockstep.heartbeat()
                    continue
                launched = self._launch()
                if inflight is not None:
                    self._process(*inflight)
                inflight = launched
            except Exception as e:  # noqa: BLE001
                # a fault fails the requests in flight, not the thread
                inflight = None
                self._fail_all(e)

    def _fail_all(self, err: BaseException) -> None:
        """Fails the requests in flight with err; once the processes are out of step (a peer
        died) the waiting ones too, which no device call can serve any more."""
        with self._lock:
            for i in self._sched.busy:
                self._end(self._sched.running[i], "cancelled", error=err)
                self._sched.free(i)
            while self._lockstep.broken is not None and self._sched.waiting:
                self._end(self._sched.waiting.popleft(), "cancelled", error=err)

    def stop(self, cancel: bool = False, timeout: Optional[float] = None) -> None:
        """Stops the thread: finishes in-flight requests (or cancels them with cancel=True,
        finish_reason "cancelled"); waiting requests are cancelled. Also a context manager.
        On a multi-process engine it then sends the followers "stop" (their follow() returns),
        and the engine cannot start again."""
        self._leader_only("stop")
        with self._lock:
            self._stopping = True
            while self._sched.waiting:
                self._end(self._sched.waiting.popleft(), "cancelled")
            if cancel:
                for h in self._sched.running:
                    if h is not None:
                        h.cancel()
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
        self._lockstep.release()

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
        return self._lockstep.running

    @property
    def fault(self) -> Optional[BaseException]:
        """What stopped a multi-process engine for good (`liveness.ProcessLost` naming a dead
        process, or a device call's error), None while it runs or after a plain stop()."""
        return self._lockstep.broken

    @property
    def pool(self) -> Optional[PhrasePool]:
        """A copy of the shared phrase pool as it is now (save with oj.save_pool); None for
        methods without one. (A copy: every device step donates the engine's own. Over
        processes: gathered from every process, on process 0's default device.)"""
        self._leader_only("pool")
        return self._lockstep.lead(Op("pool"))

    def metrics(self) -> dict:
        """Cumulative counters (vLLM's spec-decode names), pool hit rate, load and the config
        in use per load level."""
        with self._lock:
            m = self._counters.snapshot()
            m["busy_slots"] = len(self._sched.busy)
            m["slots"] = self.slots
            m["queue_length"] = len(self._sched.waiting)
            m["method"] = self.method
            m["configs"] = {n: label for (n, _), label in zip(self.levels, self._labels)}
        return m
