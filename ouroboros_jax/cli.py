"""The `ouroboros-jax` command: generate, serve, demo, memory, bench, tune, distill. Each
command's flags are checked here, by name, before anything loads, then run; the flags
themselves (help, defaults) are declared in cli_flags.py."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

from . import compile_cache


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


def _config_fields(text) -> Optional[dict]:
    """--config JSON -> its fields (None when not given); checked before any load."""
    if not text:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--config must be a JSON object of config fields, got {text!r}")
    return fields


def _response_format(text) -> Any:
    """--response-format JSON (or @FILE) -> the format, checked (schema, keywords, pattern)
    before any load, its errors naming the flag; None when not given."""
    if not text:
        return None
    from .constrain.formats import regex_for

    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--response-format: cannot read {text[1:]!r} ({e})") from None
    try:
        fmt = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--response-format is not valid JSON: {e}") from None
    regex_for(fmt, field="--response-format")
    return fmt


def _method_config(method: str, fields: Optional[dict]):
    """The method's config object from --config's fields ("auto" when not given)."""
    if fields is None:
        return "auto"
    from .decoding import METHODS

    if method not in METHODS:
        raise ValueError(f"--method must be one of {sorted(METHODS)}, got {method!r}")
    try:
        return METHODS[method].config_type(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--config for --method {method}: {e}") from None


def _check_draft_flag(a, method: str) -> None:
    """A method that needs a draft, with --model but no --draft, refused before any load (the
    demo pair, without --model, brings its draft)."""
    from .decoding import METHODS

    if a.model and not a.draft and METHODS[method].needs_draft:
        raise ValueError(f"--method {method} needs --draft (a draft model with the target's "
                         "tokenizer)")


def _compile_clock():
    """A function giving the seconds JAX has spent tracing, lowering and compiling since this
    call (the events the bench subtracts, `bench.runner.CompileClock`)."""
    from .bench.runner import CompileClock

    clock = CompileClock.get()
    clock.take()
    return clock.take


def _note_cut(out, eos, max_new_tokens: int) -> None:
    """Says on stderr which generations --max-new-tokens cut (full length, no EOS last)."""
    stops = set(() if eos is None else [eos] if isinstance(eos, int) else eos)
    cut = [i for i, t in enumerate(out.tokens)
           if len(t) >= max_new_tokens and (not t or t[-1] not in stops)]
    for i in cut:
        which = f"prompt {i + 1}: " if len(out.tokens) > 1 else ""
        print(f"ouroboros-jax generate: {which}stopped at --max-new-tokens {max_new_tokens}; "
              "pass a larger value for more", file=sys.stderr)


def _print_stats(stats: dict, compile_s: float) -> None:
    """--stats: compile time and decode speed apart, then every stat as JSON, on stderr."""
    run_s = stats["seconds"] - compile_s
    stats["compile_seconds"] = compile_s
    if run_s < 0.02 * stats["seconds"]:
        # the compile clock counts the backend's seconds on every thread (a background compile
        # overlaps the call): no honest decode-only rate is left to print
        stats["decode_tokens_per_second"] = None
        rate = "compiles overlapped the call (some in the background)"
    else:
        stats["decode_tokens_per_second"] = stats["new_tokens"] / run_s
        rate = f"decoding {stats['decode_tokens_per_second']:.1f} tokens/s ({run_s:.2f} s)"
    print(f"ouroboros-jax generate: {stats['new_tokens']} tokens; compiling {compile_s:.2f} s, "
          f"{rate}; {stats['tokens_per_second']:.1f} tokens/s with compiling", file=sys.stderr)
    print(json.dumps(stats, indent=2), file=sys.stderr)


def _cmd_generate(a):
    from . import generate, load_model
    from .models.loading import load_both
    from .models.quant import quantize_model
    from .request import default_eos_ids

    # every flag checked before anything loads
    prompts = _generate_prompts(a)
    compile_cache.enable(a.compile_cache)
    _positive("--max-new-tokens", a.max_new_tokens)
    method = _method(a)
    _check_draft_flag(a, method)
    config = _method_config(method, _config_fields(a.config))
    shape = _parse_mesh(a.mesh) if a.mesh else None
    q = getattr(a, "quantize", None)
    response_format = _response_format(a.response_format)
    wc = _weights_cache(a)
    _check_paths(a)
    dq = _draft_scheme(a)
    if a.model:  # both at once (`load_both`): a load leaves a core idle half the time
        target, draft = load_both(
            lambda: load_model(a.model, dtype=a.dtype, quantize=q, weights_cache=wc),
            (lambda: load_model(a.draft, dtype=a.dtype, quantize=dq, weights_cache=wc))
            if a.draft else None)
    else:  # the shipped pair, as `demo` uses it
        from .demo_assets import demo_pair

        target, draft = demo_pair(a.dtype)
        target = quantize_model(target, q)
        draft = quantize_model(draft, _draft_scheme(a, draft))
        if a.draft:
            draft = load_model(a.draft, dtype=a.dtype, quantize=dq, weights_cache=wc)
    mesh = None
    if shape:
        from .sharding import make_mesh

        mesh = make_mesh(*shape)
    compiled = _compile_clock()
    out = generate(target, prompts, draft=draft, method=method, config=config,
                   max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                   top_k=a.top_k, seed=a.seed, mesh=mesh, response_format=response_format)
    compile_s = compiled()
    for i, toks in enumerate(out.tokens):
        print(out.texts[i] if out.texts else toks)
    _note_cut(out, default_eos_ids(target), a.max_new_tokens)
    if a.stats:
        _print_stats(out.stats, compile_s)
    if wc is not None:  # the next process maps the whole entry: this one finishes writing it
        from .models import weights_cache

        sys.stdout.flush()
        weights_cache.flush()


def _check_paths(a) -> None:
    """--model and --draft exist, checked before anything slow (the draft's scheme may build
    the few-row kernel, ~5 s on a fresh machine): a mistyped path is answered at once."""
    for flag, path in (("--model", a.model), ("--draft", a.draft)):
        if path and not os.path.exists(path):
            raise FileNotFoundError(f"{flag}: {path!r} does not exist")


def _draft_scheme(a, model=None) -> Optional[str]:
    """The draft's quantize= from --draft-quantize and --quantize (`quant.draft_scheme`;
    model: the draft when it is already loaded, the demo pair's)."""
    from .models.quant import draft_scheme

    return draft_scheme(getattr(a, "draft_quantize", "off"), getattr(a, "quantize", None),
                        a.dtype, model)


def _weights_cache(a) -> Optional[str]:
    """--weights-cache resolved (`models.weights_cache.resolve`): a directory, or None (off);
    checked before anything loads."""
    from .models import weights_cache

    path = weights_cache.resolve(getattr(a, "weights_cache", None))
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--weights-cache: {path!r} is not a directory; pass a directory or "
                         "--weights-cache off")
    return path


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
    from .models.loading import load_both

    _check_paths(a)
    q = getattr(a, "quantize", None)
    dq = _draft_scheme(a) if mesh is None else q  # the kernel runs on one device only
    wc = _weights_cache(a)

    def one(path, scheme):
        if mesh is not None and os.path.isdir(path) and scheme is None:
            from .sharding import load_sharded

            return load_sharded(path, mesh, dtype=a.dtype)
        # quantized: placed by the engine
        return load_model(path, dtype=a.dtype, quantize=scheme, weights_cache=wc)

    if a.model and mesh is None:  # both at once, as `generate` loads them
        target, draft = load_both(lambda: one(a.model, q),
                                  (lambda: one(a.draft, dq)) if a.draft else None)
    elif a.model:  # a mesh's processes read their slices in one order
        target = one(a.model, q)
        draft = one(a.draft, dq) if a.draft else None
    else:  # the shipped demo pair
        from .demo_assets import demo_pair

        from .models.quant import quantize_model

        target, draft = demo_pair(a.dtype)
        target = quantize_model(target, q)
        draft = quantize_model(draft, _draft_scheme(a, draft) if mesh is None else q)
        if a.draft:
            draft = one(a.draft, dq)
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


def _method(a) -> str:
    """--method, else ouroboros with a draft (--draft, or the demo pair's), else vanilla
    (`request.default_method`)."""
    from .request import default_method

    return default_method(a.method, has_draft=bool(a.draft) or not a.model)


def _serve_plan(a, target, draft, spec, config):
    """serve's slots and cache (`serving.sizing.plan_cache`) from --slots, --memory-fraction,
    --max-model-len and --max-cache-len; the margin is the given config's, else the method's
    default config's (auto's choice may round the cache up: the startup line says the real
    size)."""
    from .serving.sizing import plan_cache

    cfg = config if not isinstance(config, str) else (
        spec.default_config() if spec.knobs is not None else None)
    return plan_cache(target, draft if spec.needs_draft else None, slots=a.slots,
                      memory_fraction=a.memory_fraction, max_model_len=a.max_model_len,
                      max_cache_len=a.max_cache_len, margin=spec.margin(cfg))


def _say(msg: str, end: str = "\n") -> None:
    print(f"ouroboros-jax serve: {msg}" if msg else "", end=end, file=sys.stderr, flush=True)


def _progress(name: str, seconds: Optional[float]) -> None:
    """Engine.warmup's progress: "compiling NAME ... 3.1 s", one line per program."""
    if seconds is None:
        _say(f"compiling {name} ...", end=" ")
    else:
        print(f"{seconds:.1f} s", file=sys.stderr, flush=True)


def _served_name(a) -> str:
    if a.served_model_name:
        return a.served_model_name
    if a.model:  # the directory's or file's name, as clients would type it
        name = os.path.basename(os.path.normpath(a.model))
        return name[:-len(".gguf")] if name.endswith(".gguf") else name
    return "ouroboros-demo"


def _cmd_serve(a):
    import dataclasses
    import time

    from .request import resolve_method

    # every flag checked before anything starts or loads
    _positive("--slots", a.slots)
    _positive("--max-queue", a.max_queue)
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    gate = _serve_gate(a)
    from .serving.sizing import check_flags

    check_flags(a.memory_fraction, a.max_model_len, a.max_cache_len)
    compile_cache.enable(a.compile_cache)
    method = _method(a)
    _check_draft_flag(a, method)
    config = _method_config(method, _config_fields(a.config))
    spec = resolve_method(method)
    if a.mesh:
        _parse_mesh(a.mesh)  # its form checked before anything starts
    procs = _processes(a)
    if procs is not None:  # before any other JAX call
        from .distributed import initialize

        initialize(*procs)
    multi = procs is not None and procs[1] > 1
    mesh = _serve_mesh(a, multi)
    target, draft = _serve_models(a, mesh)
    plan = _serve_plan(a, target, draft, spec, config)
    from .liveness import ProcessLost
    from .serving.engine import Engine

    t0 = time.perf_counter()
    auto = isinstance(config, str) and spec.knobs is not None
    _say(f"building the engine ({method}{', auto probing each load level' if auto else ''})"
         " ...", end=" ")
    # every process builds the same engine (auto's probes and the state are collective)
    engine = Engine(target, draft, method=method, config=config, slots=plan.slots,
                    max_cache_len=plan.max_model_len, max_queue=a.max_queue, mesh=mesh)
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    _say(dataclasses.replace(plan, cache_tokens=engine.cache_slots).describe())
    if multi and procs[2] != 0:
        _say(f"process {procs[2]} of {procs[1]} follows process 0")
        try:
            n = engine.follow()
        except ProcessLost as e:  # the leader (or a peer) died: said by name, exit non-zero
            raise SystemExit(f"ouroboros-jax serve: error: {e}") from None
        _say(f"process {procs[2]}: process 0 stopped after {n} device calls")
        return
    _serve_http(a, engine, procs if multi else None, gate)


def _serve_http(a, engine, procs, gate: dict) -> None:
    """Process 0's part: the programs compiled (with progress), then HTTP until Ctrl-C."""
    from .heap import freeze_heap
    from .serving.server import create_app, serve
    from .serving.warmup import default_widths

    name = _served_name(a)
    app = create_app(engine, model_names=[name], **gate)
    try:
        if hasattr(engine, "warmup"):  # compile now, not on the first requests
            engine.warmup(default_widths(engine.limit), progress=_progress)
        freeze_heap()  # full GC passes skip the models and programs from now on (heap.py)
        where = f", {procs[1]} processes" if procs else ""
        _say(f"{name} ({engine.method}, {engine.slots} slots{where}) on "
             f"http://{a.host}:{a.port}/v1")
        # a dead process (or a failed collective) stops the engine for good: stop serving
        serve(app, a.host, a.port, drain_timeout=a.drain_timeout,
              stop_when=lambda: getattr(engine, "fault", None) is not None)
    finally:  # the followers return even when serving never started (a port in use)
        engine.stop(cancel=True, timeout=a.drain_timeout)
    fault = getattr(engine, "fault", None)
    if fault is not None:  # exit non-zero, naming the process that died
        raise SystemExit(f"ouroboros-jax serve: error: the engine stopped: {fault}")


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


def _model_config(path: str):
    """A model's config from its directory's config.json or its GGUF metadata: no weights
    are read."""
    from .models.gguf import is_gguf_path

    if is_gguf_path(path):
        from .models.gguf import config_from_gguf, open_gguf

        return config_from_gguf(open_gguf(path), path)
    from .models.loading import read_config

    return read_config(path)


def _memory_rows(a) -> list:
    """[(name, config)] `memory` plans: --model and --draft, else --preset (default: all)."""
    from .models.presets import PRESETS

    if a.model or a.draft:
        if a.preset:
            raise ValueError("--preset and --model/--draft each choose what to plan; give one")
        return [(os.path.basename(os.path.normpath(p)), _model_config(p))
                for p in (a.model, a.draft) if p]
    for n in a.preset or []:
        if n not in PRESETS:
            raise ValueError(f"--preset: unknown preset {n!r}; choose from {sorted(PRESETS)}")
    return [(n, PRESETS[n]) for n in a.preset or PRESETS]


def _cmd_memory(a):
    from .sharding import memory_plan

    data, model = _parse_mesh(a.mesh)
    _positive("--batch", a.batch)
    _positive("--cache-len", a.cache_len)
    if getattr(a, "quantize", None):
        return _print_weights_plan(a)
    _positive("--hosts", a.hosts)
    if (data * model) % a.hosts:
        raise ValueError(f"--hosts {a.hosts} must divide the mesh's {data * model} devices")
    rows = _memory_rows(a)
    gib = 2 ** 30
    width = max(14, 2 + max(len(n) for n, _ in rows))
    print(f"mesh data={data} x model={model} over {a.hosts} host(s) of "
          f"{data * model // a.hosts} devices, batch {a.batch}, cache {a.cache_len} tokens, "
          f"{a.dtype}")
    print(f"{'model':<{width}}{'params':>10}{'params/dev':>14}{'kv cache/dev':>15}"
          f"{'total/dev':>12}{'total/host':>13}")
    for n, config in rows:
        p = memory_plan(config, data, model, a.batch, a.cache_len, a.dtype, a.hosts)
        print(f"{n:<{width}}{p['num_params'] / 1e9:>9.1f}B"
              f"{p['params_per_device_bytes'] / gib:>11.2f}GiB"
              f"{p['kv_cache_per_device_bytes'] / gib:>12.2f}GiB"
              f"{p['total_per_device_bytes'] / gib:>9.2f}GiB"
              f"{p['total_per_host_bytes'] / gib:>10.2f}GiB")
        if config.is_moe:  # every expert is held; a token reads experts_per_token of them
            print(f"{'':<{width}}experts {p['expert_bytes'] / gib:.2f}GiB of the params "
                  f"({config.num_experts} per layer, top {config.experts_per_token}); "
                  f"active per token {p['active_params'] / 1e9:.2f}B params "
                  f"({p['active_bytes'] / gib:.2f}GiB)")
    if a.model or a.draft:
        _print_footprint(a, rows)


def _memory_draft_scheme(a) -> Optional[str]:
    """The draft's quantize= that generate would use on this machine with the same
    --draft-quantize and --dtype (`quant.draft_scheme`)."""
    from .models.quant import draft_scheme

    return draft_scheme(a.draft_quantize, None, a.dtype)


def _code_bytes(scheme: str) -> float:
    """Bytes a code takes in this process: one wherever the few-row kernel runs (it reads int8
    codes, 4-bit ones widened), else the scheme's bits / 8."""
    from .models import few_rows
    from .models.quant import bits_of

    return 1.0 if few_rows.enabled() else bits_of(scheme) / 8


def _print_footprint(a, rows) -> None:
    """`memory --model/--draft`: the pair on one device, per model and layout, and the peak a
    process holding it should stay under (`footprint`)."""
    from .footprint import PEAK_FACTOR, footprint, peak_bound

    item = 4 if a.dtype == "float32" else 2
    codes = [0.0] * len(rows)
    if a.draft:  # the draft as generate and serve load it here (--draft-quantize)
        scheme = _memory_draft_scheme(a)
        if scheme is not None:
            codes[-1] = _code_bytes(scheme)
            rows = rows[:-1] + [(f"{rows[-1][0]} ({scheme})", rows[-1][1])]
    fps = [footprint(n, c, item, a.batch, a.cache_len, b) for (n, c), b in zip(rows, codes)]
    gb = 1e9
    width = max(14, 2 + max(len(f.name) for f in fps))
    print(f"\none device, {a.dtype}, batch {a.batch}, cache {a.cache_len} tokens (GB = 1e9 "
          "bytes): the packed layout decoding runs on is views of the weights on a CPU (no "
          "bytes), a copy on a GPU with room for it")
    print(f"{'model':<{width}}{'weights':>10}{'packed CPU':>12}{'packed GPU':>12}"
          f"{'kv cache':>10}{'CPU total':>11}{'GPU total':>11}")
    for f in fps + ([] if len(fps) < 2 else [None]):
        name = "pair" if f is None else f.name
        get = (lambda k: sum(getattr(x, k) for x in fps)) if f is None else (
            lambda k: getattr(f, k))
        cpu = sum(x.total("cpu") for x in fps) if f is None else f.total("cpu")
        gpu = sum(x.total("gpu") for x in fps) if f is None else f.total("gpu")
        print(f"{name:<{width}}{get('weights') / gb:>8.2f}GB{get('packed_cpu') / gb:>10.2f}GB"
              f"{get('packed_gpu') / gb:>10.2f}GB{get('kv_cache') / gb:>8.2f}GB"
              f"{cpu / gb:>9.2f}GB{gpu / gb:>9.2f}GB")
    print(f"expected peak (resident set on a CPU, device memory on a GPU): at most "
          f"{PEAK_FACTOR} x total = {peak_bound(fps, 'cpu') / gb:.2f}GB on a CPU, "
          f"{peak_bound(fps, 'gpu') / gb:.2f}GB on a GPU")


def _print_weights_plan(a):
    """`memory --quantize`: the target(s) and draft in bf16 and the asked widths on 1/2/4/8
    devices (`weights_plan.py`)."""
    from .models.presets import PRESETS
    from .weights_plan import DEFAULT_DRAFT, DEFAULT_TARGETS, format_plan, plan

    if a.model:
        targets = [(os.path.basename(os.path.normpath(a.model)), _model_config(a.model))]
    else:
        for n in a.preset or []:
            if n not in PRESETS:
                raise ValueError(f"--preset: unknown preset {n!r}; choose from "
                                 f"{sorted(PRESETS)}")
        targets = [(n, PRESETS[n]) for n in a.preset or DEFAULT_TARGETS]
    draft = ((os.path.basename(os.path.normpath(a.draft)), _model_config(a.draft)) if a.draft
             else (DEFAULT_DRAFT, PRESETS[DEFAULT_DRAFT]))
    print(format_plan(plan(targets, draft, a.quantize, a.batch, a.cache_len, a.dtype),
                      a.batch, a.cache_len))


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
    from .cli_flags import build_parser

    ap = build_parser({"generate": _cmd_generate, "serve": _cmd_serve, "demo": _cmd_demo,
                       "memory": _cmd_memory, "bench": _cmd_bench, "tune": _cmd_tune})
    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"ouroboros-jax {a.cmd}: error: {e}")


if __name__ == "__main__":
    main()
