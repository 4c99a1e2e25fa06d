"""`Model`: a loaded model (static config, params pytree, tokenizer, provenance) and the copies
derived from its params (placed on a mesh, packed for decoding), with the check every params
pytree passes. The loaders (`loading.py`, `gguf.py`, `sharding.load_sharded`) make them."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

from .config import ModelConfig
from .llama import Params
from .params import nest


@dataclasses.dataclass
class Model:
    """A loaded model: static config, params pytree, optional tokenizer, where it came from."""

    config: ModelConfig
    params: Params
    tokenizer: Any = None
    path: Optional[str] = None
    # generation_config.json's fields (eos_token_id, ...), {} when the directory has none
    generation_config: dict = dataclasses.field(default_factory=dict)
    # copies made from the params, each kept beside the params it was made from: this model
    # placed on a mesh (sharding.shard_model, key ("mesh", mesh)) and the packed layout
    # decoding runs on one CPU or GPU (layout.decode_params, key "packed": views of the
    # params' buffers on a CPU, no bytes; a copy on a GPU). They live and die with the model;
    # a `dataclasses.replace` of it starts with none.
    derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                      compare=False)

    def __post_init__(self):
        check_params(self.config, self.params)

    def derived_copy(self, key) -> Any:
        """The copy kept under `key` when it was made from the current params (the same
        object), else None: a model whose params were replaced makes its copies anew."""
        hit = self.derived.get(key)
        return hit[1] if hit is not None and hit[0] is self.params else None

    def keep_derived(self, key, copy) -> Any:
        """Keeps `copy`, made from the current params, under `key`; returns it."""
        self.derived[key] = (self.params, copy)
        return copy

    def drop_derived(self, key) -> None:
        """Forgets the copy under `key` (its memory goes when nothing else holds it)."""
        self.derived.pop(key, None)

    @property
    def dtype(self):
        return self.params["embed"].dtype


def check_params(config, params) -> None:
    """A params pytree must be exactly the config's leaves (`params.LEAVES`), each of its shape
    and a floating dtype: a hand-built Model fails here naming the leaf, not as a KeyError or a
    scan shape error inside the first forward. Shapes only (abstract arrays pass too)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"Model: config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(params, dict) or not isinstance(params.get("layers"), dict):
        raise ValueError("Model: params must be a dict of the config's leaves with a 'layers' "
                         f"dict (as load_model or init_params build it), got "
                         f"{type(params).__name__}"
                         + (f" with keys {sorted(params)}" if isinstance(params, dict) else ""))
    want = nest(config, lambda leaf: leaf)
    for where, got, expected in (("params", params, want),
                                 ("params['layers']", params["layers"], want["layers"])):
        names = set(expected) - ({"layers"} if where == "params" else set())
        have = set(got) - ({"layers"} if where == "params" else set())
        if have != names:
            missing, extra = sorted(names - have), sorted(have - names)
            raise ValueError(f"Model: {where} " + "; ".join(
                x for x in ((f"lacks {missing}" if missing else ""),
                            (f"has unexpected {extra}" if extra else "")) if x)
                + f" for a {config.model_type} config")
        for name in sorted(names):
            leaf, a = expected[name], got[name]
            shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
            if shape is None or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"Model: {where}[{name!r}] must be a floating-point array, "
                                 f"got {dtype if dtype is not None else type(a).__name__}")
            if tuple(shape) != leaf.shape(config):
                raise ValueError(f"Model: {where}[{name!r}] has shape {tuple(shape)}, the "
                                 f"config implies {leaf.shape(config)} (axes {leaf.axes})")
