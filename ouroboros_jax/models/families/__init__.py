"""The model families, one module each: the registry the loaders and presets consult.

Every module of this package but `base` is a family module and exports `FAMILIES`, a tuple of
`base.Family` records (llama.py exports Llama and Mistral). They are found by listing the
package, so adding a family is adding its file (docs/architecture.md, "Adding a model
family"). `config.py` (config.json), `gguf.py` (GGUF metadata and tensors), `params.py` (fused
tensors) and `presets.py` look a family up here, by model_type or GGUF architecture, and never
branch on its name; the forward (`models/llama.py`) sees only `ModelConfig` fields.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType, ModuleType

from .base import Family

_HELPERS = ("base",)  # modules here that define no family


def discover_modules() -> tuple[ModuleType, ...]:
    """Every family module of this package, in name order; ImportError naming a module that
    exports no FAMILIES (a file added here that registers nothing would be a silent no-op)."""
    modules = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _HELPERS:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        families = getattr(module, "FAMILIES", None)
        if not (isinstance(families, tuple) and families
                and all(isinstance(f, Family) for f in families)):
            raise ImportError(f"{module.__name__}: a family module must export FAMILIES, a "
                              f"non-empty tuple of Family records, got {families!r}")
        modules.append(module)
    return tuple(modules)


def index_by(modules, key: str) -> dict[str, Family]:
    """{family.<key>: family} over every family that has one; ImportError on a duplicate."""
    out: dict[str, Family] = {}
    for module in modules:
        for family in module.FAMILIES:
            name = getattr(family, key)
            if name is None:
                continue
            if name in out:
                raise ImportError(f"{module.__name__}: {key} {name!r} is registered twice")
            out[name] = family
    return out


MODULES = discover_modules()
# model_type -> Family, and GGUF general.architecture -> Family
BY_MODEL_TYPE = MappingProxyType(index_by(MODULES, "model_type"))
BY_GGUF_ARCH = MappingProxyType(index_by(MODULES, "gguf_arch"))
# GGUF architecture -> the family of its files that carry `<arch>.expert_count` (Mixtral's)
BY_GGUF_EXPERTS_OF = MappingProxyType(index_by(MODULES, "gguf_experts_of"))
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)
GGUF_ARCHITECTURES = tuple(BY_GGUF_ARCH)
# config.json fields some family's checkpoints carry without effect (accepted in every config,
# since checkpoints copy each other's fields): name -> the values that change nothing, and the
# names accepted at any value
HF_NEUTRAL_VALUES = MappingProxyType({name: values for f in BY_MODEL_TYPE.values()
                                      for name, values in f.hf_neutral.items()})
HF_IGNORED_FIELDS = frozenset().union(*(f.hf_ignored for f in BY_MODEL_TYPE.values()))


def family_of(model_type: str) -> Family:
    """The family of a `ModelConfig.model_type` (which its constructor has checked)."""
    return BY_MODEL_TYPE[model_type]


__all__ = ["Family", "discover_modules", "index_by", "MODULES", "BY_MODEL_TYPE", "BY_GGUF_ARCH",
           "BY_GGUF_EXPERTS_OF",
           "SUPPORTED_MODEL_TYPES", "GGUF_ARCHITECTURES", "HF_NEUTRAL_VALUES", "HF_IGNORED_FIELDS",
           "family_of"]
