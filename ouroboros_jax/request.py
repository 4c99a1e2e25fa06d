"""A generation request as the engine sees it: validation of what a caller passes, and the
shapes a call compiles for. Shared by `generate`, the serving engine and the bench.

Shapes that reach `jit` are bucketed, and every knob that may change between calls
(`max_new_tokens`, seed, temperature, top-k, top-p, EOS ids) is an array, so calls within a
bucket reuse the compiled loop:

- prompt width P: the longest prompt rounded up to a power of two (at least 16);
- cache slots S: with `max_cache_len` given, from it alone (max(P, max_cache_len) + the method's
  margin, to a power of two), so `max_new_tokens` never changes the compiled loop; without it,
  P + max_new_tokens + margin to a power of two (the smallest cache), so changing
  `max_new_tokens` recompiles only when it crosses a power of two;
- EOS ids: up to 8 share one shape (padded with -1).
"""

from __future__ import annotations

import os
import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .bounds import (MEMORY_SHARE, PAST_POSITIONS_ENV, available_bytes, estimate_bytes,
                     forward_sizes, gib)
from .chat import apply_chat, is_conversation
from .decoding.common import Limits
from .decoding.knobs import recipe_of
from .models.config import normalize_eos
from .models.loading import Model
from .pool import DEFAULT_MAX_ROWS
from .sampling import SamplingParams

MIN_PROMPT_BUCKET = 16
EOS_BUCKET = 8


class FieldError(ValueError):
    """A ValueError naming the request field at fault in `field` (the server answers it with a
    400 whose `param` is that field; the message names it too)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    b = minimum
    while b < n:
        b *= 2
    return b


# From this width on, prompts are padded to 1.5x steps between powers of two as well (128, 192,
# 256, 384, ...): a prefill scores every padded row, and a ~180-token prompt padded to 256 cost
# the real 1.5B target 1.82 s where 192 rows cost 1.42 (prefill alone, this CPU). Below it
# the rows saved are few and each width is a loop compiled once more.
HALF_STEPS_FROM = 128


def prompt_bucket(n: int) -> int:
    """The width a prompt of n tokens is padded to: `bucket`'s power of two, or from
    HALF_STEPS_FROM on the 1.5x step below it where n fits (192 for 129-192 tokens)."""
    b = bucket(n)
    if b > HALF_STEPS_FROM and n <= b * 3 // 4:
        return b * 3 // 4
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


def check_model(m, name: str) -> None:
    if not isinstance(m, Model):
        hint = (f"; load it first: oj.load_model({m!r})" if isinstance(m, (str, bytes))
                or hasattr(m, "__fspath__") else "")
        raise ValueError(f"{name} must be a model returned by oj.load_model, got "
                         f"{type(m).__name__}{hint}")


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_))


def explicit_eos(eos_token_id, vocab_size: int):
    """A caller's eos_token_id: an id, a list of ids, or -1 / [] for "no EOS"."""
    if is_int(eos_token_id) and eos_token_id == -1:
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


def as_token_lists(target: Model, prompts) -> list[list[int]]:
    """A batch of prompts -> token-id lists: strings, token-id lists or chat conversations
    (lists of {"role", "content"} messages; one conversation may be given on its own)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or of token-id lists, got "
                         f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(isinstance(p, dict) for p in prompts):
        prompts = [prompts]  # one conversation: [{"role": ..., "content": ...}, ...]
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            raise ValueError(f"prompts[{i}] is a chat message among other prompts; give a "
                             "conversation as a list of messages: prompts=[[{'role': 'user', "
                             "'content': ...}], ...]")
    return [prompt_ids(target, p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def prompt_ids(target: Model, p, name: str = "prompt") -> list[int]:
    """One prompt (a string, token ids, or a chat conversation rendered with the tokenizer's
    template and generation prompt) -> its token ids inside the vocabulary; ValueError naming
    `name` otherwise (a FieldError whose field is `name` without its index)."""
    field = name.split("[")[0]
    if is_conversation(p):
        try:
            ids = apply_chat(target.tokenizer, p, name)
        except ValueError as e:
            raise FieldError(field, str(e)) from None
    elif isinstance(p, str):
        if target.tokenizer is None:
            raise FieldError(field, f"{name} is text but the target has no tokenizer; pass "
                             "token-id lists instead")
        try:  # a lone surrogate ("\ud800") has no UTF-8 form: tokenizers raise TypeError
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            raise FieldError(field, f"{name} is not valid Unicode text: {e}") from None
        ids = list(target.tokenizer(p)["input_ids"])
    else:
        if isinstance(p, bytes) or not isinstance(p, (Sequence, np.ndarray)):
            raise FieldError(field, f"{name} is neither a string nor a list of token ids, "
                             f"got {type(p).__name__}")
        bad = next((t for t in p if not is_int(t)), None)
        if bad is not None:
            raise FieldError(field, f"{name} holds {bad!r} ({type(bad).__name__}); token ids "
                             "must be integers")
        ids = [int(t) for t in p]
    if len(ids) == 0:
        raise FieldError(field, f"{name} is empty (no tokens); every prompt needs at least one")
    bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
    if bad:
        raise FieldError(field, f"{name} holds token id {bad[0]} outside the vocabulary "
                         f"[0, {target.config.vocab_size})")
    return ids


def check_sampling(max_tokens, temperature, top_p, top_k, seed,
                   max_name: str = "max_tokens") -> None:
    """A request's sampling values, checked once for `generate`, the engine and the server;
    FieldError naming the field (`max_name`: what the caller calls the token budget)."""
    if not is_int(max_tokens) or not 0 < max_tokens < 2**31:
        raise FieldError(max_name, f"{max_name} must be a positive integer, got {max_tokens!r}")
    if not is_real(temperature) or not np.isfinite(temperature) or temperature < 0:
        raise FieldError("temperature", f"temperature must be >= 0 (a number; 0 = greedy), got "
                         f"{temperature!r}")
    if not is_real(top_p) or not (0.0 < top_p <= 1.0):
        raise FieldError("top_p", f"top_p must be in (0, 1] (a number), got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise FieldError("top_k", f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise FieldError("seed", f"seed must be an integer in [0, 2**32), got {seed!r}")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the serving engine's step computes this many


def check_logprobs(logprobs, top_logprobs, name: str = "top_logprobs") -> int:
    """`generate`'s logprobs (a bool) and top_logprobs (an integer in [0, 20], only with
    logprobs) -> `SamplingParams.logprobs` (-1: none; else the top tokens kept); ValueError
    naming the argument."""
    if not isinstance(logprobs, bool):
        raise ValueError(f"logprobs must be a bool, got {logprobs!r}")
    if not is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                         f"got {top_logprobs!r}")
    if top_logprobs and not logprobs:
        raise ValueError(f"{name}={top_logprobs} needs logprobs=True")
    return int(top_logprobs) if logprobs else -1


def validate_scalars(max_new_tokens, temperature, top_p, top_k, seed):
    """`generate`'s sampling arguments (`check_sampling`, its budget named max_new_tokens)."""
    check_sampling(max_new_tokens, temperature, top_p, top_k, seed, max_name="max_new_tokens")


def check_stops(stop_token_ids, stop, vocab_size: Optional[int] = None) -> None:
    """A request's stop ids (a tuple of at most EOS_BUCKET ids in the vocabulary, or None for
    the model's own) and stop strings (a tuple of non-empty strings); FieldError naming it."""
    ids = stop_token_ids
    if ids is not None:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)) \
                or not all(is_int(i) and i >= 0 for i in ids):
            raise FieldError("stop_token_ids", f"stop_token_ids must be a tuple of token ids "
                             f">= 0 (or None), got {ids!r}")
        if len(ids) > EOS_BUCKET:
            raise FieldError("stop_token_ids", f"stop_token_ids holds {len(ids)} ids; at most "
                             f"{EOS_BUCKET}")
        bad = [i for i in ids if vocab_size is not None and i >= vocab_size]
        if bad:
            raise FieldError("stop_token_ids", f"stop_token_ids: id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab_size})")
    if isinstance(stop, (str, bytes)) or not isinstance(stop, (tuple, list)) \
            or not all(isinstance(s, str) and s for s in stop):
        raise FieldError("stop", f"stop must be a tuple of non-empty strings, got {stop!r}")


def check_fits(prompt_tokens: int, max_tokens: int, limit: int,
               max_name: str = "max_tokens") -> None:
    """One request's prompt and budget against the cache limit: FieldError naming the prompt
    when it alone leaves no room, else the budget when the two together pass the limit."""
    if prompt_tokens >= limit:
        raise FieldError("prompt", f"prompt: {prompt_tokens} tokens, which leaves no room in "
                         f"the cache of {limit} tokens (prompt + {max_name})")
    if prompt_tokens + max_tokens > limit:
        raise FieldError(max_name, f"{max_name}={max_tokens} with a prompt of {prompt_tokens} "
                         f"tokens exceeds the cache limit of {limit} tokens; at most "
                         f"{limit - prompt_tokens}")


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One serving request's knobs, checked on construction (`check_sampling`, `check_stops`):
    FieldError naming the field.

    Attributes:
        max_tokens: the most tokens generated.
        temperature: 0 = greedy.
        top_p, top_k: nucleus and top-k filtering (1.0 and 0 = off).
        seed: the request's random stream (sampled tokens depend on it alone).
        stop_token_ids: ids that end the request (None: the model's default EOS ids, as
            generate picks them; () for none); at most 8.
        stop: stop strings, matched on the decoded text; the output is cut before the match.
        logprobs: None (none), or each token's log-probability with this many (0..20) most
            likely tokens' (`decoding/logprobs.py`).
        speculation: False runs the request as plain decoding (its slot proposes no draft
            tokens; the output is what speculation gives, greedy identical).
        response_format: None / {"type": "text"} (no constraint) or a structured-output
            format (`constrain.formats`): checked and compiled by the engine's `validate`.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: Optional[tuple] = None
    stop: tuple = ()
    logprobs: Optional[int] = None
    speculation: bool = True
    response_format: Any = dataclasses.field(default=None, hash=False)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        check_sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed)
        check_stops(self.stop_token_ids, self.stop)
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise FieldError("logprobs", f"logprobs must be None or an integer in "
                             f"[0, {MAX_TOP_LOGPROBS}] (top tokens), got {self.logprobs!r}")
        if not isinstance(self.speculation, bool):
            raise FieldError("speculation", f"speculation must be a bool, got "
                             f"{self.speculation!r}")


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    """A serving request validated and tokenized once (`validate_request`): what the engine
    queues and the server sizes its answer by.

    Attributes:
        ids: the prompt's token ids (a chat conversation rendered once).
        params: its knobs.
        eos: int32[EOS_BUCKET] the ids that end it (-1 pads).
        table: its response_format's `constrain.TokenTable` (None: unconstrained).
    """

    ids: list
    params: RequestParams
    eos: np.ndarray
    table: Any = None

    @functools.cached_property
    def stop_ids(self) -> frozenset:
        return frozenset(int(i) for i in self.eos if i >= 0)


def validate_request(ids: list, params: RequestParams, *, limit: int, vocab_size: int,
                     default_eos: np.ndarray) -> ValidRequest:
    """Tokenized prompt ids (`prompt_ids`) and knobs -> a ValidRequest: the prompt and
    max_tokens fit the cache limit, the stop ids the vocabulary; FieldError naming the field."""
    if not isinstance(params, RequestParams):
        raise FieldError("params", f"params must be a RequestParams, got "
                         f"{type(params).__name__}")
    check_fits(len(ids), params.max_tokens, limit)
    check_stops(params.stop_token_ids, params.stop, vocab_size)
    eos = default_eos if params.stop_token_ids is None else eos_array(list(params.stop_token_ids))
    return ValidRequest(list(ids), params, eos)


def default_method(method: Optional[str], has_draft: bool) -> str:
    """`method`, or where it is None, what a call runs with a draft (`decoding.DRAFTED`) or
    without one (`decoding.PLAIN`)."""
    from .decoding import DRAFTED, PLAIN

    if method is not None:
        return method
    return DRAFTED if has_draft else PLAIN


def resolve_method(method):
    """A method name -> its MethodSpec (`decoding.METHODS`); ValueError naming method."""
    from .decoding import METHODS

    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method]


def method_config(spec, method: str, config) -> tuple[bool, object]:
    """A call's config argument -> (whether "auto" chooses it later, the config: the given
    one, or the paper's recipe for None and "auto"); ValueError naming config."""
    auto = isinstance(config, str) and config == "auto"
    if isinstance(config, str) and not auto:
        raise ValueError(f"config must be a {spec.config_type.__name__}, 'auto' or None, got "
                         f"{config!r}")
    if config is None or auto:
        return auto, spec.default_config()
    if not isinstance(config, spec.config_type):
        raise ValueError(f"config for method={method!r} must be a "
                         f"{spec.config_type.__name__}, got {type(config).__name__}")
    return auto, config


def place_models(target: Model, draft: Optional[Model], mesh, multi: bool):
    """The models placed on mesh (`shard_model`; models `load_sharded` onto it stay as they
    are; no mesh: as they lie). Over processes the 'model' axis must divide the query heads
    (`check_heads`), else every host would hold whole attention weights."""
    if mesh is None:
        return target, draft
    from .sharding import check_heads, shard_model
    from .xla_cpu import check_mesh_flags

    check_mesh_flags(mesh)

    if multi:
        check_heads(target, mesh, "target")
        if draft is not None:
            check_heads(draft, mesh, "draft")
    return shard_model(target, mesh), None if draft is None else shard_model(draft, mesh)


def check_draft(target: Model, draft: Optional[Model], method: str, needs_draft: bool):
    if needs_draft and draft is None:
        raise ValueError(f"method={method!r} needs a draft model: pass draft=")
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the "
                         f"target's ({target.config.vocab_size}): draft and target must share "
                         "a tokenizer")


def check_cache_len(target: Model, token_lists: list, max_new_tokens: int,
                    max_cache_len: Optional[int]) -> int:
    """Refuses a max_cache_len that is not an integer >= 2, and prompts that with
    max_new_tokens would pass the cache limit (max_cache_len, else the target's
    max_position_embeddings). Returns the longest prompt's length."""
    if max_cache_len is not None and (not is_int(max_cache_len) or max_cache_len < 2):
        raise ValueError(f"max_cache_len must be an integer >= 2 (prompt + new tokens), got "
                         f"{max_cache_len!r}")
    limit = target.config.max_position_embeddings if max_cache_len is None else max_cache_len
    longest = max(len(t) for t in token_lists)
    if longest + max_new_tokens > limit:
        raise ValueError(f"prompts: the longest prompt has {longest} tokens, which with "
                         f"max_new_tokens={max_new_tokens} exceeds the cache limit of {limit} "
                         "tokens (max_cache_len / the model's max_position_embeddings)")
    return longest


def pad_prompts(token_lists: list) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (prompt int32[B, P] right-padded with 0, lengths int32[B]), P the
    longest prompt's bucket (`prompt_bucket`)."""
    P = prompt_bucket(max(len(t) for t in token_lists))
    prompt = np.zeros((len(token_lists), P), np.int32)
    for i, t in enumerate(token_lists):
        prompt[i, :len(t)] = t
    return prompt, np.array([len(t) for t in token_lists], np.int32)


def row_knobs(rows: int, max_new_tokens: int, eos: np.ndarray, temperature: float, top_k: int,
              top_p: float, seed: int, vocab_size: int, logprobs: int = -1,
              constraint=None) -> tuple[Limits, SamplingParams]:
    """One call's knobs as per-row arrays (every row the same): Limits (max_new_tokens int32[B],
    EOS ids int32[B, n_eos]) and SamplingParams whose row b draws from stream b of `seed`
    (fold_in(key(seed), b), the keys generate has always used), computing `logprobs`
    (`SamplingParams.logprobs`), with the rows' `constrain.RowConstraints` (None: none)."""
    B = rows
    limits = Limits(max_new_tokens=jnp.full((B,), max_new_tokens, jnp.int32),
                    eos_token_id=jnp.asarray(np.broadcast_to(eos, (B, len(eos))), jnp.int32),
                    constraint=constraint)
    # top_k >= V keeps every token, as transformers' min(top_k, V)
    sp = SamplingParams(
        temperature=jnp.full((B,), float(temperature) if temperature > 0 else 1.0, jnp.float32),
        top_k=jnp.full((B,), min(int(top_k), vocab_size), jnp.int32),
        top_p=jnp.full((B,), float(top_p), jnp.float32),
        seed=jnp.full((B,), int(seed), jnp.uint32), stream=jnp.arange(B, dtype=jnp.int32),
        logprobs=logprobs)
    return limits, sp


def check_call(spec, cfg, target, draft, batch: int, prompt_width: int, max_new_tokens: int,
               max_cache_len: Optional[int], mesh=None, batch_name: str = "batch") -> None:
    """Refuses, by the parameter's name, a call whose sizes its models or device cannot hold;
    `generate` calls it after validating its arguments and before allocating anything.

    cfg None stands for vanilla's sizes (config="auto" chooses from a bounded grid later)."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        hint = "; build one with ouroboros_jax.sharding.make_mesh(data, model)" \
            if isinstance(mesh, str) else ""
        raise ValueError(f"mesh must be a jax.sharding.Mesh (or None), got "
                         f"{type(mesh).__name__} {mesh!r}{hint}")
    positions = target.config.max_position_embeddings
    if (max_cache_len is not None and max_cache_len > positions
            and os.environ.get(PAST_POSITIONS_ENV) != "1"):
        raise ValueError(f"max_cache_len={max_cache_len} exceeds the target's "
                         f"max_position_embeddings ({positions}): tokens past it sit at "
                         "positions the model was never trained on. Set "
                         f"{PAST_POSITIONS_ENV}=1 to allow it on purpose")
    limit = positions if max_cache_len is None else max_cache_len
    n_t, n_s, n_first = forward_sizes(spec, cfg)
    for tokens, who in ((n_t, "target"), (max(n_s, n_first), "draft")):
        if tokens > limit:
            raise ValueError(f"config {recipe_of(cfg)} scores {tokens} tokens in one {who} "
                             f"forward, more than the cache holds ({limit} positions: "
                             "max_cache_len / the target's max_position_embeddings); choose a "
                             "smaller tree")
    V = target.config.vocab_size
    rows = getattr(cfg, "pool_rows", None)
    if rows is not None and rows > V:
        raise ValueError(f"{type(cfg).__name__}.pool_rows={rows} exceeds the vocabulary ({V}): "
                         f"key k lives in row k % rows, so rows past {V} are never used")
    if hasattr(cfg, "guesses") and rows is None:
        rows = min(V, DEFAULT_MAX_ROWS)
    margin = 0 if cfg is None else spec.margin(cfg)
    slots = cache_slots(prompt_width, max_new_tokens, margin, max_cache_len)
    need = estimate_bytes(spec, cfg, target, draft, batch, prompt_width, slots, rows)
    if mesh is not None:
        need //= max(1, mesh.size)  # batch and heads split over the mesh's devices
    free = available_bytes()
    if free is not None and need > MEMORY_SHARE * free:
        raise ValueError(f"this call needs about {gib(need)} of device memory ({batch} rows x "
                         f"{slots} cache slots: {batch_name}, max_cache_len / max_new_tokens"
                         f"{', the config' if cfg is not None else ''}), more than the "
                         f"{gib(free)} free; use fewer rows or a smaller max_cache_len")
