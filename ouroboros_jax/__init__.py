"""ouroboros-jax: Ouroboros speculative decoding for JAX (see README.md).

    import ouroboros_jax as oj
    target, draft = oj.demo_pair()
    out = oj.generate(target, ["def fib(n):"], draft=draft, method="ouroboros")
"""

from .decoding.lookahead import LookaheadConfig
from .decoding.ouroboros import OuroborosConfig
from .decoding.speculative import SpeculativeConfig
from .generate import GenerationOutput, generate
from .models import Model, ModelConfig, load_model, save_hf_checkpoint
from .pool import PhrasePool, init_pool, load_pool, save_pool
from .demo_assets import demo_pair, demo_prompts

__all__ = ["GenerationOutput", "LookaheadConfig", "Model", "ModelConfig", "OuroborosConfig",
           "PhrasePool", "SpeculativeConfig", "demo_pair", "demo_prompts", "generate",
           "init_pool", "load_model", "load_pool", "save_hf_checkpoint", "save_pool"]
