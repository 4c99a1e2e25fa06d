"""Compatibility name: the demo-pair readers live in `ouroboros_jax.demo_assets` (reading the
shipped pair needs no training code)."""

from ouroboros_jax.demo_assets import (DEMO_DIR, demo_available, demo_pair, demo_prompts,
                                       demo_provenance)

__all__ = ["DEMO_DIR", "demo_available", "demo_pair", "demo_prompts", "demo_provenance"]
