"""What config="auto" keys its store by: the device kind, a model's signature, the batch bucket.

A model's signature is its shape, dtype, quantization and placement (what its forward's cost depends on,
`signature_of`). Auto reads it some 37 times a call (2-3 ms of `dataclasses.asdict` and
hashing on a 0.3 s demo call), so a `Signatures` object remembers it per embedding array and
config, dropping it with the array; an `AutoTuner` owns one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref

import jax


def signature_of(model) -> str:
    """Shape, dtype, quantization and placement of a model, hashed (token ids left out: they
    cost nothing)."""
    cfg = dataclasses.asdict(model.config)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(k, None)
    leaf = model.params["embed"]
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    where = (dict(mesh.shape) if mesh is not None
             else len(getattr(sharding, "device_set", [0]) or [0]))
    from ..models.quant import is_quantized, is_quantized_params

    # quantized weights (a draft's int8 codes) run other products at other prices, and the
    # draft's form (k4: activations quantized too) others again
    k4 = any(getattr(x, "k4", False) for x in jax.tree.leaves(model.params,
                                                              is_leaf=is_quantized))
    blob = json.dumps([cfg, str(leaf.dtype), str(where)]
                      + (["quantized"] if is_quantized_params(model.params) else [])
                      + (["k4"] if k4 else []),
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def device_kind() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}:{jax.device_count()}"


def batch_bucket(batch: int) -> int:
    return 1 << max(0, (int(batch) - 1).bit_length())


class Signatures:
    """`signature_of`, remembered per embedding array and config (a model placed anew has new
    arrays; the entry is dropped when its array is)."""

    def __init__(self):
        self._known: dict = {}  # id(embedding leaf) -> {model config: signature}

    def __call__(self, model) -> str:
        leaf = model.params["embed"]
        known = self._known.get(id(leaf))
        if known is None:
            known = self._known[id(leaf)] = {}
            weakref.finalize(leaf, self._known.pop, id(leaf), None)
        sig = known.get(model.config)
        if sig is None:
            sig = known[model.config] = signature_of(model)
        return sig

    def __len__(self) -> int:
        """How many embedding arrays' signatures are remembered (an array's entry goes with
        it)."""
        return len(self._known)

    def pair(self, target, draft) -> str:
        """The store's key of a pair: its prompts' agreement, what its calls realised, its
        acceptance by depth."""
        return f"{self(target)}|{self(draft)}"

    def realised(self, target, draft, method=None) -> str:
        """The store's key of what calls realised: a pair's agreement, or, for a method without
        a draft (prompt lookup: its copy hit rate), that method's on this target."""
        return f"{self(target)}|{self(draft) if draft is not None else method}"
