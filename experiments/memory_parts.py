"""What does the resident set hold between loading a model and its first decode, part by part?
Result: printed (a table, one row per stage); the real pair's is in docs/real-models.md
("Memory").

One process, stage by stage: import, load each model (GGUF dequantized into fp32), the layout
decoding runs on (`layout.decode_params`: the packed layout on a CPU), the first `generate`
call (compile + decode), a second call (decode only). After each stage it reads
/proc/self/status: VmRSS (resident now), RssAnon (private pages), RssShmem (shared pages: the
loader's anonymous mappings, `gguf_read.aligned_empty`), RssFile (file pages: the GGUF's
mmap), VmHWM (the peak so far); and jax's live arrays (`jax.live_arrays()`: every buffer a
Python object still holds, the weights among them) with how many of their bytes are distinct
buffers (zero-copy views of the weights share their buffer's bytes). What the compiled program
holds that is no live array (its working memory, constants folded into it) is the rest.

    python -m experiments.memory_parts --model ~/.cache/ouroboros-real/qwen2.5-coder-0.5b-instruct-q4.gguf
    python -m experiments.memory_parts --model T.gguf --draft D.gguf --method ouroboros

--method vanilla (default) runs the target alone. The auto store and compile cache are the
caller's (OUROBOROS_JAX_CACHE, OUROBOROS_JAX_COMPILE_CACHE): point them at empty folders for a
first contact.
"""

from __future__ import annotations

import argparse
import os
import time

GB = 1e9
FIELDS = ("VmRSS", "RssAnon", "RssShmem", "RssFile", "VmHWM")


def proc_status() -> dict:
    """The FIELDS of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def live_bytes() -> tuple[int, int]:
    """(bytes of jax's live arrays, bytes of the distinct buffers under them): an array that is
    a zero-copy view of another's buffer counts once in the second figure. The distinct bytes
    are bounded from above: overlapping views are merged by their [start, end) ranges."""
    import jax

    total, spans = 0, []
    for a in jax.live_arrays():
        n = a.size * a.dtype.itemsize
        total += n
        try:
            start = a.unsafe_buffer_pointer()
            spans.append((start, start + n))
        except Exception:  # sharded or deleted: counted in full
            spans.append((id(a) << 20, (id(a) << 20) + n))
    distinct, end = 0, 0
    for lo, hi in sorted(spans):
        if hi > end:
            distinct += hi - max(lo, end)
            end = hi
    return total, distinct


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the target: a GGUF file or HF directory")
    p.add_argument("--draft", default=None, help="a draft model (for --method other than vanilla)")
    p.add_argument("--method", default="vanilla")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt", default="Write a Python function that returns the n-th "
                   "Fibonacci number iteratively, with a docstring.")
    a = p.parse_args(argv)

    rows = []

    def stage(name: str, t0: float) -> None:
        s = proc_status()
        total, distinct = live_bytes()
        rows.append((name, time.perf_counter() - t0, s, total, distinct))

    t = time.perf_counter()
    import jax  # noqa: F401

    import ouroboros_jax as oj
    from ouroboros_jax.models import layout
    stage("import", t)

    t = time.perf_counter()
    target = oj.load_model(a.model)
    stage("load target", t)
    draft = None
    if a.draft:
        t = time.perf_counter()
        draft = oj.load_model(a.draft)
        stage("load draft", t)
    weights = sum(layout.weight_bytes(m.params) for m in (target, draft) if m is not None)

    t = time.perf_counter()
    for m in (target, draft):
        if m is not None:
            jax.block_until_ready(layout.decode_params(m))
    stage("decode layout", t)

    chat = [{"role": "user", "content": a.prompt}]
    kw = {"draft": draft} if draft is not None and a.method != "vanilla" else {}
    stats = {}
    for name in ("first call", "second call"):
        t = time.perf_counter()
        out = oj.generate(target, [chat], method=a.method, max_new_tokens=a.max_new_tokens, **kw)
        stage(name, t)
        stats[name] = out.stats

    print(f"weights loaded: {weights / GB:.2f} GB ({a.model}"
          + (f" + {a.draft}" if a.draft else "") + f"), method {a.method}")
    print("| stage | s | RSS | anon | shmem | file | peak (HWM) | live arrays | distinct |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, secs, s, total, distinct in rows:
        print(f"| {name} | {secs:.1f} | " + " | ".join(f"{s.get(k, 0) / GB:.2f}" for k in FIELDS)
              + f" | {total / GB:.2f} | {distinct / GB:.2f} |")
    for name, st in stats.items():  # the first call's seconds include its compiles
        print(f"{name}: {st['new_tokens']} tokens in {st['seconds']:.1f} s "
              f"({st['tokens_per_second']:.2f} tokens/s)")


if __name__ == "__main__":
    main()
