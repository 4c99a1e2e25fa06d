"""ouroboros-jax: Ouroboros speculative decoding for JAX (see README.md).

    import ouroboros_jax as oj
    target, draft = oj.demo_pair()
    out = oj.generate(target, ["def fib(n):"], draft=draft, method="ouroboros")

Dimension letters, one meaning each in every shape comment and einsum of the project (a module
docstring lists the ones it uses; einsums use the lower-case letters, and attention's name the
new tokens seen as keys `o`):

    model     B batch rows, T new tokens of one forward (the nodes of its tree), S cache slots
              (= sequence buffer slots), L layers, H query heads, K kv heads, J query heads per
              kv head (H = K * J), D head dim, E embed (hidden), F ffn (intermediate), V vocab,
              Z slots of one attention cache block, Q positions whose logits a forward keeps,
              Y experts (a mixture of experts' MLP), O routed rows (token, expert assignments)
    decoding  P prompt width (padded), A tokens one `emit` / `commit` / accept walk handles,
              γ gamma (draft tokens per round; `gamma` in code), W window, N n-gram size,
              M = N - 1 phrase length, G guesses (pool phrases per key), X suffixes (branches
              after the draft chain), C chain length, U prefix slot (tokens a model has not
              processed yet, fed before its tree)
    pool      R pool rows, G slots per row (= guesses), I phrases inserted at once

One meaning of "config" too: `config` is a decoding method's config (`oj.SpeculativeConfig`,
..., or "auto") wherever a caller picks a method (`generate`, the serving engine, the CLI's
`--config`), and `cfg` inside decoding/; a model's architecture is a `ModelConfig`, named
`model.config` on a Model, `model_config` (or `tconfig` / `dconfig` for a pair's target and
draft) inside decoding/, and `config` only inside models/, which never sees a method config.
"""

from . import xla_cpu

xla_cpu.apply()  # before JAX creates its CPU client: see xla_cpu.py for the measurement

from .notices import silence_torch_advisory

silence_torch_advisory()  # transformers' "PyTorch was not found" banner: the models here are JAX

from .decoding.lookahead import LookaheadConfig
from .decoding.ouroboros import OuroborosConfig
from .decoding.prompt_lookup import PromptLookupConfig
from .decoding.speculative import SpeculativeConfig
from .generate import GenerationOutput, generate
from .models import Model, ModelConfig, load_model, save_hf_checkpoint
from .pool import PhrasePool, init_pool, load_pool, save_pool
from .demo_assets import demo_pair, demo_prompts
from . import serving

__all__ = ["GenerationOutput", "LookaheadConfig", "Model", "ModelConfig", "OuroborosConfig",
           "PhrasePool", "PromptLookupConfig", "SpeculativeConfig", "demo_pair", "demo_prompts",
           "generate",
           "init_pool", "load_model", "load_pool", "save_hf_checkpoint", "save_pool", "serving"]
