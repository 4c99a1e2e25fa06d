"""`oj.generate`: validation, tokenization, shape bucketing and dispatch to a decoding method.

Everything here runs on the host once per call; the decoding itself is one jitted
`lax.while_loop` per call (see `decoding/`). Shapes that reach `jit` are bucketed and every
knob that may change between calls (`max_new_tokens`, `seed`, temperature, top-k, top-p, EOS
ids) is passed as an array, so calls within a bucket reuse the compiled loop. The buckets:

- prompt width P: the longest prompt rounded up to a power of two (at least 16);
- cache slots S: with `max_cache_len` given, from it alone (max(P, max_cache_len) + the method's
  margin, to a power of two), so `max_new_tokens` never changes the compiled loop; without it,
  P + max_new_tokens + margin to a power of two (the smallest cache, since attention reads
  every slot each step), so changing `max_new_tokens` recompiles only when it crosses a power
  of two;
- EOS ids: up to 8 share one shape (padded with -1).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .decoding import METHODS
from .decoding.common import Limits, Stats
from .models.config import normalize_eos
from .models.loading import Model
from .sampling import SamplingParams

MIN_PROMPT_BUCKET = 16
EOS_BUCKET = 8


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
    """

    tokens: list[list[int]]
    texts: Optional[list[str]]
    stats: dict[str, Any]
    pool: Any = None


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    b = minimum
    while b < n:
        b *= 2
    return b


def cache_slots(prompt_width: int, max_new_tokens: int, margin: int,
                max_cache_len: Optional[int] = None) -> int:
    """Cache slots of a call, rounded up to a power of two: the bucketed prompt width, the new
    tokens and the method's margin (tree nodes scored past the last kept token); or, when
    `max_cache_len` is given, max(prompt width, max_cache_len) + margin, independent of
    max_new_tokens."""
    if max_cache_len is not None:
        return bucket(max(prompt_width, max_cache_len) + margin, minimum=64)
    return bucket(prompt_width + max_new_tokens + margin, minimum=64)


def default_eos_ids(model: Model) -> Optional[int | tuple]:
    """EOS id(s) `generate` stops at by default, as transformers picks them: generation_config.json,
    else config.json, else the tokenizer's eos token. None when there is none."""
    for src in (model.generation_config.get("eos_token_id"), model.config.eos_token_id):
        if src is not None:
            return src
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        return int(model.tokenizer.eos_token_id)
    return None


def eos_array(eos, vocab_size: Optional[int] = None) -> np.ndarray:
    """int32[n_eos] of EOS ids padded with -1 (never a token) to a multiple of EOS_BUCKET."""
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if vocab_size is not None:
        ids = [i for i in ids if i < vocab_size]  # an id the model cannot emit never matches
    width = max(EOS_BUCKET, -(-len(ids) // EOS_BUCKET) * EOS_BUCKET)
    return np.array(ids + [-1] * (width - len(ids)), np.int32)


def _check_model(m, name: str) -> None:
    if not isinstance(m, Model):
        hint = (f"; load it first: oj.load_model({m!r})" if isinstance(m, (str, bytes))
                or hasattr(m, "__fspath__") else "")
        raise ValueError(f"{name} must be a model returned by oj.load_model, got "
                         f"{type(m).__name__}{hint}")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_))


def _explicit_eos(eos_token_id, vocab_size: int):
    """A caller's eos_token_id: an id, a list of ids, or -1 / [] for "no EOS"."""
    if _is_int(eos_token_id) and eos_token_id == -1:
        return None
    if isinstance(eos_token_id, (list, tuple, np.ndarray)):
        eos_token_id = list(eos_token_id)
        if not eos_token_id:
            return None
    ids = normalize_eos(eos_token_id, "eos_token_id")
    if any(i >= vocab_size for i in ([ids] if isinstance(ids, int) else ids)):
        raise ValueError(f"eos_token_id must hold token ids in [0, {vocab_size}) (or be -1 / [] "
                         f"for none), got {eos_token_id!r}")
    return ids


def _as_token_lists(target: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or of token-id lists, got "
                         f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    from .chat import apply_chat, is_conversation

    if all(isinstance(p, dict) for p in prompts):
        prompts = [prompts]  # one conversation: [{"role": ..., "content": ...}, ...]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            raise ValueError(f"prompts[{i}] is a chat message among other prompts; give a "
                             "conversation as a list of messages: prompts=[[{'role': 'user', "
                             "'content': ...}], ...]")
        if is_conversation(p):
            ids = apply_chat(target.tokenizer, p, f"prompts[{i}]")
        elif isinstance(p, str):
            if target.tokenizer is None:
                raise ValueError(f"prompts[{i}] is text but the target has no tokenizer; pass "
                                 "token-id lists instead")
            ids = list(target.tokenizer(p)["input_ids"])
        else:
            if isinstance(p, bytes) or not isinstance(p, (Sequence, np.ndarray)):
                raise ValueError(f"prompts[{i}] is neither a string nor a list of token ids, "
                                 f"got {type(p).__name__}")
            bad = next((t for t in p if not _is_int(t)), None)
            if bad is not None:
                raise ValueError(f"prompts[{i}] holds {bad!r} ({type(bad).__name__}); token ids "
                                 "must be integers")
            ids = [int(t) for t in p]
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] is empty (no tokens); every prompt needs at least one")
        bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary "
                             f"[0, {target.config.vocab_size})")
        out.append(ids)
    return out


def _validate_scalars(max_new_tokens, temperature, top_p, top_k, seed):
    if not _is_int(max_new_tokens) or not 0 < max_new_tokens < 2**31:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not _is_real(temperature) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (a number; 0 = greedy), got {temperature!r}")
    if not _is_real(top_p) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (a number), got {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not _is_int(seed) or not 0 <= seed < 2**32:
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
             top_k: int = 0, seed: int = 0, eos_token_id: Optional[int | Sequence[int]] = None,
             config: Any = "auto", mesh: Optional[jax.sharding.Mesh] = None, pool: Any = None,
             max_cache_len: Optional[int] = None) -> GenerationOutput:
    """Generates up to `max_new_tokens` new tokens for each prompt with the chosen method.

    prompts: list of strings (tokenized with the target's tokenizer), of token-id lists, or of
    chat conversations (lists of {"role", "content"} messages, rendered with the tokenizer's
    chat template and its generation prompt; one conversation may be given on its own).
    method: "vanilla", "speculative", "lookahead" or "ouroboros"; config: that method's config
    object, "auto" (default: chosen for this device, batch and pair by `decoding.auto`, which may
    turn speculation off for the call; `stats["auto"]` says what it chose and why) or None (the
    paper's recipe). temperature 0 is greedy. mesh: a
    `jax.sharding.Mesh` with axes named "data" and/or "model" to shard over. pool: a phrase
    pool returned by an earlier call (methods that keep one). eos_token_id: one id or a list
    (generation stops at any of them; -1 or [] for none; default: generation_config.json's,
    else config.json's, else the tokenizer's). max_cache_len: the longest prompt + generation
    allowed (default: the target's max_position_embeddings); giving it also fixes the cache
    size, so calls that differ only in max_new_tokens share one compiled loop (see the module
    docstring). Returns GenerationOutput(tokens, texts, stats, pool).
    """
    _check_model(target, "target")
    if draft is not None:
        _check_model(draft, "draft")
    if not isinstance(method, str) or method not in METHODS:
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
    if max_cache_len is not None and (not _is_int(max_cache_len) or max_cache_len < 2):
        raise ValueError(f"max_cache_len must be an integer >= 2 (prompt + new tokens), got "
                         f"{max_cache_len!r}")
    limit = target.config.max_position_embeddings if max_cache_len is None else max_cache_len
    longest = max(len(t) for t in token_lists)
    if longest + max_new_tokens > limit:
        raise ValueError(f"prompts: the longest prompt has {longest} tokens, which with "
                         f"max_new_tokens={max_new_tokens} exceeds the cache limit of {limit} "
                         "tokens (max_cache_len / the model's max_position_embeddings)")
    V = target.config.vocab_size
    if eos_token_id is None:
        eos = eos_array(default_eos_ids(target), V)
    else:
        eos = eos_array(_explicit_eos(eos_token_id, V))

    B = len(token_lists)
    P = bucket(longest)
    prompt = np.zeros((B, P), np.int32)
    for i, t in enumerate(token_lists):
        prompt[i, :len(t)] = t
    plens = np.array([len(t) for t in token_lists], np.int32)
    prompt_j, plens_j = jnp.asarray(prompt), jnp.asarray(plens)
    choice = None
    if auto and method != "vanilla":
        from .decoding.auto import auto_config

        choice = auto_config(method, target, draft, prompt_j, plens_j,
                             cache_slots(P, max_new_tokens, 0, max_cache_len))
        if choice.method == "vanilla":
            spec, cfg = METHODS["vanilla"], None
        else:
            cfg = choice.config
    slots = cache_slots(P, max_new_tokens, spec.margin(cfg), max_cache_len)
    limits, sp = row_knobs(B, max_new_tokens, eos, temperature, top_k, top_p, seed, V)
    greedy = temperature == 0.0

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
    if spec.learn is not None:
        spec.learn(target, draft, cfg, stats, greedy)  # what the next "auto" plans with
    return GenerationOutput(tokens=new, texts=texts, stats=stats, pool=pool_out)


def row_knobs(rows: int, max_new_tokens: int, eos: np.ndarray, temperature: float, top_k: int,
              top_p: float, seed: int, vocab_size: int) -> tuple[Limits, SamplingParams]:
    """One call's knobs as per-row arrays (every row the same): Limits (max_new_tokens int32[B],
    EOS ids int32[B, n_eos]) and SamplingParams whose row b draws from stream b of `seed`
    (fold_in(key(seed), b), the keys generate has always used)."""
    B = rows
    limits = Limits(max_new_tokens=jnp.full((B,), max_new_tokens, jnp.int32),
                    eos_token_id=jnp.asarray(np.broadcast_to(eos, (B, len(eos))), jnp.int32))
    # top_k >= V keeps every token, as transformers' min(top_k, V)
    sp = SamplingParams(
        temperature=jnp.full((B,), float(temperature) if temperature > 0 else 1.0, jnp.float32),
        top_k=jnp.full((B,), min(int(top_k), vocab_size), jnp.int32),
        top_p=jnp.full((B,), float(top_p), jnp.float32),
        seed=jnp.full((B,), int(seed), jnp.uint32), stream=jnp.arange(B, dtype=jnp.int32))
    return limits, sp


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
