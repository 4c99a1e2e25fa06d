"""The target/draft pair a bench or tune run uses: given directories, the shipped demo pair, or
(--quick) a tiny random Llama pair saved with transformers so the peers can load it too."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from ..demo_assets import demo_pair
from ..models import load_model


def quick_pair(dir_: Optional[str] = None):
    """A tiny random Llama target/draft pair saved with transformers (HF layout, so the peers
    can load it too) -> (target, draft) Models."""
    import torch
    import transformers

    dir_ = dir_ or tempfile.mkdtemp(prefix="oj_bench_")
    paths = []
    for name, layers, hidden, heads, kv, inter, seed in (("target", 2, 64, 4, 2, 128, 0),
                                                         ("draft", 1, 32, 2, 1, 64, 1)):
        p = os.path.join(dir_, name)
        if not os.path.exists(os.path.join(p, "config.json")):
            cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden,
                                           intermediate_size=inter, num_hidden_layers=layers,
                                           num_attention_heads=heads, num_key_value_heads=kv,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                           max_position_embeddings=1024)
            torch.manual_seed(seed)
            m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():  # far-from-uniform logits: no argmax near-ties
                for w in m.parameters():
                    w.add_(torch.randn_like(w) * 0.5 * (1.0 if w.dim() > 1 else 0.2))
            m.save_pretrained(p)
        paths.append(p)
    return load_model(paths[0]), load_model(paths[1])


def load_models(target: Optional[str] = None, draft: Optional[str] = None, *,
                dtype: str = "float32", quick: bool = False, quick_dir: Optional[str] = None):
    """(target, draft, source): the given directories, else the demo pair, else (quick) the
    tiny random pair."""
    if target:
        t = load_model(target, dtype=dtype)
        d = load_model(draft, dtype=dtype) if draft else None
        return t, d, "given"
    if not quick:
        try:
            t, d = demo_pair(dtype)
            return t, d, "demo"
        except FileNotFoundError:
            raise FileNotFoundError("the trained demo pair is not shipped yet: pass --target DIR "
                                    "--draft DIR, or use --quick (tiny random pair)") from None
    t, d = quick_pair(quick_dir)
    return t, d, "quick random pair"
