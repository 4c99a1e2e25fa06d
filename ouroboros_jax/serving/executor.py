"""The engine's device side: its state over all slots, where that state lives on the mesh, and
the jitted calls that change it (a prompt into a slot, a step of k rounds on every slot).

Compiled programs: one device step per (load-level config, sampling mode, row bucket: the
step computes slots [0, b) only, `row_buckets`) and one insert per prompt-width bucket, all at
fixed shapes (slots, cache size); requests arriving and leaving
never recompile. An insert's host data (slot, prompt, knobs, stop ids) travels as one int32
array (`pack_insert`), one upload; a step's as one bool[B] (slots freed since the last step),
and its outputs come back as one int32 array (`StepOutput`), one download. A step computes
the emitted tokens' logprobs (with the `MAX_TOP_LOGPROBS` most likely tokens') only when a
busy request asks for them (`logprobs`, static: a second compiled step, built on first use).
A step returns device arrays at once (JAX dispatch is asynchronous): the caller reads them
when it needs them, so the host may work while the device runs.
On one device the state is held with its small leaves packed into one array
(`packed_state`): a call's host cost grows with its leaves, and a step's dispatch is paid
while the device computes.

Letters (package glossary): B slots, S cache slots, P prompt width, E tokens one step can give
a slot, k rounds per step.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..decoding import constrained, logprobs as lpm
from ..decoding.common import SOURCES, Limits, read_emitted, run_rounds, set_rows
from ..distributed import local
from ..models.kv_cache import KVCache
from ..pool import clear_keys
from ..request import EOS_BUCKET, MAX_TOP_LOGPROBS, ValidRequest, bucket
from ..sampling import SamplingParams
from ..sharding import LOGICAL_AXES, spec_for
from .packed_state import Packed, pack, packed, unpack, unpacked
from .row_buckets import pad_rows, put_head, take_head

OFF = "off"  # a load level without speculation
# the packed insert's header: slot, prompt length, top_k, seed, greedy, max_tokens,
# temperature and top_p (float32 bits), speculation on, constrained (the request's table was
# put in its slot's region just before, `pack_constraint`), then EOS_BUCKET stop ids; the
# prompt follows
INSERT_HEAD = 10 + EOS_BUCKET


@struct.dataclass
class DeviceState:
    """The engine's device state: the method's state over all slots, with each slot's knobs."""

    state: Any
    sp: SamplingParams
    limits: Limits


def blank_knobs(B: int) -> tuple[SamplingParams, Limits]:
    """Every slot's knobs before any request: greedy, one token, no stop ids, speculating."""
    return (SamplingParams(temperature=jnp.ones((B,), jnp.float32),
                           top_k=jnp.zeros((B,), jnp.int32), top_p=jnp.ones((B,), jnp.float32),
                           seed=jnp.zeros((B,), jnp.uint32), stream=jnp.zeros((B,), jnp.int32),
                           greedy_rows=jnp.ones((B,), bool)),
            Limits(max_new_tokens=jnp.ones((B,), jnp.int32),
                   eos_token_id=jnp.full((B, EOS_BUCKET), -1, jnp.int32),
                   speculate=jnp.ones((B,), bool)))


def engine_state(state, structured: bool = False):
    """A method's state over the slots (`MethodSpec.init`) as the engine keeps it: its
    sequences with logprob buffers of `MAX_TOP_LOGPROBS` top tokens, which steps fill when a
    request asks for logprobs, and (structured) automaton-state buffers."""
    seq = lpm.with_buffers(state.seq, MAX_TOP_LOGPROBS)
    if structured:
        seq = constrained.zero_buffers(seq, seq.lengths.shape[0])
    return state.replace(seq=seq)


def pack_insert(slot: int, req: ValidRequest) -> np.ndarray:
    """One insert's host data -> int32[INSERT_HEAD + P] (P the prompt's bucket): one upload."""
    p, ids = req.params, req.ids
    out = np.zeros((INSERT_HEAD + bucket(len(ids)),), np.int32)
    greedy = p.temperature == 0
    out[:6] = (slot, len(ids), p.top_k, np.uint32(p.seed).view(np.int32), greedy, p.max_tokens)
    out[6:8] = np.asarray([1.0 if greedy else p.temperature, p.top_p], np.float32).view(np.int32)
    out[8] = p.speculation
    out[9] = req.table is not None
    out[10:INSERT_HEAD] = np.asarray(req.eos[:EOS_BUCKET], np.int32)
    out[INSERT_HEAD:INSERT_HEAD + len(ids)] = ids
    return out


def unpack_insert(packed: jax.Array, vocab: int):
    """pack_insert's array (traced) -> (rows int32[1], prompt int32[1,P], prompt_lengths
    int32[1], SamplingParams [1], Limits [1])."""
    h = packed[:INSERT_HEAD]
    floats = jax.lax.bitcast_convert_type(h[6:8], jnp.float32)
    sp = SamplingParams(temperature=floats[:1], top_k=jnp.minimum(h[2:3], vocab),
                        top_p=floats[1:2],
                        seed=jax.lax.bitcast_convert_type(h[3:4], jnp.uint32),
                        stream=jnp.zeros((1,), jnp.int32), greedy_rows=h[4:5] != 0)
    limits = Limits(max_new_tokens=h[5:6], eos_token_id=h[10:INSERT_HEAD][None],
                    speculate=h[8:9] != 0)
    return h[0:1], packed[INSERT_HEAD:][None], h[1:2], sp, limits, h[9] != 0


def _placed(mesh, logical: tuple, x: jax.Array) -> jax.Array:
    """x constrained to the placement its logical axes (`sharding.RULES`) give on mesh."""
    spec = spec_for(logical + (None,) * (x.ndim - len(logical)), x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def replicated(pair, tree):
    """tree's arrays replicated over the pair's mesh (as they are without one): a step's small
    outputs and the gathered pool, which every process then reads from its own devices."""
    if pair.mesh is None:
        return tree
    return jax.tree_util.tree_map(lambda x: _placed(pair.mesh, (), x), tree)


def dev_placements(mesh, dev: DeviceState):
    """The placement of every leaf of dev (or of its abstract shapes) on mesh, a pytree of
    `NamedSharding` shaped like dev: KV caches as `sharding.cache_spec` lays them out, leaves
    with a slot axis [B, ...] split over "data", the rest replicated. What `pinned` pins, and
    what lowering a device call for a mesh gives its abstract state (`lowering.py`)."""
    B = dev.limits.max_new_tokens.shape[0]

    def at(logical: tuple, x):
        spec = spec_for(logical + (None,) * (len(x.shape) - len(logical)), x.shape, mesh)
        return jax.sharding.NamedSharding(mesh, spec)

    def one(x):
        if isinstance(x, KVCache):  # k, v (and pending k, v) [L, B, S or A, K, D]
            kv = lambda y: at(LOGICAL_AXES["cache"], y)
            pending = None if x.pending is None else x.pending.replace(
                k=kv(x.pending.k), v=kv(x.pending.v), at=at(("batch",), x.pending.at),
                count=at(("batch",), x.pending.count))
            return x.replace(k=kv(x.k), v=kv(x.v), lengths=at(("batch",), x.lengths),
                             pending=pending)
        return at(("batch",) if len(x.shape) and x.shape[0] == B else (), x)

    return jax.tree_util.tree_map(one, dev, is_leaf=lambda x: isinstance(x, KVCache))


def pinned(pair, dev: DeviceState) -> DeviceState:
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
    return replicated(pair, jax.tree_util.tree_map(jnp.copy, tree))


def _opened(dev):
    """A device call's state as it computes on it: a Packed one unpacked (traced)."""
    return unpack(dev) if isinstance(dev, Packed) else dev


def _closed(held, dev: DeviceState):
    """The state a device call returns, in the form it was given (`held`)."""
    return pack(dev, held.layout) if isinstance(held, Packed) else dev


@partial(jax.jit, static_argnames=("insert_fn", "cfg", "vocab", "shared"), donate_argnums=(1,))
def device_insert(pair, dev: DeviceState, packed, *, insert_fn, cfg, vocab: int,
                  shared: bool) -> DeviceState:
    """A request (`pack_insert`) prefilled into its slot; the other slots untouched. dev may
    be `packed_state.Packed` (then so is the state returned)."""
    held, dev = dev, _opened(dev)
    rows, prompt, prompt_lengths, sp, limits, constrained = unpack_insert(packed, vocab)
    state = dev.state
    if not shared:  # before the insert, which may fill the slot's range (context phrases)
        lo = rows[0] * vocab
        state = state.replace(pool=clear_keys(state.pool, lo, lo + vocab * rows.shape[0]))
    state = insert_fn(pair, cfg, state, rows, prompt, prompt_lengths)
    rc = dev.limits.constraint
    new_limits = set_rows(dev.limits.replace(constraint=None), rows, limits)
    if rc is not None:  # the slot's own automaton (its table just written) or automaton 0
        rc = rc.replace(automaton=rc.automaton.at[rows].set(
            jnp.where(constrained, rows + 1, 0).astype(jnp.int32)))
        new_limits = new_limits.replace(constraint=rc)
    return _closed(held, pinned(pair, DeviceState(state, set_rows(dev.sp, rows, sp),
                                                  new_limits)))


@partial(jax.jit, static_argnames=("round_fn", "cfg", "greedy", "rounds", "width", "logprobs",
                                   "rows", "constrained"), donate_argnums=(1,))
def device_step(pair, dev: DeviceState, stop, *, round_fn, cfg, greedy: bool, rounds: int,
                width: int, logprobs: bool = False, rows: Optional[int] = None,
                constrained: bool = False):
    """stop bool[B]: slots freed since the last step (their rows end here). -> (device state,
    the step's outputs as one int32 array, `StepOutput.pack`: one download). logprobs: the
    rounds compute the emitted tokens' logprobs, and the outputs carry them. rows: the rounds
    run on slots [0, rows) only (`row_buckets`; every slot past them must be free), None:
    on all B; the outputs cover all B either way. dev may be `packed_state.Packed` (then so
    is the state returned). constrained: a busy slot has a response_format, so the rounds
    apply the slots' automata (`decoding/constrained.py`); without, they run as if none
    were kept (a second compiled step, built on first use, like logprobs')."""
    held, dev = dev, _opened(dev)
    B = dev.limits.max_new_tokens.shape[0]
    st = dev.state
    st = st.replace(seq=st.seq.replace(done=st.seq.done | stop))
    since = st.seq.lengths
    by_source = st.stats.by_source
    full = dev.replace(state=st)
    part = full if rows is None or rows == B else take_head(full, B, rows)
    sp = part.sp.replace(logprobs=MAX_TOP_LOGPROBS if logprobs else -1)
    limits = part.limits if constrained else part.limits.replace(constraint=None)
    st, kept, live, prop = run_rounds(partial(round_fn, pair, cfg, greedy, sp, limits),
                                      rounds, part.state)
    if part is not full:
        st = put_head(full, part.replace(state=st), B).state
        kept, live, prop = (pad_rows(x, B) for x in (kept, live, prop))
    toks, counts = read_emitted(st.seq, since, width)
    zero = jnp.zeros((), jnp.int32)
    hits = jnp.stack([getattr(st.stats.own, n, zero) for n in OWN_COUNTERS])
    lp = lpm.read(st.seq, since, width) if logprobs else None
    out = StepOutput.pack(toks, counts, kept, live, prop, st.seq.done, hits,
                          st.stats.by_source - by_source, lp)
    return _closed(held, pinned(pair, full.replace(state=st))), replicated(pair, out)


class RowOutput(NamedTuple):
    """One busy slot's share of a step, as Python values."""

    tokens: list  # its new tokens
    kept: list  # tokens kept in each round it took part in
    proposed: list  # draft tokens offered in those rounds
    sources: dict  # accepted draft tokens by source name (the method's sources)
    done: bool  # the device ended its row (a stop id or max_tokens)


# the method's own cumulative counters a step reports (0 where it has none): the pool's hits,
# and Ouroboros' rounds by kind (free drafts: free / drafted) and draft forwards (of them
# catch-up ones), for the metrics' per-kind counters
OWN_COUNTERS = ("pool_hits", "free_rounds", "draft_rounds", "draft_forwards",
                "catch_up_forwards")


def _offsets(B: int, E: int, k: int) -> tuple:
    """Where `StepOutput.pack`'s int fields start: tokens, counts, kept, live, proposed, done,
    own counters (`OWN_COUNTERS`), sources, and where they end."""
    sizes = (B * E, B, k * B, k * B, k * B, B, len(OWN_COUNTERS), B * len(SOURCES))
    return tuple(itertools.accumulate(sizes, initial=0))


class StepOutput:
    """What one step gave each slot, on the host: per slot its new tokens (at most E), per
    round (k) and slot the tokens kept, whether the slot took part (live) and the draft
    tokens offered, whether the device ended the slot; the pool's hit counter (cumulative),
    and per slot the step's accepted draft tokens by source; with logprobs,
    `logprobs.TokenLogprobs` of the tokens (f32[B,E], int32[B,E,K], f32[B,E,K]), else None.

    The int fields are converted to one Python list (one `tolist`) and each busy row is
    sliced from it in Python (`rows`): at 16 busy slots, a numpy operation per field and row
    was most of the host's work per step."""

    def __init__(self, flat: np.ndarray, B: int, E: int, k: int, K: int = -1):
        """flat: `pack`'s array on the host; K: its top tokens per position (-1: none)."""
        self.B, self.E, self.k = B, E, k
        self.at = _offsets(B, E, k)
        flat = np.asarray(flat)
        self.ints = flat[:self.at[-1]].tolist()
        self.own = dict(zip(OWN_COUNTERS, self.ints[self.at[6]:self.at[7]]))
        self.hits = self.own["pool_hits"]
        self.logprobs = None
        if K >= 0:
            lp = flat[self.at[-1]:]
            n = B * E
            self.logprobs = lpm.TokenLogprobs(
                lp[:n].view(np.float32).reshape(B, E), lp[n:n + n * K].reshape(B, E, K),
                lp[n + n * K:].view(np.float32).reshape(B, E, K))

    @staticmethod
    def pack(toks, counts, kept, live, prop, done, hits, sources, lp=None) -> jax.Array:
        """(traced) -> int32[B*E + B + 3*k*B + B + n_own + B*n_sources (+ B*E*(1 + 2K))], in the
        order of the fields (logprobs as float32 bits)."""
        i32 = lambda x: jnp.ravel(x).astype(jnp.int32)  # noqa: E731
        parts = [i32(toks), i32(counts), i32(kept), i32(live), i32(prop), i32(done), i32(hits),
                 i32(sources)]
        if lp is not None:
            bits = lambda x: jnp.ravel(jax.lax.bitcast_convert_type(x, jnp.int32))  # noqa: E731
            parts += [bits(lp.logprobs), i32(lp.top_tokens), bits(lp.top_logprobs)]
        return jnp.concatenate(parts)

    def _field(self, i: int) -> np.ndarray:
        return np.asarray(self.ints[self.at[i]:self.at[i + 1]])

    @property
    def tokens(self) -> np.ndarray:
        """int32[B, E]: each slot's new tokens (the first `counts` of its row)."""
        return self._field(0).reshape(self.B, self.E)

    @property
    def counts(self) -> np.ndarray:
        """int32[B]: how many tokens each slot received."""
        return self._field(1)

    @property
    def done(self) -> np.ndarray:
        """bool[B]: the slots the device ended."""
        return self._field(5) != 0

    def rows(self, busy: list, names: tuple) -> list[RowOutput]:
        """The busy slots' outputs, in order; sources over `names` (the method's)."""
        v, B, E, (_, cnt, kept, live, prop, done, _, src, _) = self.ints, self.B, self.E, self.at
        n, cols = len(SOURCES), [(s, SOURCES.index(s)) for s in names]
        out = []
        for r in busy:
            rounds = [j * B + r for j in range(self.k) if v[live + j * B + r]]
            out.append(RowOutput(v[r * E:r * E + v[cnt + r]], [v[kept + j] for j in rounds],
                                 [v[prop + j] for j in rounds],
                                 {s: v[src + r * n + c] for s, c in cols}, v[done + r] != 0))
        return out

    def row_logprobs(self, row: int, n: int, top: Optional[int]) -> Optional[list]:
        """The first n tokens' logprobs of slot row for a request that asked for `top` top
        tokens (None: none asked) -> [(logprob, [(token id, logprob), ...top])] or None."""
        if top is None or self.logprobs is None:
            return None
        lp = self.logprobs
        return [(float(lp.logprobs[row, j]),
                 list(zip(lp.top_tokens[row, j, :top].tolist(),
                          lp.top_logprobs[row, j, :top].tolist()))) for j in range(n)]


@dataclasses.dataclass
class Executor:
    """The device state and the calls on it (one at a time: the caller serializes them).

    spec: the method's MethodSpec; base: the config the state was built with (inserts and
    speculation-off steps use it); levels: [(busy threshold, loop config or OFF)]; rounds (k)
    and width (E) of a step; shared: one pool for every slot (else a key range each)."""

    pair: Any
    spec: Any
    base: Any
    levels: list
    rounds: int
    width: int
    vocab: int
    shared: bool
    held: Any  # the DeviceState, packed on one device (`packed_state`)
    saved_pool: Optional[Any] = None

    def __post_init__(self):
        self.slots = self.held.limits.max_new_tokens.shape[0]
        if self.pair.mesh is None:  # on a mesh each leaf keeps its own placement
            self.held = packed(self.held)

    @property
    def dev(self) -> DeviceState:
        """The device state, unpacked (its large arrays as they are)."""
        return unpacked(self.held) if isinstance(self.held, Packed) else self.held

    @dev.setter
    def dev(self, dev: DeviceState) -> None:
        self.held = dev if self.pair.mesh is not None else packed(dev)

    def insert(self, data: np.ndarray) -> None:
        """A request's packed insert (`pack_insert`) into its slot."""
        self.held = device_insert(self.pair, self.held, jnp.asarray(data),
                                  insert_fn=self.spec.insert, cfg=self.base, vocab=self.vocab,
                                  shared=self.shared)

    def step(self, level: int, greedy: bool, stop_rows: np.ndarray,
             logprobs: bool = False, rows: Optional[int] = None,
             constrained: bool = False) -> jax.Array:
        """k rounds on every slot (on slots [0, rows) when rows is set: the rest must be free)
        under load level `level` -> the outputs packed on the device (`StepOutput.pack`, with
        logprobs when asked; not waited for: `read` them)."""
        cfg = self.levels[level][1]
        round_fn, cfg = (self.spec.plain_round, self.base) if cfg is OFF else (self.spec.round,
                                                                                cfg)
        # a numpy argument: jit uploads it with the call (jnp.asarray would be a dispatch of
        # its own)
        self.held, out = device_step(self.pair, self.held, np.asarray(stop_rows, bool),
                                     round_fn=round_fn, cfg=cfg, greedy=greedy,
                                     rounds=self.rounds, width=self.width,
                                     logprobs=bool(logprobs),
                                     rows=None if rows is None else int(rows),
                                     constrained=bool(constrained))
        return out

    def read(self, flat: np.ndarray, logprobs: bool = False) -> StepOutput:
        """A step's packed outputs, fetched to the host -> StepOutput (logprobs: the step
        computed them)."""
        return StepOutput(flat, self.slots, self.width, self.rounds,
                          MAX_TOP_LOGPROBS if logprobs else -1)

    @property
    def _pool(self):
        return getattr(self.dev.state, "pool", None)

    def pool_copy(self):
        """A copy of the pool (every step donates the engine's own); on a mesh replicated in
        one call, read from this process's devices and placed on its default device."""
        if self._pool is None:
            return None
        pool = _copy_replicated(self.pair, self._pool)
        return local(pool) if self.pair.mesh is not None else pool

    def save_pool(self) -> None:
        """Keeps a copy of the pool as it is (every process its own part)."""
        self.saved_pool = None if self._pool is None else _copy(self._pool)

    def restore_pool(self) -> None:
        """The pool back as save_pool kept it."""
        if self.saved_pool is not None:
            self.dev = self.dev.replace(state=self.dev.state.replace(pool=self.saved_pool))
        self.saved_pool = None
