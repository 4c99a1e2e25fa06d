"""`oj.generate`: one batch of prompts through one decoding method, start to finish.

Everything here runs on the host once per call: the request is validated and shaped
(`request.py`: the buckets that decide when a call recompiles), the models placed on the mesh,
the method's config chosen (`config="auto"`), and the method's runner called; the decoding
itself is one jitted `lax.while_loop` per call (see `decoding/`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .auto import AutoTuner, default_tuner
from .auto.free_profile import learn_free_profile
from .auto.switch import Switcher
from .constrain.rows import constraint_stats, row_constraints
from .decoding import METHODS
from .decoding.common import Stats
from .distributed import (check_same, fetch, is_leader, local, mesh_id, model_id,
                          spans_processes)
from .heap import gc_paused
from .models.loading import Model
from .request import (as_token_lists, cache_slots, check_cache_len, check_call, check_draft,
                      check_logprobs, check_model, default_eos_ids, default_method, eos_array,
                      explicit_eos, pad_prompts, method_config, place_models, resolve_method,
                      row_knobs, validate_scalars)


@dataclasses.dataclass
class GenerationOutput:
    """What `generate` returns.

    Attributes:
        tokens: the new tokens per prompt (EOS included when produced).
        texts: their decoded text, None when the target has no tokenizer.
        stats: plain-Python measures (docs/algorithm.md section 4): the loop's `Stats` as
            `summarize_stats` names them, plus seconds, tokens_per_second and (config="auto")
            `auto`.
        pool: the phrase pool after the call, for methods that keep one.
        logprobs: per prompt, each new token's log-probability (logprobs=True; else None)
            under the distribution it was chosen from: the processed one (temperature,
            top-k, top-p) when sampling, the temperature-1 softmax when greedy.
        top_logprobs: per prompt, per new token, the top_logprobs most likely
            (token id, log-probability) pairs at its position, most likely first (None
            unless top_logprobs > 0).
    """

    tokens: list[list[int]]
    texts: Optional[list[str]]
    stats: dict[str, Any]
    pool: Any = None
    logprobs: Optional[list[list[float]]] = None
    top_logprobs: Optional[list[list[list[tuple[int, float]]]]] = None


def generate(target: Model, prompts, draft: Optional[Model] = None,
             method: Optional[str] = None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             eos_token_id: Optional[int | Sequence[int]] = None, config: Any = "auto",
             mesh: Optional[jax.sharding.Mesh] = None, pool: Any = None,
             max_cache_len: Optional[int] = None, logprobs: bool = False,
             top_logprobs: int = 0, tuner: Optional[AutoTuner] = None,
             response_format: Any = None) -> GenerationOutput:
    """Generates up to `max_new_tokens` new tokens for each prompt with the chosen method.

    prompts: list of strings (tokenized with the target's tokenizer), of token-id lists, or of
    chat conversations (lists of {"role", "content"} messages, rendered with the tokenizer's
    chat template and its generation prompt; one conversation may be given on its own).
    method: a name in `decoding.METHODS` ("vanilla", "speculative", "lookahead",
    "prompt_lookup", "ouroboros"); default: "ouroboros" with a draft, else "vanilla"
    (`request.default_method`). config: that method's config object, "auto" (default: chosen
    for this device, batch and pair by `ouroboros_jax.auto`, which may turn speculation off for
    the call; `stats["auto"]` says what it chose and why) or None (the paper's recipe).
    temperature 0 is greedy. mesh: a `jax.sharding.Mesh` with axes named "data" and/or
    "model" to shard over. pool: a phrase pool returned by an earlier call (methods that keep
    one). eos_token_id: one id or a list (generation stops at any of them; -1 or [] for none;
    default: generation_config.json's, else config.json's, else the tokenizer's).
    max_cache_len: the longest prompt + generation allowed (default: the target's
    max_position_embeddings); giving it also fixes the cache size, so calls that differ only
    in max_new_tokens share one compiled loop (see the module docstring). logprobs: also
    return each new token's log-probability, taken from the forward that accepted it (no
    extra forward; off, the loop is the one without them); top_logprobs: with it, the most
    likely tokens' at each position (0..20). tuner: the `auto.AutoTuner` that sizes "auto" and
    learns from the call (default: `auto.default_tuner()`). response_format: constrain the
    output, one format or a list per prompt (docs/structured.md). Returns `GenerationOutput`.
    """
    t_call = time.perf_counter()  # stats' seconds: the whole call, as the caller's clock sees it
    tuner = default_tuner() if tuner is None else tuner
    check_model(target, "target")
    if draft is not None:
        check_model(draft, "draft")
    method, multi = default_method(method, draft is not None), spans_processes(mesh)
    if multi:  # SPMD: a call that differs between processes would hang in its collectives
        check_same("generate", target=model_id(target), draft=model_id(draft),
                   prompts=prompts, method=method, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                   eos_token_id=eos_token_id, config=repr(config), mesh=mesh_id(mesh),
                   pool=None if pool is None else jax.tree_util.tree_leaves(fetch(pool)),
                   max_cache_len=max_cache_len, logprobs=(logprobs, top_logprobs),
                   response_format=repr(response_format))
    spec = resolve_method(method)
    validate_scalars(max_new_tokens, temperature, top_p, top_k, seed)
    n_top = check_logprobs(logprobs, top_logprobs)
    check_draft(target, draft, method, spec.needs_draft)
    auto, cfg = method_config(spec, method, config)
    token_lists = as_token_lists(target, prompts)
    check_cache_len(target, token_lists, max_new_tokens, max_cache_len)
    V, B = target.config.vocab_size, len(token_lists)
    eos, constraint, tables = _eos_and_constraints(target, eos_token_id, response_format, B)
    prompt, plens = pad_prompts(token_lists)
    P = prompt.shape[1]
    check_call(spec, None if auto else cfg, target, draft, B, P, max_new_tokens, max_cache_len, mesh)
    # placed before auto: its probe must time (and key) the models as this call runs them
    target, draft = place_models(target, draft, mesh, multi)
    prompt_j, plens_j = _placed_batch(prompt, plens, mesh)
    choice, auto_slots, switch = None, None, None
    greedy = temperature == 0.0
    knobs = (eos, temperature, top_k, top_p, seed, V, n_top)
    if auto and spec.round_model is not None:  # a method with knobs for auto to size
        choice, auto_slots, switch = _auto_setup(tuner, method, target, draft, prompt_j,
                                                 plens_j, max_new_tokens, max_cache_len, pool,
                                                 greedy, knobs, multi)
        # the method auto runs: the asked one sized, or plain decoding where nothing pays
        spec, cfg = METHODS[choice.method], choice.config
    slots = cache_slots(P, max_new_tokens, spec.margin(cfg), max_cache_len)
    limits, sp = row_knobs(B, max_new_tokens, *knobs, constraint=constraint)
    compiled, compiled_s = tuner.compiles.programs, tuner.compiles.seconds
    t0 = time.perf_counter()
    seq, stats, pool_out = _run_loop(spec, target, draft, prompt_j, plens_j, limits, sp, cfg,
                                     greedy, slots, pool, multi)
    seconds = time.perf_counter() - t0
    out = _read_rows(seq, plens, target.tokenizer)
    stats = summarize_stats(stats, seconds)
    stats.update(constraint_stats(seq, tables))
    tuner.learn_realised(spec, cfg, stats, greedy, target, draft)
    learn_free_profile(tuner.agreement, target, draft, seq, plens, stats, greedy)
    quiet = tuner.compiles.programs == compiled and is_leader() and not multi
    if choice is not None:
        stats["auto"] = _auto_stats(choice, method, tuner.compiles, compiled, compiled_s)
        tuner.after_auto(choice, switch, target, draft, stats, seconds, B, P, auto_slots, quiet,
                         compiled_s)
    elif quiet:
        tuner.learn_prices(method, cfg, target, draft, stats, seconds, B, P,
                           cache_slots(P, max_new_tokens, 0, max_cache_len))
    # everything the call did, auto's work and the host's included, so tokens_per_second is
    # what the caller's clock sees; decode_seconds is the loop's share (prefill to result)
    stats["decode_seconds"] = seconds
    stats["seconds"] = time.perf_counter() - t_call
    stats["tokens_per_second"] = (stats["new_tokens"] / stats["seconds"] if stats["seconds"] > 0
                                  else float("nan"))
    return dataclasses.replace(out, stats=stats, pool=pool_out)


def _run_loop(spec, target, draft, prompt, plens, limits, sp, cfg, greedy, slots, pool, multi):
    """The method's jitted loop over the call -> (Sequences, Stats, pool or None) on the host
    (gathered from every process when the mesh spans several: each gets the full result).
    The collector is paused: no full collection inside a first call's trace and compile
    (`heap.gc_paused`)."""
    with gc_paused():
        seq, stats, pool_out = spec.run(target, draft, prompt, plens, limits, sp, cfg,
                                        greedy=greedy, slots=slots, pool=pool)
        seq, stats = fetch((seq, stats))
    if multi and pool_out is not None:
        pool_out = local(pool_out)
    return seq, stats, pool_out


def _auto_stats(choice, asked: str, compiles, programs: int, seconds: float) -> dict:
    """stats["auto"]: the choice (`Choice.as_stats`), and the programs this call's loop built
    since `compiles` (the tuner's counter) read `programs` and `seconds` (its own, on a first
    call) with the backend's seconds on them: seconds the caller paid, said beside what auto
    measured (`measured_now`)."""
    out = choice.as_stats(asked)
    out["compiled"] = {"programs": compiles.programs - programs,
                       "seconds": round(compiles.seconds - seconds, 3)}
    return out


def _eos_and_constraints(target: Model, eos_token_id, response_format, rows: int):
    """(the call's EOS ids int32[n_eos] (-1 pads), the rows' `constrain.RowConstraints` or
    None, each row's table or None): the formats built (or read from their cache) before
    anything runs, so a bad one fails fast."""
    V = target.config.vocab_size
    if eos_token_id is None:
        eos = eos_array(default_eos_ids(target), V)
    else:
        eos = eos_array(explicit_eos(eos_token_id, V))
    constraint, tables = row_constraints(response_format, rows, target.tokenizer, V,
                                         [int(e) for e in eos if e >= 0])
    return eos, constraint, tables


def _read_rows(seq, plens: np.ndarray, tokenizer) -> GenerationOutput:
    """The loop's Sequences (on the host) -> GenerationOutput of each row's new tokens, their
    text and, when the loop computed them, logprobs (stats and pool filled in by the caller)."""
    lengths = np.asarray(seq.lengths)
    rows = [slice(int(p), int(n)) for p, n in zip(plens, lengths)]
    tokens = np.asarray(seq.tokens)
    new = [tokens[i, r].tolist() for i, r in enumerate(rows)]
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in new]
    out = GenerationOutput(tokens=new, texts=texts, stats={})
    if seq.logprobs is None:
        return out
    lp = np.asarray(seq.logprobs)
    out.logprobs = [lp[i, r].tolist() for i, r in enumerate(rows)]
    if seq.top_tokens.shape[2]:
        ids, tlp = np.asarray(seq.top_tokens), np.asarray(seq.top_logprobs)
        out.top_logprobs = [[list(zip(ids[i, j].tolist(), tlp[i, j].tolist()))
                             for j in range(r.start, r.stop)] for i, r in enumerate(rows)]
    return out


def _placed_batch(prompt: np.ndarray, plens: np.ndarray, mesh):
    """The padded prompts [B,P] and their lengths [B] on the device(s): split over the mesh's
    "data" axis from the host copy (every process holds the whole batch and places its own
    rows), or on the default device."""
    if mesh is None:
        return jnp.asarray(prompt), jnp.asarray(plens)
    from .sharding import shard_batch

    return shard_batch(prompt, mesh), shard_batch(plens, mesh)


def _auto_setup(tuner: AutoTuner, method, target, draft, prompt_j, plens_j,
                max_new_tokens: int, max_cache_len, pool, greedy: bool, knobs: tuple,
                multi: bool):
    """(the Choice this call runs, the cache slots auto sized for, the call's
    `auto.switch.Switcher` or None): the tuner's choice (`AutoTuner.call_choice`), or, where
    its loop has not run yet and another's has, that one while the new loop compiles in the
    background. Not for a call that passes a pool, nor over processes (auto's choice is
    broadcast once there)."""
    ask = functools.partial(tuner.call_choice, method, target, draft, prompt_j, plens_j,
                            max_new_tokens, max_cache_len, pool, greedy)
    choice, auto_slots = ask()
    if pool is not None or multi:
        return choice, auto_slots, None
    switch = _switcher(tuner, ask, target, draft, prompt_j, plens_j, max_new_tokens,
                       max_cache_len, greedy, knobs)
    return switch.runnable(choice), auto_slots, switch


def _switcher(tuner: AutoTuner, ask, target, draft, prompt_j, plens_j, max_new_tokens: int,
              max_cache_len, greedy: bool, knobs: tuple) -> Switcher:
    """This call's `auto.switch.Switcher` over the tuner's `Switch`: a choice's loop compiled
    by running it on this call's prompts with every row limited to one new token (the same
    shapes: the same program)."""
    B, P = prompt_j.shape

    def warm(choice) -> None:
        spec = METHODS[choice.method]
        slots = cache_slots(P, max_new_tokens, spec.margin(choice.config), max_cache_len)
        limits, sp = row_knobs(B, 1, *knobs)
        seq, _, _ = spec.run(target, draft, prompt_j, plens_j, limits, sp, choice.config,
                             greedy=greedy, slots=slots, pool=None)
        jax.block_until_ready(seq)

    sig = tuner.switch.signature(ask.args[0], target, draft, B, P, max_new_tokens,
                                 max_cache_len, greedy, knobs[-1])
    return Switcher(tuner.switch, sig, warm)


def summarize_stats(stats: Stats, seconds: float) -> dict:
    """A loop's counters (`decoding.common.Stats`, fetched to host) -> the named measures of
    docs/algorithm.md section 4, a plain-Python dict: what `GenerationOutput.stats` holds."""
    s: dict[str, Any] = {}
    raw = stats.to_dict()
    new_tokens = int(np.sum(raw["new_tokens"]))
    rounds = int(np.sum(raw["rounds"]))
    s["new_tokens"] = new_tokens
    s["new_tokens_per_row"] = [int(x) for x in np.asarray(raw["new_tokens"])]
    s["target_calls"] = int(raw["target_calls"])
    s["draft_calls"] = int(raw["draft_calls"])
    s["eta"] = new_tokens / max(rounds, 1)
    s["c"] = int(raw["draft_tokens"]) / max(int(raw["draft_calls"]), 1)
    s["acceptance_histogram"] = [int(x) for x in np.asarray(raw["acceptance_histogram"])]
    for k, v in raw.items():
        if k not in s and k not in ("rounds", "draft_tokens"):
            arr = np.asarray(v)
            s[k] = arr.item() if arr.ndim == 0 else arr.tolist()
    s["seconds"] = seconds
    s["tokens_per_second"] = new_tokens / seconds if seconds > 0 else float("nan")
    return s
