"""`MethodSpec`: how a decoding method describes itself to `generate`, the serving engine and
the registry.

Its own module so that method modules and the registry (`decoding/__init__.py`) both import it
without importing each other.

## The seam

A method is a handful of pure functions over a batch of B rows (`rows`), each row a sequence
with its own length (`common.Sequences`: prompt, then emitted tokens; the last one pending).
Every function is traced inside `jit`; `cfg` (the method's frozen config) and `greedy` are
static, everything else an array:

    init(pair, cfg, rows, slots, pool) -> state
        B empty rows of S = slots cache slots: every row done (`common.empty_sequences`),
        caches zero, the method's own buffers (a Jacobi window, ...) zero, `pool` held as is.
        `state` is a `flax.struct` dataclass with at least `.seq` (Sequences) and `.stats`
        (`common.Stats`, with the method's own counters in `.own`).
    insert(pair, cfg, state, rows int32[R], prompt int32[R,P], prompt_lengths int32[R]) -> state
        Rows `rows` restart with these prompts: sequences reset (`common.insert_sequences`),
        each cache prefilled with all but the pending last token (`common.prefill_rows`), any
        per-row buffer restarted from the prompt (`common.set_rows`). Other rows untouched.
    round(pair, cfg, greedy, sampling, limits, state) -> state
        One round on all rows: rows already done take part in the shapes and change nothing
        (`common.emit` gives them no tokens). It emits through `common.emit`, which applies
        each row's `Limits` (max_new_tokens, EOS ids), and counts through
        `common.count_round(stats, live, kept, proposed)`.
    plain_round(pair, cfg, greedy, sampling, limits, state) -> state  (optional)
        A round without speculation (one target token per row, `common.plain_step`) that
        leaves the state valid for `round` afterwards (a draft's cache follows with
        `common.follow_draft`): the engine's "speculation off" load level.
    finish(state) -> Stats
        The stats with the summaries taken after a loop (`Stats.summary`).
    prepare(cfg, pool, vocab) -> (loop cfg, pool)  (host side, optional)
        The config the compiled functions see and the pool a call starts from.

Reading: the tokens emitted since a point are `common.read_emitted(state.seq, since, E)`;
every method shares it (no per-method reading). `max_emit(cfg)` bounds what one round gives
a row, so k rounds give at most k * max_emit(cfg).

Drivers: `common.make_runner(init, insert, round, finish)` is generate's loop (init, insert
every row, one while_loop of rounds, finish), jitted once per method module (`run_vanilla`,
...); `common.run_rounds(round, k, state)` is the engine's device step. A new method writes
the five functions and its `make_runner` (the MethodSpec's `runner`; `MethodSpec.run` is the
same for every method) and registers a MethodSpec in `decoding/__init__.py`.

Sampling: `sampling.SamplingParams` holds one value or one per row; keys fold (seed, stream,
position) (`sampling.token_keys`), so a row's draws depend on nothing but its own seed,
stream and positions. In a sampling loop (greedy=False) rows flagged `greedy_rows` take the
argmax path (`sampling.greedy_where`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax

from ..pool import pool_bytes
from . import cost
from .common import SOURCES, make_pair


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Attributes:
        runner: generate's loop over the seam functions below, jitted once per method
            (`common.make_runner`): (pair, prompt[B,P], prompt_lengths[B], limits, sampling,
            pool, *, cfg, slots, greedy) -> (Sequences, `common.Stats`, pool or None). `run`
            calls it.
        needs_draft: whether the method needs a draft model.
        config_type: the method's config dataclass.
        default_config: () -> the paper's recipe (`config=None`).
        margin: config -> cache slots one round may touch past prompt + max_new_tokens.
        init, insert, round, finish: the seam (module docstring).
        plain_round: the seam's round without speculation (None: the method has no other).
        prepare: (config, pool, vocab) -> (loop config, pool) on the host (None: (config, None)).
        keeps_pool: whether the method's state holds a phrase pool (`state.pool`, a
            `pool.PhrasePool`, and `state.key_offset`, int32[B] or None), which `run` returns
            and the engine keeps across requests.
        max_emit: config -> the most tokens one round gives a row.
        family: config -> hashable; configs of one family share a state layout, so the engine
            may switch between them from one step to the next (None: each config its own).
        learn: (config, stats dict, greedy) -> (agreement, rounds, depth counts) or None,
            called after each `generate` call with a draft: the agreement the call realised
            and its acceptance by depth (`cost.depth_counts`), which `config="auto"` stores
            for the pair and plans the next call with (None: the method teaches auto
            nothing).
        forward_sizes: config -> (tokens per target forward, per draft forward, per first
            draft forward of a round), fixed shapes as compiled (masked slots cost as much
            as real ones); what the cost model prices. None: unknown.
        quick_config: () -> a small config for tiny models (`bench --quick`, tests).
        round_model: (config, agreement or None) -> `cost.RoundModel` (expected tokens,
            draft forwards and overhead per round): with `forward_sizes`, what the cost model
            (decoding/cost.py) prices. None: the method has no `config="auto"`.
        sources: the names (`common.SOURCES`) of where its accepted draft tokens come from,
            each counted per row in `Stats.by_source` (() for vanilla: none).
        free_model: (config, RoundModel, `cost.FreeProfile` or None) -> RoundModel: the round
            model with rounds that need no draft forward mixed in (Ouroboros' free drafts),
            priced from the pair's measured profile (the agreement's `free`); None: none.

    The knobs `config="auto"` searches, and everything else that enumerates configs, come from
    the config class's `KNOBS` (decoding/knobs.py).
    """

    runner: Callable
    needs_draft: bool
    config_type: Any
    default_config: Callable[[], Any]
    margin: Callable[[Any], int]
    init: Optional[Callable] = None
    insert: Optional[Callable] = None
    round: Optional[Callable] = None
    finish: Optional[Callable] = None
    plain_round: Optional[Callable] = None
    prepare: Optional[Callable] = None
    keeps_pool: bool = False
    max_emit: Callable[[Any], int] = lambda cfg: 1
    family: Optional[Callable[[Any], Any]] = None
    learn: Optional[Callable[..., None]] = None
    forward_sizes: Optional[Callable[[Any], tuple]] = None
    quick_config: Optional[Callable[[], Any]] = None
    round_model: Optional[Callable[..., Any]] = None
    sources: tuple = ()
    free_model: Optional[Callable[..., Any]] = None

    def run(self, target, draft, prompt, prompt_lengths, limits, sampling, cfg, *, greedy: bool,
            slots: int, pool):
        """The whole generation, one jitted while_loop (`runner`): the pool prepared for the
        config (`prepare`) when the method keeps one, else passed through. -> (Sequences,
        `common.Stats`, pool); the stats' summary holds `accepted_from_<source>` for each of
        the method's `sources` (accepted draft tokens from there, all rows)."""
        pair = make_pair(target, draft if self.needs_draft else None)
        if not self.keeps_pool:
            seq, stats, _ = self.runner(pair, prompt, prompt_lengths, limits, sampling, None,
                                        cfg=cfg, slots=slots, greedy=greedy)
            return seq, self._summarized(stats), pool
        cfg, pool = self.prepare(cfg, pool, target.config.vocab_size)
        seq, stats, pool = self.runner(pair, prompt, prompt_lengths, limits, sampling, pool,
                                       cfg=cfg, slots=slots, greedy=greedy)
        return seq, self._summarized(stats, pool_bytes=pool_bytes(pool)), pool

    def _summarized(self, stats, **extra):
        """stats with the accepted draft tokens by source, and extra, in its summary."""
        sums = _source_sums(stats.by_source, tuple(SOURCES.index(n) for n in self.sources))
        by = {f"accepted_from_{n}": s for n, s in zip(self.sources, sums)}
        return stats.replace(summary={**(stats.summary or {}), **by, **extra})

    @property
    def knobs(self):
        """The config class's `knobs.KnobSpace`, or None (vanilla has no knobs)."""
        return getattr(self.config_type, "KNOBS", None)

    def auto_grid(self, values: Optional[dict] = None) -> list:
        """The configs `config="auto"` chooses among: the knob space's grid over `values`
        ({knob: values}, default each knob's auto values), with its switch variants. The
        default grid is built once per config type (Ouroboros' 736 configs took 6 ms, which
        auto paid on every call)."""
        if values is None:
            return list(_default_grid(self.config_type))
        return self.knobs.auto_grid(self.config_type, values)

    def rate(self, cfg, agreement, tt: dict, td: Optional[dict]) -> float:
        """Predicted tokens/s of one config from latency tables (decoding/cost.py); agreement
        one number or a `cost.DepthAgreement` (priced at the config's chain length)."""
        return cost.rate(self.forward_sizes(cfg), self.priced_round(cfg, agreement), tt, td)

    def priced_round(self, cfg, agreement):
        """The `cost.RoundModel` of cfg at the agreement (`round_model` at its chain length,
        with free rounds mixed in by `free_model` from the agreement's measured free profile,
        `cost.DepthAgreement.free`)."""
        model = self.round_model(cfg, chain_agreement(agreement, cfg))
        if self.free_model is None:
            return model
        return self.free_model(cfg, model, getattr(agreement, "free", None))


def chain_agreement(agreement, cfg):
    """The one agreement cfg's round model takes: agreement by depth priced at cfg's chain
    length (its gamma; 1 for a config without a draft chain)."""
    return cost.agreement_for(agreement, getattr(cfg, "gamma", 1))


class NoConfig:
    """Vanilla decoding has no configuration."""


@functools.lru_cache(maxsize=None)
def _default_grid(config_type) -> tuple:
    """`MethodSpec.auto_grid()` at the knobs' own values (configs are frozen: shared safely)."""
    return tuple(config_type.KNOBS.auto_grid(config_type))


@functools.partial(jax.jit, static_argnums=1)
def _source_sums(by_source, columns: tuple) -> tuple:
    """by_source int32[B, n_sources] -> each of `columns`' sum over the rows, as one program: run
    eagerly, each column's slice and sum compiled a small program of its own in a process's
    first call."""
    return tuple(by_source[:, c].sum() for c in columns)
