"""Is our vanilla decoding as fast as transformers' greedy `generate` on the same weights?
Result: docs/real-models.md ("Against transformers").

Vanilla decoding: ouroboros-jax vs transformers' own greedy `generate`, same weights, CPU.

    python -m experiments.vanilla_vs_transformers [--model DIR|FILE.gguf] [--prompts 5]
        [--max-new-tokens 128] [--torch-threads 1]

Without --model a ~25M-parameter random Llama (the demo target's shape) is built locally.
Reports first-call compile time separately; tokens/s exclude it. Batch 1, greedy, both
implementations on the same prompts in the same process, and checks the tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def _build_random_llama(path: str) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024,
                                   num_hidden_layers=8, num_attention_heads=6,
                                   num_key_value_heads=6, max_position_embeddings=2048,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (on a small shared CPU one thread is usually "
                         "fastest: two threads collapse under any competing load)")
    a = ap.parse_args(argv)

    import torch
    import transformers

    import ouroboros_jax as oj

    torch.set_num_threads(a.torch_threads)
    path = a.model
    if path is None:
        path = tempfile.mkdtemp()
        _build_random_llama(path)
    model = oj.load_model(path, dtype="float32")
    if path.lower().endswith(".gguf"):  # both read the same GGUF file (transformers needs gguf)
        tm = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
            dtype=torch.float32).eval()
    else:
        tm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rs = np.random.RandomState(0)
    V = model.config.vocab_size
    prompts = [rs.randint(3, V, size=a.prompt_len).tolist() for _ in range(a.prompts)]
    n = a.max_new_tokens

    t = time.perf_counter()
    oj.generate(model, prompts[:1], max_new_tokens=n, eos_token_id=-1)
    compile_s = time.perf_counter() - t
    jax_s, hf_s, jax_tok, hf_tok, same = 0.0, 0.0, 0, 0, True
    for p in prompts:
        o = oj.generate(model, [p], max_new_tokens=n, eos_token_id=-1)
        jax_s += o.stats["seconds"]
        jax_tok += len(o.tokens[0])
        t = time.perf_counter()
        with torch.no_grad():
            ref = tm.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0)[0, len(p):].tolist()
        hf_s += time.perf_counter() - t
        hf_tok += len(ref)
        same &= ref == o.tokens[0]
    res = {"params": model.config.num_params(), "prompts": len(prompts),
           "max_new_tokens": n, "jax_compile_seconds": compile_s,
           "jax_tokens_per_second": jax_tok / jax_s,
           "transformers_tokens_per_second": hf_tok / hf_s,
           "ratio": (jax_tok / jax_s) / (hf_tok / hf_s), "identical": bool(same),
           "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
