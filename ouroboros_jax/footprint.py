"""What a model pair holds in memory on one device, from configs alone (`ouroboros-jax memory`
with --model/--draft prints it): per model its weights in the canonical layout, the packed
layout's extra bytes on a CPU (views of the weights: none, `layout.view_pack`) and on a GPU (a
fused copy, `layout.pack`, made where it fits), its KV cache for B rows of S tokens; and the
peak a process should stay under, PEAK_FACTOR x (weights + packed copy + KV caches).

The factor covers what is not weights or caches: the runtime and the compiled programs, the
forward's activations and logits, the tokenizer, Python. Measured on the real pair
(docs/real-models.md "Memory", `experiments/memory_parts.py`): a CLI run's peak RSS against this
bound is issue 53's gate. Letters as in the package glossary.
"""

from __future__ import annotations

import dataclasses
import math

from .bounds import kv_bytes_per_token
from .models.params import nest

# a process's peak over its weights, packed copy and caches, at most (see the module docstring)
PEAK_FACTOR = 1.3


@dataclasses.dataclass(frozen=True)
class Footprint:
    """One model's bytes on one device (see the module docstring)."""

    name: str
    weights: int  # the canonical params
    packed_cpu: int  # the packed layout's extra bytes on a CPU (views: 0)
    packed_gpu: int  # the fused packed copy a GPU keeps when it has room
    kv_cache: int  # k and v of B rows of S tokens

    def total(self, platform: str) -> int:
        """Weights, the packed layout's extra bytes on `platform` ("cpu" or "gpu"), caches."""
        return self.weights + self.packed(platform) + self.kv_cache

    def packed(self, platform: str) -> int:
        return self.packed_gpu if platform == "gpu" else self.packed_cpu


def leaf_bytes(leaf, config, itemsize: int, code_bytes: float = 0) -> int:
    """A params leaf's bytes: `itemsize` an element, or where code_bytes > 0 and the leaf is a
    quantized one (`quant.quantizable`: every linear weight but a router) its codes at
    code_bytes each and a float32 scale per output channel (int8's per-channel grouping; a
    GGUF's blocks kept as stored add a scale per 32 inputs, at most 1/8 more)."""
    from .models.quant import quantizable

    shape = leaf.shape(config)
    n = math.prod(shape)
    if code_bytes <= 0 or not quantizable(leaf):
        return n * itemsize
    lead = leaf.per_layer + leaf.per_expert
    inputs = math.prod(shape[lead:lead + leaf.hf_in_dims])
    return int(n * code_bytes) + n // inputs * 4


def layer_bytes(config, itemsize: int, code_bytes: float = 0) -> tuple[int, int]:
    """(bytes of every per-layer leaf, bytes of the top-level leaves) of the config's params
    (`leaf_bytes`)."""
    sizes = nest(config, lambda leaf: leaf_bytes(leaf, config, itemsize, code_bytes))
    layers = sizes.pop("layers")
    return sum(layers.values()), sum(sizes.values())


def footprint(name: str, config, itemsize: int, batch: int, cache_len: int,
              code_bytes: float = 0) -> Footprint:
    """One model's `Footprint`: params of `itemsize` bytes an element (the caches' too), a
    cache of `batch` rows of `cache_len` tokens; code_bytes > 0: its linear weights quantized,
    each code that many bytes (`leaf_bytes`)."""
    layers, top = layer_bytes(config, itemsize, code_bytes)
    head = config.vocab_size * config.hidden_size * itemsize  # a tied head, transposed
    copy = layers + (head if config.tie_word_embeddings else 0)
    return Footprint(name=name, weights=layers + top, packed_cpu=0, packed_gpu=copy,
                     kv_cache=batch * cache_len * kv_bytes_per_token(config, itemsize))


def peak_bound(rows: list, platform: str) -> int:
    """The peak a process holding `rows`' models should stay under on `platform`."""
    return int(PEAK_FACTOR * sum(r.total(platform) for r in rows))
