"""The `ouroboros-jax` command: generate, demo, memory, bench, tune, distill."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_generate(a):
    from . import generate, load_model

    target = load_model(a.target, dtype=a.dtype)
    draft = load_model(a.draft, dtype=a.dtype) if a.draft else None
    mesh = None
    if a.mesh:
        from .sharding import make_mesh

        data, model = _parse_mesh(a.mesh)
        mesh = make_mesh(data, model)
    config = "auto"
    if a.config:
        from .decoding import METHODS

        if a.method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {a.method!r}")
        try:
            fields = json.loads(a.config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config is not valid JSON: {e}") from None
        try:
            config = METHODS[a.method].config_type(**fields)
        except TypeError as e:
            raise ValueError(f"--config for method {a.method!r}: {e}") from None
    out = generate(target, a.prompt, draft=draft, method=a.method, config=config,
                   max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                   top_k=a.top_k, seed=a.seed, mesh=mesh)
    for i, toks in enumerate(out.tokens):
        print(out.texts[i] if out.texts else toks)
    if a.stats:
        print(json.dumps(out.stats, indent=2), file=sys.stderr)


def _parse_mesh(s: str):
    try:
        data, model = (int(x) for x in s.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must look like DATAxMODEL, e.g. 1x8; got {s!r}") from None
    if data < 1 or model < 1:
        raise ValueError(f"--mesh sizes must be >= 1 (DATAxMODEL, e.g. 1x8); got {s!r}")
    return data, model


def _positive(name: str, v: int) -> None:
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


def _cmd_memory(a):
    from .models.presets import PRESETS
    from .sharding import memory_plan

    data, model = _parse_mesh(a.mesh)
    _positive("--batch", a.batch)
    _positive("--cache-len", a.cache_len)
    _positive("--hosts", a.hosts)
    if (data * model) % a.hosts:
        raise ValueError(f"--hosts {a.hosts} must divide the mesh's {data * model} devices")
    names = a.preset or list(PRESETS)
    gib = 2 ** 30
    print(f"mesh data={data} x model={model} over {a.hosts} host(s) of "
          f"{data * model // a.hosts} devices, batch {a.batch}, cache {a.cache_len} tokens, "
          f"{a.dtype}")
    print(f"{'model':<14}{'params':>10}{'params/dev':>14}{'kv cache/dev':>15}{'total/dev':>12}"
          f"{'total/host':>13}")
    for n in names:
        if n not in PRESETS:
            raise ValueError(f"unknown preset {n!r}; choose from {sorted(PRESETS)}")
        p = memory_plan(PRESETS[n], data, model, a.batch, a.cache_len, a.dtype, a.hosts)
        print(f"{n:<14}{p['num_params'] / 1e9:>9.1f}B{p['params_per_device_bytes'] / gib:>11.2f}"
              f"GiB{p['kv_cache_per_device_bytes'] / gib:>12.2f}GiB"
              f"{p['total_per_device_bytes'] / gib:>9.2f}GiB"
              f"{p['total_per_host_bytes'] / gib:>10.2f}GiB")


def _cmd_demo(a):
    from .demo import run_demo

    run_demo(num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens, method=a.method)


def _cmd_bench(a):
    from .bench.suite import bench_main

    bench_main(a)


def _cmd_tune(a):
    from .bench.tune import tune_main

    tune_main(a)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distill"]:  # its own parser (training/distill.py), so -h shows all its flags
        from .training.distill import main as distill_main

        distill_main(argv[1:])
        return
    ap = argparse.ArgumentParser(prog="ouroboros-jax",
                                 description="Ouroboros speculative decoding for JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a Hugging Face model directory")
    g.add_argument("--target", required=True, help="target model directory (HF layout)")
    g.add_argument("--draft", help="draft model directory (same tokenizer)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--method", default="vanilla")
    g.add_argument("--config", help='method config as JSON, e.g. \'{"gamma": 6, "window": 6}\' (default: auto)')
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--mesh", help="DATAxMODEL device mesh, e.g. 1x8")
    g.add_argument("--stats", action="store_true", help="print stats as JSON on stderr")
    g.set_defaults(fn=_cmd_generate)

    d = sub.add_parser("demo", help="the shipped pair: vanilla vs the fastest method")
    d.add_argument("--num-prompts", type=int, default=None)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--method", default=None)
    d.set_defaults(fn=_cmd_demo)

    m = sub.add_parser("memory", help="per-device and per-host bytes of params and KV "
                                       "cache on a mesh")
    m.add_argument("--preset", action="append", help="llama-2-70b, yi-34b, llama-3-8b, ...")
    m.add_argument("--mesh", default="1x8", help="DATAxMODEL, e.g. 1x8")
    m.add_argument("--batch", type=int, default=1)
    m.add_argument("--cache-len", type=int, default=4096)
    m.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    m.add_argument("--hosts", type=int, default=1,
                   help="hosts the mesh spans (equal device counts): adds per-host bytes")
    m.set_defaults(fn=_cmd_memory)

    from .bench.suite import add_bench_args
    from .bench.tune import add_tune_args

    b = sub.add_parser("bench", help="benchmark methods and transformers peers: JSON, "
                                     "markdown, plots")
    add_bench_args(b)
    b.set_defaults(fn=_cmd_bench)

    t = sub.add_parser("tune", help="the paper's Algorithm 1: pick gamma, then W/N, then K")
    add_tune_args(t)
    t.set_defaults(fn=_cmd_tune)

    sub.add_parser("distill", help="distil a draft model from a target: ouroboros-jax distill -h")

    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"ouroboros-jax {a.cmd}: error: {e}")


if __name__ == "__main__":
    main()
