"""Moved: `config="auto"` lives in `ouroboros_jax.auto`, one `AutoTuner` object per owner.

Kept for callers of the two names docs/api.md documented here: `auto_config` (now the default
tuner's, `ouroboros_jax.auto.default_tuner().auto_config`) and `cache_path`.
"""

from __future__ import annotations

from ..auto import cache_path, default_tuner

__all__ = ["auto_config", "cache_path"]


def auto_config(method: str, target, draft, prompt, plens, slots: int, **kw):
    """`ouroboros_jax.auto.AutoTuner.auto_config` of the process's default tuner."""
    return default_tuner().auto_config(method, target, draft, prompt, plens, slots, **kw)
