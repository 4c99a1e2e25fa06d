"""A public checkpoint in the suite: SmolLM2-135M-Instruct loaded from its Q4_1 GGUF.

Vanilla greedy equals transformers' greedy on the same file (transformers dequantizes and
un-permutes it itself: `from_pretrained(dir, gguf_file=...)`, fp32) on chat prompts, and every
method equals vanilla: those without a draft as they are, those with one given a random tiny
draft over the same 49152-token vocabulary (acceptance is near zero, exactness is the point).
"""

import os

import jax
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.decoding import METHODS
from ouroboros_jax.models import ModelConfig, init_params
from ouroboros_jax.models.loading import Model

NEW = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


@pytest.fixture(scope="module")
def vanilla(smollm2):
    return oj.generate(smollm2, CHATS, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_gguf_path):
    """transformers' greedy tokens for each chat, on the same GGUF, fp32, computed once."""
    import torch
    import transformers

    tm = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf_path), gguf_file=os.path.basename(smollm2_gguf_path),
        dtype=torch.float32).eval()
    out = []
    for chat in CHATS:
        ids = smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
        with torch.no_grad():
            r = tm.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW)
        out.append(r[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def tiny_draft(smollm2):
    cfg = ModelConfig(vocab_size=smollm2.config.vocab_size, hidden_size=64,
                      intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                      max_position_embeddings=smollm2.config.max_position_embeddings,
                      eos_token_id=2)
    return Model(cfg, init_params(cfg, jax.random.key(0), std=0.08))


def test_config_from_the_gguf(smollm2):
    c = smollm2.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.intermediate_size) == (49152, 576, 30, 9, 3, 64, 1536)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.model_type == "llama"
    assert smollm2.tokenizer.chat_template and c.eos_token_id == 2


def test_vanilla_equals_transformers_on_chat_prompts(vanilla, reference):
    assert vanilla.tokens == reference
    # the replies are real text and end at the end-of-turn token when they end early
    assert "Paris" in vanilla.texts[0]
    assert all(t[-1] == 2 or len(t) == NEW for t in vanilla.tokens)


@pytest.mark.parametrize("method", sorted(m for m, s in METHODS.items()
                                          if not s.needs_draft and m != "vanilla"))
def test_no_draft_methods_equal_vanilla(smollm2, vanilla, method):
    spec = METHODS[method]
    cfg = spec.quick_config() if spec.quick_config else None
    out = oj.generate(smollm2, CHATS, method=method, config=cfg, max_new_tokens=NEW)
    assert out.tokens == vanilla.tokens


@pytest.mark.parametrize("method", sorted(m for m, s in METHODS.items() if s.needs_draft))
def test_draft_methods_with_a_tiny_random_draft_equal_vanilla(smollm2, tiny_draft, vanilla,
                                                              method):
    spec = METHODS[method]
    cfg = spec.quick_config() if spec.quick_config else None
    out = oj.generate(smollm2, CHATS, draft=tiny_draft, method=method, config=cfg,
                      max_new_tokens=NEW)
    assert out.tokens == vanilla.tokens
    assert out.stats["draft_calls"] > 0  # the draft really ran
