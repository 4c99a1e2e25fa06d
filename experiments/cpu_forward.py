"""How far is our CPU forward from the memory-bandwidth bound and from llama.cpp? Result:
docs/real-models.md ("The CPU layout").

Our CPU forward beside the memory-bandwidth bound and llama.cpp, on the same weights.

    python -m experiments.cpu_forward --target SMOLLM2_DIR --gguf SmolLM2-F32.gguf \
        --max-new-tokens 96 --reps 3

Measures, interleaved over `--reps` rounds (the machine is shared: medians and spread):
  - the bandwidth bound: this machine's memory read rate (numpy copy and sum of 256 MB) and
    the seconds reading the model's weights once takes at it (a 1-token step's lower bound);
  - our forward of T tokens for each T of `--sizes` (`models.timing.forward_timer`, after a
    prompt-long cache): T = 1 is a decoding step's, larger T a verification tree's, and their
    ratio is what a speculative method's extra tokens per forward must beat on this device;
  - both in the layout decoding uses by default ("layout": packed for large models on a CPU,
    models/layout.py) and in the canonical stacked one (`layout.set_packing(False)`), whose
    ratio is "layout_speedup_*" (the tokens of both must be identical);
  - vanilla decoding (`oj.generate`, greedy, one prompt) and llama.cpp (llama-cpp-python,
    greedy, same prompt), when `llama_cpp` is installed and `--gguf` names an F32 GGUF of the
    same weights (`--quantize-from Q.gguf` writes one with `llama_model_quantize(
    LLAMA_FTYPE_ALL_F32, allow_requantize)`); skipped cleanly otherwise. Both are timed the
    same two ways: the whole call (prompt processing and N tokens) per token, and decoding
    alone, per token after the first (ours: the call for N tokens minus the call for one).
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


def _llama_cpp_generate(llm, ids, n):
    """Greedy llama.cpp -> (tokens, seconds of the whole call, seconds per token after the
    first)."""
    llm.reset()
    out, t0, t_first = [], time.perf_counter(), None
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        if t_first is None:
            t_first = time.perf_counter()  # prompt processed, first token out
        out.append(int(tok))
        if len(out) >= n:
            break
    t_end = time.perf_counter()
    return out, t_end - t0, (t_end - t_first) / max(len(out) - 1, 1)


def _llama_cpp_server(conn, gguf: str, threads: int) -> None:
    """The child process: loads the GGUF, then answers (ids, n) requests until None."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512,
                          verbose=False, logits_all=False)
    conn.send("ready")
    while (req := conn.recv()) is not None:
        conn.send(_llama_cpp_generate(llm, *req))


def llama_cpp_runner(gguf: str, threads: int):
    """-> run(prompt_ids, n) -> (tokens, call seconds, decode seconds per token), greedy, or
    None when llama_cpp is not installed.

    llama.cpp runs in a child process: in ours, its worker threads kept polling after a call
    and slowed our next vanilla call by about 40% (measured: 55.6 vs 39.0 ms per token)."""
    import importlib.util
    import multiprocessing as mp

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_llama_cpp_server, args=(theirs, gguf, threads), daemon=True)
    child.start()
    if not mine.poll(600) or mine.recv() != "ready":
        child.kill()
        raise RuntimeError(f"llama.cpp could not load {gguf!r}")

    def run(ids, n):
        mine.send((list(ids), n))
        result = mine.recv()
        time.sleep(0.5)  # let its threads go idle before we time anything
        return result

    run.close = lambda: (mine.send(None), child.join(30))
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.cpu_forward")
    ap.add_argument("--target", required=True, help="model directory (HF layout, fp32)")
    ap.add_argument("--gguf", help="F32 GGUF of the same weights, for llama.cpp")
    ap.add_argument("--quantize-from", help="write --gguf from this GGUF first")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--sizes", default="1,2,5,9,17",
                    help="forward sizes T to time (comma-separated; 1 is always included)")
    a = ap.parse_args(argv)
    try:
        sizes = sorted({1, *(int(x) for x in a.sizes.split(","))})
    except ValueError:
        raise SystemExit(f"--sizes must be comma-separated integers, got {a.sizes!r}") from None
    for name in ("max_new_tokens", "reps", "threads"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if min(sizes) < 1:
        raise SystemExit(f"--sizes must be >= 1, got {a.sizes!r}")

    import ouroboros_jax as oj
    from ouroboros_jax.models import layout
    from ouroboros_jax.models.timing import forward_timer

    model = oj.load_model(a.target)
    vocab = model.config.vocab_size
    ids = (list(model.tokenizer(PROMPT)["input_ids"]) if model.tokenizer
           else [3 + i % max(vocab - 3, 1) for i in range(96)])  # no tokenizer: in-vocab ids
    n = a.max_new_tokens
    weight_bytes = layout.weight_bytes(model.params)
    timers = {T: forward_timer(model, T, len(ids), 1024) for T in sizes}
    default_layout = "packed" if layout.wants_packing(model.params) else "stacked"
    layout.set_packing(False)  # the canonical stacked layout beside it, for the A/B
    stacked_timers = {T: forward_timer(model, T, len(ids), 1024) for T in sizes}
    layout.set_packing(None)

    def ours(tokens, stacked=False):
        layout.set_packing(False if stacked else None)
        try:
            o = oj.generate(model, [ids], max_new_tokens=tokens, eos_token_id=-1)
        finally:
            layout.set_packing(None)
        return o.tokens[0], o.stats["seconds"]

    for stacked in (False, True):  # compile both lengths in both layouts
        ours(n, stacked), ours(1, stacked)
    lcpp = None
    if a.gguf:
        if a.quantize_from and not os.path.exists(a.gguf):
            quantize_f32(a.quantize_from, a.gguf)
        lcpp = llama_cpp_runner(a.gguf, a.threads)
    rows = {"bandwidth_bytes_per_s": [], "vanilla_call_s_per_token": [],
            "vanilla_decode_s_per_token": [], "stacked_vanilla_call_s_per_token": [],
            "stacked_vanilla_decode_s_per_token": [], "llama_cpp_call_s_per_token": [],
            "llama_cpp_decode_s_per_token": [], **{f"forward_s_T{T}": [] for T in sizes},
            **{f"stacked_forward_s_T{T}": [] for T in sizes}}
    mine = theirs = None
    for _ in range(a.reps):
        rows["bandwidth_bytes_per_s"].append(memory_read_rate())
        for T in sizes:
            rows[f"forward_s_T{T}"].append(min(timers[T]() for _ in range(3)))
            rows[f"stacked_forward_s_T{T}"].append(min(stacked_timers[T]() for _ in range(3)))
        for pre, stacked in (("", False), ("stacked_", True)):
            # decode-only = the n-token call less the 1-token call (prefill, dispatch, fetch),
            # each the best of a few: one noisy call must not outweigh n - 1 decode steps
            out, whole = min((ours(n, stacked) for _ in range(2)), key=lambda r: r[1])
            one = min(ours(1, stacked)[1] for _ in range(3))
            rows[pre + "vanilla_call_s_per_token"].append(whole / len(out))
            rows[pre + "vanilla_decode_s_per_token"].append(
                (whole - one) / max(len(out) - 1, 1))
            if not stacked:
                mine = out
            elif out != mine:
                raise RuntimeError("the stacked and packed layouts gave different tokens")
        if lcpp is not None:
            theirs, call, decode = lcpp(ids, n)
            rows["llama_cpp_call_s_per_token"].append(call / len(theirs))
            rows["llama_cpp_decode_s_per_token"].append(decode)
    med = {k: float(np.median(v)) if v else None for k, v in rows.items()}
    res = {"command": "python -m experiments.cpu_forward " + " ".join(
        sys.argv[1:] if argv is None else argv),
        "weight_bytes": int(weight_bytes), "prompt_tokens": len(ids), "new_tokens": n,
        "median": med, "spread": {k: [round(min(v), 5), round(max(v), 5)] for k, v in
                                  rows.items() if v},
        "bandwidth_bound_s": weight_bytes / med["bandwidth_bytes_per_s"],
        "forward_vs_T1": {T: round(med[f"forward_s_T{T}"] / med["forward_s_T1"], 3)
                          for T in sizes},
        "layout": default_layout,
        # the default layout's speed over the stacked one's, per repeat (1.0 when the default
        # is stacked): whole call, and each forward size
        "layout_speedup_call_per_rep": [
            round(x / y, 3) for x, y in zip(rows["stacked_vanilla_call_s_per_token"],
                                            rows["vanilla_call_s_per_token"])],
        "layout_speedup_forward": {T: round(med[f"stacked_forward_s_T{T}"]
                                            / med[f"forward_s_T{T}"], 3) for T in sizes},
        "llama_cpp": "not installed or no --gguf" if lcpp is None else "ran"}
    if lcpp is not None:
        for how in ("call", "decode"):
            per_rep = [t / v for t, v in zip(rows[f"llama_cpp_{how}_s_per_token"],
                                             rows[f"vanilla_{how}_s_per_token"])]
            res[f"vanilla_speed_vs_llama_cpp_{how}"] = float(np.median(per_rep))
            res[f"vanilla_speed_vs_llama_cpp_{how}_per_rep"] = [round(x, 3) for x in per_rep]
        res["tokens_identical"] = mine == theirs
        res["first_divergence"] = next((i for i, (x, y) in enumerate(zip(mine, theirs))
                                        if x != y), None)
        lcpp.close()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
