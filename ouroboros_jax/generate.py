"""`oj.generate`: validation, tokenization, shape bucketing and dispatch to a decoding method.

Everything here runs on the host once per call; the decoding itself is one jitted
`lax.while_loop` per call (see `decoding/`). Shapes that reach `jit` are bucketed (prompt width
and cache slots to powers of two) and every knob that may change between calls
(`max_new_tokens`, `seed`, temperature, top-k, top-p, EOS) is passed as an array, so calls
within a bucket reuse the compiled loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .decoding import METHODS
from .decoding.common import Limits
from .models.loading import Model
from .sampling import SamplingParams

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per prompt (EOS included when produced)
    texts: Optional[list[str]]
    stats: dict[str, Any]
    pool: Any = None  # the phrase pool after the call, for methods that keep one


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    b = minimum
    while b < n:
        b *= 2
    return b


def cache_slots(prompt_width: int, max_new_tokens: int, margin: int) -> int:
    """Cache slots of a call: the bucketed prompt width, the new tokens and the method's margin
    (tree nodes scored past the last kept token), rounded up to a power of two."""
    return bucket(prompt_width + max_new_tokens + margin, minimum=64)


def _as_token_lists(target: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or of token-id lists, got "
                         f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if target.tokenizer is None:
                raise ValueError(f"prompts[{i}] is text but the target has no tokenizer; pass "
                                 "token-id lists instead")
            ids = list(target.tokenizer(p)["input_ids"])
        else:
            try:
                ids = [int(t) for t in p]
            except (TypeError, ValueError):
                raise ValueError(f"prompts[{i}] is neither a string nor a list of token ids")
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] is empty (no tokens); every prompt needs at least one")
        bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary "
                             f"[0, {target.config.vocab_size})")
        out.append(ids)
    return out


def _validate_scalars(max_new_tokens, temperature, top_p, top_k, seed):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def _check_draft(target: Model, draft: Optional[Model], method: str, needs_draft: bool):
    if needs_draft and draft is None:
        raise ValueError(f"method={method!r} needs a draft model: pass draft=")
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the "
                         f"target's ({target.config.vocab_size}): draft and target must share "
                         "a tokenizer")


def generate(target: Model, prompts, draft: Optional[Model] = None, method: str = "vanilla",
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, eos_token_id: Optional[int] = None,
             config: Any = "auto", mesh: Optional[jax.sharding.Mesh] = None, pool: Any = None,
             max_cache_len: Optional[int] = None) -> GenerationOutput:
    """Generates up to `max_new_tokens` new tokens for each prompt with the chosen method.

    prompts: list of strings (tokenized with the target's tokenizer) or of token-id lists.
    method: "vanilla", "speculative", "lookahead" or "ouroboros"; config: that method's config
    object, "auto" (default: chosen for this device, batch and pair by `decoding.auto`, which may
    turn speculation off for the call; `stats["auto"]` says what it chose and why) or None (the
    paper's recipe). temperature 0 is greedy. mesh: a
    `jax.sharding.Mesh` with axes named "data" and/or "model" to shard over. pool: a phrase
    pool returned by an earlier call (methods that keep one). max_cache_len: the longest
    prompt + generation allowed (default: the target's max_position_embeddings).
    Returns GenerationOutput(tokens, texts, stats, pool).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    spec = METHODS[method]
    _validate_scalars(max_new_tokens, temperature, top_p, top_k, seed)
    _check_draft(target, draft, method, spec.needs_draft)
    auto = isinstance(config, str) and config == "auto"
    if isinstance(config, str) and not auto:
        raise ValueError(f"config must be a {spec.config_type.__name__}, 'auto' or None, got {config!r}")
    cfg = spec.default_config() if config is None or auto else config
    if config is not None and not auto and not isinstance(cfg, spec.config_type):
        raise ValueError(f"config for method={method!r} must be a {spec.config_type.__name__}, "
                         f"got {type(cfg).__name__}")
    token_lists = _as_token_lists(target, prompts)
    limit = max_cache_len or target.config.max_position_embeddings
    longest = max(len(t) for t in token_lists)
    if longest + max_new_tokens > limit:
        raise ValueError(f"prompts: the longest prompt has {longest} tokens, which with "
                         f"max_new_tokens={max_new_tokens} exceeds the cache limit of {limit} "
                         "tokens (max_cache_len / the model's max_position_embeddings)")
    if eos_token_id is None:
        eos_token_id = target.config.eos_token_id
        if eos_token_id is None and target.tokenizer is not None:
            eos_token_id = target.tokenizer.eos_token_id
    eos = -1 if eos_token_id is None else int(eos_token_id)

    B = len(token_lists)
    P = bucket(longest)
    prompt = np.zeros((B, P), np.int32)
    for i, t in enumerate(token_lists):
        prompt[i, :len(t)] = t
    plens = np.array([len(t) for t in token_lists], np.int32)
    choice = None
    if auto and method != "vanilla":
        from .decoding.auto import auto_config

        choice = auto_config(method, target, draft, jnp.asarray(prompt), jnp.asarray(plens),
                             cache_slots(P, max_new_tokens, 0))
        if choice.method == "vanilla":
            spec, cfg = METHODS["vanilla"], None
        else:
            cfg = choice.config
    slots = cache_slots(P, max_new_tokens, spec.margin(cfg))
    limits = Limits(max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
                    eos_token_id=jnp.asarray(eos, jnp.int32))
    sp = SamplingParams.make(temperature if temperature > 0 else 1.0, top_k, top_p, seed)
    greedy = temperature == 0.0

    prompt_j, plens_j = jnp.asarray(prompt), jnp.asarray(plens)
    if mesh is not None:
        from .sharding import shard_batch, shard_model

        target = shard_model(target, mesh)
        draft = shard_model(draft, mesh) if draft is not None else None
        prompt_j, plens_j = shard_batch(prompt_j, mesh), shard_batch(plens_j, mesh)

    t0 = time.perf_counter()
    seq, stats, pool_out = spec.run(target, draft, prompt_j, plens_j, limits, sp, cfg,
                                    greedy=greedy, slots=slots, pool=pool)
    tokens_np = np.asarray(jax.device_get(seq.tokens))
    lengths = np.asarray(jax.device_get(seq.lengths))
    stats = jax.device_get(stats)
    seconds = time.perf_counter() - t0

    new = [tokens_np[i, plens[i]:lengths[i]].tolist() for i in range(B)]
    texts = None
    if target.tokenizer is not None:
        texts = [target.tokenizer.decode(t, skip_special_tokens=True) for t in new]
    stats = summarize_stats(stats, seconds)
    if choice is not None:
        stats["auto"] = choice.as_stats(method)
    return GenerationOutput(tokens=new, texts=texts, stats=stats, pool=pool_out)


def summarize_stats(raw: dict, seconds: float) -> dict:
    """Device counters -> the named measures of ALGORITHM.md section 4 (plain Python)."""
    s: dict[str, Any] = {}
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
