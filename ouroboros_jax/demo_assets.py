"""The shipped demo pair: `ouroboros_jax/assets/demo/{target,draft}` in Hugging Face layout.

Both were trained by `ouroboros_jax.training` on the Python standard library (see
`assets/demo/PROVENANCE.md`); they share one byte-level BPE tokenizer. This module only reads
them, so it lives outside `training/`: using the pair needs neither optax nor any training code.
"""

from __future__ import annotations

import json
from pathlib import Path

from .models.loading import load_model

DEMO_DIR = Path(__file__).resolve().parent / "assets" / "demo"


def demo_available() -> bool:
    return all((DEMO_DIR / m / "config.json").exists() for m in ("target", "draft"))


def _require():
    if not demo_available():
        raise FileNotFoundError(
            f"the demo pair is not shipped in {DEMO_DIR}; train and export it with the commands in "
            "ouroboros_jax/training/README.md")


def demo_pair(dtype: str = "float32"):
    """(target, draft) as `ouroboros_jax.models.Model`s, tokenizer attached to each."""
    _require()
    return load_model(str(DEMO_DIR / "target"), dtype), load_model(str(DEMO_DIR / "draft"), dtype)


def demo_prompts() -> list[dict]:
    """Built-in code prompts drawn from held-out files: [{"file", "text"}], a `def` line and its
    docstring with the lines above it as context (never seen in training)."""
    _require()
    return json.loads((DEMO_DIR / "prompts.json").read_text())


def demo_provenance() -> dict:
    _require()
    return json.loads((DEMO_DIR / "provenance.json").read_text())
