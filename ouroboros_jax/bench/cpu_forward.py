"""Our CPU forward beside the memory-bandwidth bound and llama.cpp, on the same weights.

    python -m ouroboros_jax.bench.cpu_forward --target SMOLLM2_DIR --gguf SmolLM2-F32.gguf \
        --max-new-tokens 96 --reps 3

Measures, interleaved over `--reps` rounds (the machine is shared: medians and spread):
  - the bandwidth bound: this machine's memory read rate (numpy copy and sum of 256 MB) and
    the seconds reading the model's weights once takes at it (a 1-token step's lower bound);
  - our 1-token forward (`models.timing.forward_timer`, after a prompt-long cache);
  - vanilla decoding's seconds per token (`oj.generate`, greedy, one prompt);
  - llama.cpp's (llama-cpp-python, greedy, same prompt), when `llama_cpp` is installed and
    `--gguf` names an F32 GGUF of the same weights (`--quantize-from Q.gguf` writes one with
    `llama_model_quantize(LLAMA_FTYPE_ALL_F32, allow_requantize)`); skipped cleanly otherwise.
Prints one JSON object; "tokens_identical" compares our greedy tokens with llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

PROMPT = ("Rewrite this Python code with type hints.\n\n```python\ndef moving_average(values, "
          "window):\n    result = []\n    total = 0\n    for i, value in enumerate(values):\n"
          "        total += value\n        if i >= window:\n            total -= values[i - "
          "window]\n        if i >= window - 1:\n            result.append(total / window)\n"
          "    return result\n```")


def memory_read_rate(mb: int = 256, reps: int = 5) -> float:
    """Bytes/s this machine reads: the best of `reps` numpy sums and copies of `mb` MB (a copy
    reads and writes, so it counts twice)."""
    a = np.ones(mb * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t))
    return best


def quantize_f32(src: str, dst: str) -> None:
    """Writes an F32 GGUF of `src`'s weights (llama.cpp dequantizes on requantize)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src!r}) failed with {rc}")


def llama_cpp_runner(gguf: str, threads: int):
    """-> run(prompt_ids, n) -> (tokens, seconds per generated token), greedy, or None when
    llama_cpp is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512,
                          verbose=False, logits_all=False)

    def run(ids, n):
        llm.reset()
        out, t0, t_first = [], time.perf_counter(), None
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            if t_first is None:
                t_first = time.perf_counter()  # prompt processed, first token out
            out.append(int(tok))
            if len(out) >= n:
                break
        return out, (time.perf_counter() - t_first) / max(len(out) - 1, 1)

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ouroboros_jax.bench.cpu_forward")
    ap.add_argument("--target", required=True, help="model directory (HF layout, fp32)")
    ap.add_argument("--gguf", help="F32 GGUF of the same weights, for llama.cpp")
    ap.add_argument("--quantize-from", help="write --gguf from this GGUF first")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args(argv)
    import jax

    import ouroboros_jax as oj
    from ..models.timing import forward_timer

    model = oj.load_model(a.target)
    ids = list(model.tokenizer(PROMPT)["input_ids"]) if model.tokenizer else list(range(3, 99))
    n = a.max_new_tokens
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    step = forward_timer(model, 1, len(ids), 1024)
    oj.generate(model, [ids], max_new_tokens=n, eos_token_id=-1)  # compile
    lcpp = None
    if a.gguf:
        if a.quantize_from and not os.path.exists(a.gguf):
            quantize_f32(a.quantize_from, a.gguf)
        lcpp = llama_cpp_runner(a.gguf, a.threads)
    rows = {"bandwidth_bytes_per_s": [], "forward_s": [], "vanilla_s_per_token": [],
            "llama_cpp_s_per_token": []}
    ours = theirs = None
    for _ in range(a.reps):
        rows["bandwidth_bytes_per_s"].append(memory_read_rate())
        rows["forward_s"].append(min(step() for _ in range(5)))
        o = oj.generate(model, [ids], max_new_tokens=n, eos_token_id=-1)
        rows["vanilla_s_per_token"].append(o.stats["seconds"] / len(o.tokens[0]))
        ours = o.tokens[0]
        if lcpp is not None:
            theirs, s = lcpp(ids, n)
            rows["llama_cpp_s_per_token"].append(s)
    med = {k: float(np.median(v)) if v else None for k, v in rows.items()}
    res = {"command": "python -m ouroboros_jax.bench.cpu_forward " + " ".join(
        sys.argv[1:] if argv is None else argv),
        "weight_bytes": int(weight_bytes), "prompt_tokens": len(ids), "new_tokens": n,
        "median": med, "spread": {k: [round(min(v), 5), round(max(v), 5)] for k, v in
                                  rows.items() if v},
        "bandwidth_bound_s": weight_bytes / med["bandwidth_bytes_per_s"],
        "llama_cpp": "not installed or no --gguf" if lcpp is None else "ran"}
    if lcpp is not None:
        per_rep = [t / v for t, v in zip(rows["llama_cpp_s_per_token"],
                                         rows["vanilla_s_per_token"])]
        res["vanilla_speed_vs_llama_cpp"] = float(np.median(per_rep))
        res["vanilla_speed_vs_llama_cpp_per_rep"] = [round(x, 3) for x in per_rep]
        res["tokens_identical"] = ours == theirs
        res["first_divergence"] = next((i for i, (x, y) in enumerate(zip(ours, theirs))
                                        if x != y), None)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
