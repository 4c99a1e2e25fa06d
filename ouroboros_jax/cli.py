"""The `ouroboros-jax` command: generate, serve, demo, memory, bench, tune, distill."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional


def _generate_prompts(a) -> list:
    """--prompt texts and --chat messages (each one conversation, after --system if given)."""
    prompts = list(a.prompt or [])
    for text in a.chat or []:
        chat = [{"role": "system", "content": a.system}] if a.system else []
        prompts.append(chat + [{"role": "user", "content": text}])
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --chat MESSAGE")
    if a.system and not a.chat:
        raise ValueError("--system applies to --chat messages; give --chat MESSAGE too")
    return prompts


def _cmd_generate(a):
    from . import generate, load_model

    prompts = _generate_prompts(a)
    if a.target:
        target = load_model(a.target, dtype=a.dtype)
        draft = load_model(a.draft, dtype=a.dtype) if a.draft else None
    else:  # the shipped pair, as `demo` uses it
        from .demo_assets import demo_pair

        target, draft = demo_pair(a.dtype)
        if a.draft:
            draft = load_model(a.draft, dtype=a.dtype)
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
    out = generate(target, prompts, draft=draft, method=a.method, config=config,
                   max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                   top_k=a.top_k, seed=a.seed, mesh=mesh)
    for i, toks in enumerate(out.tokens):
        print(out.texts[i] if out.texts else toks)
    if a.stats:
        print(json.dumps(out.stats, indent=2), file=sys.stderr)


def _serve_fields(text) -> Optional[dict]:
    """--config JSON of `serve` -> its fields (None when not given); checked before any load."""
    if not text:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--config must be a JSON object of config fields, got {text!r}")
    return fields


def _serve_config(method: str, fields: Optional[dict]):
    """The method's config object from --config's fields ("auto" when not given)."""
    if fields is None:
        return "auto"
    from .decoding import METHODS

    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    try:
        return METHODS[method].config_type(**fields)
    except TypeError as e:
        raise ValueError(f"--config for method {method!r}: {e}") from None


def _processes(a) -> Optional[tuple]:
    """--coordinator, --num-processes, --process-id -> (address, n, i), None when none is
    given; checked by flag name before anything starts."""
    given = [a.coordinator is not None, a.num_processes is not None, a.process_id is not None]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together (every "
                         "process of a multi-process run gets all three)")
    host, _, port = a.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"--coordinator must be HOST:PORT of process 0, e.g. 10.0.0.1:1234; "
                         f"got {a.coordinator!r}")
    _positive("--num-processes", a.num_processes)
    if not 0 <= a.process_id < a.num_processes:
        raise ValueError(f"--process-id must be in [0, {a.num_processes}) (--num-processes "
                         f"{a.num_processes}), got {a.process_id}")
    return a.coordinator, a.num_processes, a.process_id


def _serve_mesh(a, multi: bool):
    """The mesh of --mesh DATAxMODEL; over processes without --mesh, data = processes x model
    = local devices (tensor parallel inside a host). None on one process without --mesh."""
    if not a.mesh and not multi:
        return None
    import jax

    from .sharding import make_mesh

    if a.mesh:
        data, model = _parse_mesh(a.mesh)
    else:
        data, model = jax.process_count(), jax.local_device_count()
    try:
        return make_mesh(data, model)
    except ValueError as e:
        raise ValueError(f"--mesh: {e}") from None


def _serve_models(a, mesh):
    """(target, draft) of --model/--draft (default: the demo pair). On a mesh, safetensors
    directories are read slice-wise (`load_sharded`: each process only its devices' slices);
    GGUF files and the demo pair are read whole, then placed by the engine."""
    from .models import load_model

    def one(path):
        if mesh is not None and os.path.isdir(path):
            from .sharding import load_sharded

            return load_sharded(path, mesh, dtype=a.dtype)
        return load_model(path, dtype=a.dtype)

    if a.model:
        target = one(a.model)
        draft = one(a.draft) if a.draft else None
    else:  # the shipped demo pair
        from .demo_assets import demo_pair

        target, draft = demo_pair(a.dtype)
        if a.draft:
            draft = one(a.draft)
    return target, draft


def _serve_gate(a) -> dict:
    """serve's limit and access flags -> create_app's keyword arguments (serving/guard.py),
    checked by flag before anything loads."""
    _positive("--max-body-bytes", a.max_body_bytes)
    if not 0 < a.body_timeout < float("inf"):
        raise ValueError(f"--body-timeout must be a number of seconds > 0, got {a.body_timeout}")
    if a.api_key is not None and not a.api_key.strip():
        raise ValueError("--api-key must not be empty")
    # an empty variable counts as unset, as shells leave them
    key = a.api_key if a.api_key is not None else os.environ.get("OUROBOROS_JAX_API_KEY")

    def names(flag, v):
        out = [x.strip() for x in (v or "").split(",") if x.strip()]
        if v is not None and not out:
            raise ValueError(f"{flag} must name at least one, comma-separated, got {v!r}")
        return out

    return dict(max_body_bytes=a.max_body_bytes, body_timeout=a.body_timeout,
                api_key=(key or "").strip() or None, docs=a.docs,
                allowed_hosts=names("--allowed-hosts", a.allowed_hosts),
                allowed_origins=names("--allowed-origins", a.allowed_origins))


def _add_serve_gate_args(s) -> None:
    """serve's limit and access flags (`_serve_gate` reads them; serving/guard.py enforces)."""
    s.add_argument("--max-body-bytes", type=int, default=8 * 2 ** 20,
                   help="largest request body; larger ones get HTTP 413 (default: %(default)s)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; slower ones get HTTP 408 "
                        "(default: %(default)s)")
    s.add_argument("--api-key", default=None,
                   help="key every /v1/ request must send as 'Authorization: Bearer KEY', else "
                        "HTTP 401 (default: $OUROBOROS_JAX_API_KEY, else none)")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names served besides the bound address (and "
                        "localhost when bound to loopback); '*' for any (default: none)")
    s.add_argument("--allowed-origins", default=None,
                   help="comma-separated browser origins allowed, with CORS headers for them; "
                        "'*' for any (default: none: cross-origin requests get HTTP 403)")
    s.add_argument("--docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (default: off)")


def _cmd_serve(a):
    _positive("--slots", a.slots)
    _positive("--max-queue", a.max_queue)
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    gate = _serve_gate(a)
    fields = _serve_fields(a.config)
    if a.mesh:
        _parse_mesh(a.mesh)  # its form checked before anything starts
    procs = _processes(a)
    if procs is not None:  # before any other JAX call
        from .distributed import initialize

        initialize(*procs)
    multi = procs is not None and procs[1] > 1
    mesh = _serve_mesh(a, multi)
    target, draft = _serve_models(a, mesh)
    method = a.method or ("ouroboros" if draft is not None else "vanilla")
    config = _serve_config(method, fields)
    from .serving.engine import Engine

    # every process builds the same engine (auto's probes and the state are collective)
    engine = Engine(target, draft, method=method, config=config, slots=a.slots,
                    max_cache_len=a.max_cache_len, max_queue=a.max_queue, mesh=mesh)
    if multi and procs[2] != 0:
        print(f"ouroboros-jax serve: process {procs[2]} of {procs[1]} follows process 0",
              file=sys.stderr, flush=True)
        n = engine.follow()
        print(f"ouroboros-jax serve: process {procs[2]}: process 0 stopped after {n} device "
              "calls", file=sys.stderr, flush=True)
        return
    from .serving.server import create_app, serve

    if a.served_model_name:
        name = a.served_model_name
    elif a.model:  # the directory's or file's name, as clients would type it
        name = os.path.basename(os.path.normpath(a.model))
        name = name[:-len(".gguf")] if name.endswith(".gguf") else name
    else:
        name = "ouroboros-demo"
    app = create_app(engine, model_names=[name], **gate)
    try:
        if hasattr(engine, "warmup"):  # compile now, not on the first requests
            print("ouroboros-jax serve: compiling the engine's steps ...", file=sys.stderr,
                  flush=True)
            engine.warmup()
        where = f", {procs[1]} processes" if multi else ""
        print(f"ouroboros-jax serve: {name} ({method}, {a.slots} slots{where}) on "
              f"http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)
        serve(app, a.host, a.port, drain_timeout=a.drain_timeout)
    finally:  # the followers return even when serving never started (a port in use)
        engine.stop(cancel=True, timeout=a.drain_timeout)


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

    g = sub.add_parser("generate", help="generate text from a Hugging Face model directory or "
                                        "a GGUF file (default: the shipped demo pair)")
    g.add_argument("--target", help="target model: an HF directory or a .gguf file (default: "
                                    "the shipped demo target, with its draft)")
    g.add_argument("--draft", help="draft model directory or .gguf file (same tokenizer)")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--chat", action="append", help="a user message to an instruct model, "
                   "rendered with its chat template (repeatable: one conversation each)")
    g.add_argument("--system", help="a system message put before each --chat message")
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

    s = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching, "
                                     "one shared phrase pool); default: the demo pair")
    s.add_argument("--model", help="target: a Hugging Face directory or a .gguf file "
                                   "(default: the shipped demo pair)")
    s.add_argument("--draft", help="draft model (same tokenizer); default with the demo pair: "
                                   "its draft")
    s.add_argument("--method", default=None,
                   help="vanilla, speculative, lookahead, prompt_lookup or ouroboros "
                        "(default: ouroboros with a draft, else vanilla)")
    s.add_argument("--config", help="method config as JSON (default: auto, per load level)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                                                      "%(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument("--slots", type=int, default=8,
                   help="requests decoded together (default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot "
                   "before new ones get HTTP 429 (default: %(default)s)")
    s.add_argument("--max-cache-len", type=int, default=None,
                   help="longest prompt + max_tokens (default: the model's context)")
    s.add_argument("--served-model-name", help="the model name clients send (default: the "
                                               "model's directory or file name; "
                                               "ouroboros-demo for the demo pair)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish on Ctrl-C or SIGTERM before "
                        "they are cancelled (default: %(default)s)")
    _add_serve_gate_args(s)
    s.add_argument("--mesh", help="DATAxMODEL device mesh, e.g. 1x8 (default: none on one "
                                  "process; processes x local devices over several)")
    s.add_argument("--coordinator", help="multi-process: HOST:PORT of process 0, the same on "
                                         "every process (jax.distributed); process 0 serves "
                                         "HTTP, the others follow its steps")
    s.add_argument("--num-processes", type=int, help="multi-process: how many processes")
    s.add_argument("--process-id", type=int, help="multi-process: this process's index, 0 "
                                                  "to N-1")
    s.set_defaults(fn=_cmd_serve)

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
