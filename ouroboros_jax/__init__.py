"""ouroboros-jax: Ouroboros speculative decoding for JAX (see README.md).

    import ouroboros_jax as oj
    target = oj.load_model("path/to/hf_dir")
    out = oj.generate(target, ["def fib(n):"], max_new_tokens=64)
"""

from .generate import GenerationOutput, generate
from .models import Model, ModelConfig, load_model, save_hf_checkpoint

__all__ = ["GenerationOutput", "Model", "ModelConfig", "generate", "load_model",
           "save_hf_checkpoint"]
