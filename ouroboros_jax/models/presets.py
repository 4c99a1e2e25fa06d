"""Full-size configurations of the paper's model pairs and of the pairs the accelerator
projection and device script size (Llama 3.1/3.2, the real Qwen2.5-Coder pair), for planning,
lowering and projection (shapes only: nothing here holds weights). Each family declares its
own (`Family.presets`, models/families/), from each model's Hugging Face config.json; this
module adds the family's model_type and features."""

from .config import ModelConfig
from .families import BY_MODEL_TYPE


def _presets() -> dict[str, ModelConfig]:
    """Every family's presets, by name; ValueError naming a name two families declare."""
    out: dict[str, ModelConfig] = {}
    for family in BY_MODEL_TYPE.values():
        for name, fields in family.presets.items():
            if name in out:
                raise ValueError(f"preset {name!r} is declared by two families")
            out[name] = ModelConfig(model_type=family.model_type,
                                    **{**family.features, **fields})
    return out


PRESETS = _presets()
