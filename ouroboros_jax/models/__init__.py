"""Llama-family models as pure functions; knows nothing of decoding."""

from .config import ModelConfig
from .kv_cache import KVCache, NewKV, commit, commit_prefix, init_cache, rollback
from .llama import causal_mask, forward, init_params, param_shapes
from .loading import Model, load_model, save_hf_checkpoint

__all__ = ["ModelConfig", "KVCache", "NewKV", "commit", "commit_prefix", "init_cache", "rollback",
           "causal_mask", "forward", "init_params", "param_shapes", "Model", "load_model",
           "save_hf_checkpoint"]
