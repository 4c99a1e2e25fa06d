"""How many slots `serve` runs and how long each slot's cache is: sized by a memory budget.

A slot holds one request's KV cache for its whole life, so slots x cache tokens x bytes per
token is what the engine's caches take. The model's whole context per slot (8192 tokens x 8
slots on SmolLM2) holds gigabytes nobody asked for, and every device step writes through
them; vLLM instead caps each request (`--max-model-len`) and gives the KV cache a share of
the memory (`gpu_memory_utilization`). This module is that rule for fixed slots:

- a request's cap, prompt + max_tokens: `--max-cache-len` when given (the explicit override;
  it wins over `--max-model-len`), else `--max-model-len` (default DEFAULT_MAX_MODEL_LEN),
  never past the model's context;
- a slot's cache: that cap plus the method's margin, rounded up as the engine rounds it
  (`request.cache_slots`);
- the slots: as many as `--slots` asks for and `--memory-fraction` of the device's memory
  (a CPU's: the host's) holds, at `bounds.kv_bytes_per_token` (target plus the draft where
  the method runs one). Requests beyond the slots wait in the queue (`scheduler`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..bounds import gib, kv_bytes_per_token, total_bytes
from ..request import cache_slots

DEFAULT_MEMORY_FRACTION = 0.1  # 2.4 GiB of a 24 GiB host: room for the weights and others
DEFAULT_MAX_MODEL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """serve's sizing (`plan_cache`).

    Attributes:
        slots: requests decoded together (at most the slots asked for).
        max_model_len: prompt + max_tokens a request may have (the engine's max_cache_len).
        cache_tokens: cache slots per slot as the engine allocates them (a power of two).
        token_bytes: KV bytes per cached token, target and draft together.
        budget_bytes: the bytes --memory-fraction gives the caches (None: memory unknown).
        asked_slots: --slots.
        source: the flag max_model_len came from.
    """

    slots: int
    max_model_len: int
    cache_tokens: int
    token_bytes: int
    budget_bytes: Optional[int]
    asked_slots: int
    source: str

    @property
    def kv_bytes(self) -> int:
        """Bytes of every slot's KV cache."""
        return self.slots * self.cache_tokens * self.token_bytes

    def describe(self) -> str:
        """One line for serve's startup: what was chosen and why."""
        budget = "" if self.budget_bytes is None else f" of a {gib(self.budget_bytes)} budget"
        fewer = (f" (--slots {self.asked_slots} do not fit --memory-fraction)"
                 if self.slots < self.asked_slots else "")
        return (f"{self.slots} slots{fewer} x {self.cache_tokens} cache tokens, requests up to "
                f"{self.max_model_len} tokens ({self.source}); KV caches "
                f"{gib(self.kv_bytes)}{budget}")


def check_flags(memory_fraction, max_model_len, max_cache_len) -> None:
    """The sizing flags' forms, checked before anything loads: ValueError naming the flag."""
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
            or not 0 < memory_fraction <= 1:
        raise ValueError(f"--memory-fraction must be in (0, 1], got {memory_fraction!r}")
    for flag, v in (("--max-cache-len", max_cache_len), ("--max-model-len", max_model_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
            raise ValueError(f"{flag} must be an integer >= 2 (prompt + max_tokens), got {v!r}")


def request_cap(context: int, max_model_len: Optional[int],
                max_cache_len: Optional[int]) -> tuple[int, str]:
    """(prompt + max_tokens cap of one request, the flag it comes from): --max-cache-len wins,
    then --max-model-len (never past the model's context), else min(DEFAULT_MAX_MODEL_LEN,
    the model's context)."""
    if max_cache_len is not None:
        return max_cache_len, "--max-cache-len"
    if max_model_len is not None:
        if max_model_len > context:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of "
                             f"{context} tokens")
        return max_model_len, "--max-model-len"
    return min(DEFAULT_MAX_MODEL_LEN, context), "default --max-model-len"


def plan_cache(target, draft, *, slots: int, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
               max_model_len: Optional[int] = None, max_cache_len: Optional[int] = None,
               margin: int = 0, memory: Optional[int] = None) -> CachePlan:
    """serve's slots and cache from its flags; see the module docstring. target, draft:
    loaded models (draft None, or one the method runs). margin: the method's cache slots past
    a request's tokens (`MethodSpec.margin`). memory: the bytes the fraction is of (default:
    `bounds.total_bytes`). ValueError naming the flag when not one slot fits."""
    check_flags(memory_fraction, max_model_len, max_cache_len)
    cap, source = request_cap(target.config.max_position_embeddings, max_model_len,
                              max_cache_len)
    per_token = sum(kv_bytes_per_token(m.config, m.params["embed"].dtype.itemsize)
                    for m in (target, draft) if m is not None)
    tokens = cache_slots(0, 0, margin, cap)
    memory = total_bytes() if memory is None else memory
    if memory is None:  # the backend does not say: the slots asked for
        return CachePlan(slots, cap, tokens, per_token, None, slots, source)
    budget = int(memory_fraction * memory)
    fit = budget // (tokens * per_token)
    if fit < 1:
        raise ValueError(f"--memory-fraction {memory_fraction} gives the KV caches "
                         f"{gib(budget)}, less than one slot of {tokens} cache tokens takes "
                         f"({gib(tokens * per_token)}); raise --memory-fraction or lower "
                         f"{source.removeprefix('default ')}")
    return CachePlan(min(slots, fit), cap, tokens, per_token, budget, slots, source)
