"""ouroboros-jax: Ouroboros speculative decoding for JAX (see README.md)."""

from .models import Model, ModelConfig, load_model, save_hf_checkpoint

__all__ = ["Model", "ModelConfig", "load_model", "save_hf_checkpoint"]
