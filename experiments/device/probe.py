"""What does the first accelerator at hand measure, in one run of a few minutes, with nothing
downloaded? Result: docs/bench/device-h200.md (raw: docs/bench/device-h200/). The device
script's work (experiments/device/run.sh).

    python -m experiments.device.probe --out $OUT            # Llama 3.1-8B / 3.2-1B
    python -m experiments.device.probe --tiny --out /tmp/x   # CI: tiny shapes, CPU

1. t(T): one bf16 forward of T = 1 ... 256 tokens at batch 1 after `--context` cached tokens,
   for the target (Llama-3.1-8B shape) and the draft (Llama-3.2-1B shape), random weights built
   on the device (`models.timing.forward_timer`, the timer the cost model and auto share), beside
   the roofline the projection assumes (bench/accelerator.py) when the device is a known one.
2. Per-round time of every method (vanilla, speculative, lookahead, prompt lookup, Ouroboros)
   at the paper's recipe (config=None) and at `config="auto"`'s choice: generate's seconds over
   target forwards, a fixed number of new tokens (EOS ignored). Random weights agree on
   nothing, so η is about 1 here: the round's cost is what is measured, not its yield.
3. Vanilla tokens/s against the HBM-bandwidth bound (weight bytes / bandwidth per token).
4. The shipped demo pair on the device (experiments/device/demo_pair.py): every method's greedy
   tokens against vanilla's in fp32 and bf16, and tokens/s and eta with a real draft's
   acceptance.
5. t(T) of further pairs' shapes (`--pairs`, default the real Qwen2.5-Coder 1.5B/0.5B pair),
   each written as a latency table of its own: `bench --latency-json latency-PAIR.json` prices
   that pair's counted CPU forwards with the device's measured latencies.
6. Quantized weights (`--quantize`, default int8,int4; experiments/device/quantized.py): t(T)
   for T = 1..64 and vanilla ms per token of the 8B shape in bf16, int8 and int4, every
   method's round on int8 8B/1B weights, the demo pair's exactness in int8, and the further
   pairs' t(T) in int8 and int4 (under "quantized" in device.json).

Stages run in the order 1, 3, 6, 4, 5, 2 (the per-round stage compiles the most and is the first
cut by the budget). Written under --out: device.json (everything, with a `latency` table in the cost model's
format: `ouroboros-jax bench --latency-json device.json` prices a CPU run's counted forwards
with it, replacing the roofline projection by the device's measured latencies) and
device.png (t(T)/t(1) per model, measured and roofline). Every stage is timed against
`--budget-s`; a stage that does not fit, or fails, is recorded as such and the rest still
runs, so one run always leaves a JSON behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

TINY_SIZES = (1, 4)
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
METHODS = ("vanilla", "speculative", "lookahead", "prompt_lookup", "ouroboros")


def tiny_configs():
    """(target, draft) ModelConfigs small enough for a CI run on a CPU: the same code path as
    the full shapes, nothing but the sizes changed."""
    from ouroboros_jax.models.config import ModelConfig

    t = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    d = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    return t, d


def full_configs():
    from ouroboros_jax.models.presets import PRESETS

    return PRESETS["llama-3.1-8b"], PRESETS["llama-3.2-1b"]


DEFAULT_PAIRS = "qwen2.5-coder-1.5b:qwen2.5-coder-0.5b"


def parse_pairs(text: str, tiny: bool) -> dict:
    """{name: (target ModelConfig, draft ModelConfig)} from "TARGET:DRAFT,..." preset names
    (models/presets.py); --tiny measures each pair at the tiny shapes (the same code path).
    Raises ValueError naming --pairs on an unknown preset or a malformed entry."""
    from ouroboros_jax.models.presets import PRESETS

    out = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        names = item.split(":")
        if len(names) != 2 or not all(names):
            raise ValueError(f"--pairs: expected TARGET:DRAFT, got {item!r}")
        bad = [n for n in names if n not in PRESETS]
        if bad:
            raise ValueError(f"--pairs: unknown preset {', '.join(bad)}; known: "
                             f"{', '.join(sorted(PRESETS))}")
        out[names[0]] = tiny_configs() if tiny else (PRESETS[names[0]], PRESETS[names[1]])
    return out


def random_model(config, dtype: str, seed: int):
    """A `Model` of random weights in `dtype`, built by one jitted call on the default device
    (an 8B model never exists on the host)."""
    import jax
    import jax.numpy as jnp

    from ouroboros_jax.models import Model
    from ouroboros_jax.models.llama import init_params

    params = jax.jit(lambda k: init_params(config, k, jnp.dtype(dtype)))(jax.random.key(seed))
    return Model(config=config, params=jax.block_until_ready(params))


def known_device():
    """The `bench/accelerator.py` entry of the default device, or None (a CPU, an unknown
    chip): matched on jax's device_kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite", ...)."""
    import jax

    from ouroboros_jax.bench.accelerator import ACCELERATORS

    kind = jax.devices()[0].device_kind.lower().replace(" ", "")
    names = {"v5e": ("v5lite", "v5e"), "v5p": ("v5p",), "a100": ("a100",), "h100": ("h100",),
             "h200": ("h200",)}
    for name, keys in names.items():
        if any(k in kind for k in keys):
            return ACCELERATORS[name]
    return None


def time_forwards(model, sizes, context: int, reps: int) -> dict:
    """{T: median seconds of one forward of T tokens after `context` cached tokens}."""
    import numpy as np

    from ouroboros_jax.bench.cost_model import forward_timer

    out = {}
    for n in sizes:
        timed = forward_timer(model, int(n), context)
        out[int(n)] = float(np.median([timed() for _ in range(reps)]))
    return out


def round_times(target, draft, prompt_len: int, new_tokens: int, methods, in_budget=None):
    """Per-round seconds of each method at the paper's recipe and at auto's choice: the second
    of two identical calls (the first compiles), seconds / target forwards. Yields one row per
    (method, config); in_budget() False: the rest are yielded as skipped."""
    import numpy as np

    from ouroboros_jax import generate
    from ouroboros_jax.decoding import METHODS as SPECS

    prompt = [list(np.random.default_rng(0).integers(1, target.config.vocab_size,
                                                     prompt_len))]
    for m in methods:
        d = draft if SPECS[m].needs_draft else None
        for label, config in (("paper", None), ("auto", "auto")):
            if m == "vanilla" and label == "auto":
                continue
            if in_budget is not None and not in_budget():
                yield {"method": m, "config": label, "skipped": "budget"}
                continue
            kw = dict(draft=d, method=m, config=config, max_new_tokens=new_tokens,
                      eos_token_id=-1)
            start = time.perf_counter()
            generate(target, prompt, **kw)  # compiles (auto: probes and chooses)
            first = time.perf_counter() - start
            out = generate(target, prompt, **kw)
            st = out.stats
            yield {"method": m, "config": label,
                   "chosen": (st.get("auto") or {}).get("config") if label == "auto"
                   else repr(SPECS[m].default_config()),
                   "auto": st.get("auto"), "first_call_seconds": first,
                   "seconds": st["seconds"],
                   "new_tokens": st["new_tokens"], "target_calls": st["target_calls"],
                   "draft_calls": st["draft_calls"], "eta": st["eta"],
                   "round_seconds": st["seconds"] / max(st["target_calls"], 1),
                   "tokens_per_second": st["tokens_per_second"]}


def bandwidth_bound(model, acc) -> dict:
    """Vanilla's ceiling on `acc`: tokens/s if every token read the weights once at peak HBM
    bandwidth (None on an unknown device)."""
    from ouroboros_jax.models.layout import weight_bytes

    w = weight_bytes(model.params)
    return {"weight_bytes": w,
            "hbm_gbps": None if acc is None else acc.hbm_gbps,
            "tokens_per_second_bound": None if acc is None else acc.hbm_gbps * 1e9 / w}


def software() -> dict:
    """Versions that decide what ran: jax and its backend, and the default matmul precision
    (on NVIDIA GPUs JAX's default lets fp32 dots use TF32)."""
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(),
            "default_matmul_precision": str(jax.config.jax_default_matmul_precision)}


def write_latency(path: str, target: dict, draft: dict, context: int, note: str) -> str:
    """One pair's t(T) as the cost model's latency table (`LatencyTable.from_json` reads it)."""
    with open(path, "w") as f:
        json.dump({"target": target, "draft": draft, "context": context, "note": note}, f,
                  indent=1)
    return path


def summary(result: dict) -> str:
    """A short text digest of device.json for the end of the log: t(T)/t(1) at a few T per
    model, the demo pair's rows, the per-round rows and vanilla against its bound."""
    get = lambda d, x: d.get(str(x), d.get(x))  # noqa: E731
    lines = []
    tables = [(f"{w} (main pair)", t) for w, t in result["t_of_T"].items()]
    for name, e in result.get("pairs", {}).items():
        tables += [(f"{w} ({name} pair)", e[w]) for w in ("target", "draft") if w in e]
    for label, t in tables:
        if not t:
            continue
        t1 = get(t, 1)
        cells = " ".join(f"T{n}={get(t, n) / t1:.2f}" for n in (2, 4, 8, 16, 32, 64, 128, 256)
                         if get(t, n) is not None)
        lines.append(f"t(T) {label}: t(1)={t1 * 1e3:.2f} ms; t(T)/t(1): {cells}")
    for r in result.get("demo_pair", []):
        if "skipped" in r:
            lines.append(f"demo {r['dtype']} {r['method']}@{r['config']}: skipped")
            continue
        lines.append(f"demo {r['dtype']} {r['method']}@{r['config']} (ran {r['ran']}): "
                     f"{r['tokens_per_second']:.1f} tok/s, eta {r['eta']:.2f}, identical "
                     f"{r['identical']}/{r['prompts']}, first call {r['first_call_seconds']:.1f}"
                     f" s, first difference {r['first_difference']}")
    for r in result.get("rounds", []):
        if "skipped" in r:
            lines.append(f"round {r['method']}@{r['config']}: skipped")
            continue
        lines.append(f"round {r['method']}@{r['config']}: {r['round_seconds'] * 1e3:.2f} ms/round,"
                     f" {r['tokens_per_second']:.1f} tok/s, first call "
                     f"{r['first_call_seconds']:.1f} s, chosen {r['chosen']}")
    b = result.get("vanilla_bound") or {}
    if b.get("tokens_per_second_bound"):
        lines.append(f"vanilla: {b.get('tokens_per_second_measured') or 0:.1f} tok/s measured, "
                     f"{b['tokens_per_second_at_t1']:.1f} at t(1), bound "
                     f"{b['tokens_per_second_bound']:.1f}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for who in ("target", "draft"):
        meas = result["t_of_T"].get(who) or {}
        if not meas:
            continue
        xs = sorted(int(k) for k in meas)
        t1 = meas[str(xs[0])] if str(xs[0]) in meas else meas[xs[0]]
        get = lambda d, x: d[str(x)] if str(x) in d else d[x]  # noqa: E731
        ax.plot(xs, [get(meas, x) / t1 for x in xs], "o-", label=f"{who} measured")
        roof = (result.get("roofline") or {}).get(who) or {}
        if roof:
            r1 = get(roof, xs[0])
            ax.plot(xs, [get(roof, x) / r1 for x in xs], "--", label=f"{who} roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (T)")
    ax.set_ylabel("t(T) / t(1)")
    ax.set_title(f"{result['device']['kind']}: forward time by input size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "device-out",
                    help="output directory (default $OUT, else ./device-out)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CI, any CPU)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=None,
                    help="cached tokens before each timed forward (default 512, --tiny 16)")
    ap.add_argument("--reps", type=int, default=None, help="timings per size (default 10)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="tokens per generate call (default 64, --tiny 4)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--pairs", default=DEFAULT_PAIRS,
                    help="further TARGET:DRAFT preset pairs whose t(T) is measured and written "
                         f"as latency-TARGET.json ('' for none; default {DEFAULT_PAIRS})")
    ap.add_argument("--demo-dtypes", default=None,
                    help="dtypes of the demo-pair stage ('' skips it; default "
                         "float32,bfloat16, --tiny float32)")
    ap.add_argument("--demo-prompts", type=int, default=None,
                    help="demo prompts per method (default 4, --tiny 1)")
    ap.add_argument("--demo-tokens", type=int, default=None,
                    help="new tokens per demo prompt (default 96, --tiny 8)")
    ap.add_argument("--matmul-precision", choices=["default", "high", "highest"], default=None,
                    help="jax_default_matmul_precision for the whole run (on a GPU, 'highest' "
                         "keeps float32 dots out of TF32; default: jax's)")
    ap.add_argument("--quantize", default="int8,int4",
                    help="weight formats of the quantized stage ('' skips it)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which remaining stages are skipped (recorded)")
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}")
    try:
        pairs = parse_pairs(a.pairs, a.tiny)
    except ValueError as e:
        ap.error(str(e))
    demo_dtypes = [d.strip() for d in (a.demo_dtypes if a.demo_dtypes is not None
                                       else "float32" if a.tiny else "float32,bfloat16"
                                       ).split(",") if d.strip()]
    bad = [x for x in a.quantize.split(",") if x.strip() and x.strip() not in ("int8", "int4")]
    if bad:
        ap.error(f"--quantize: unknown {', '.join(bad)}; choose from int8, int4")
    bad = [d for d in demo_dtypes if d not in ("float32", "bfloat16")]
    if bad:
        ap.error(f"--demo-dtypes: unknown {', '.join(bad)}; choose from float32, bfloat16")
    for name in ("context", "reps", "new_tokens", "demo_prompts", "demo_tokens"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    context = a.context or (16 if a.tiny else 512)
    reps = a.reps or (3 if a.tiny else 10)
    new_tokens = a.new_tokens or (4 if a.tiny else 64)
    demo_prompts = a.demo_prompts or (1 if a.tiny else 4)
    demo_tokens = a.demo_tokens or (8 if a.tiny else 96)
    sizes = TINY_SIZES if a.tiny else SIZES
    os.makedirs(a.out, exist_ok=True)

    import jax

    if a.matmul_precision is not None:
        jax.config.update("jax_default_matmul_precision", a.matmul_precision)
    from ouroboros_jax.bench.accelerator import forward_seconds

    t0 = time.perf_counter()
    tcfg, dcfg = tiny_configs() if a.tiny else full_configs()
    acc = known_device()
    dev = jax.devices()[0]
    result: dict = {"device": {"platform": dev.platform, "kind": dev.device_kind,
                               "count": jax.device_count(),
                               "projection_entry": None if acc is None else acc.name},
                    "settings": {"tiny": a.tiny, "dtype": a.dtype, "context": context,
                                 "reps": reps, "new_tokens": new_tokens, "sizes": list(sizes),
                                 "target": repr(tcfg), "draft": repr(dcfg),
                                 "pairs": sorted(pairs), "demo_dtypes": demo_dtypes,
                                 "demo_prompts": demo_prompts, "demo_tokens": demo_tokens},
                    "software": software(),
                    "t_of_T": {}, "roofline": {}, "rounds": [], "vanilla_bound": None,
                    "demo_pair": [], "pairs": {}, "stages": {}}
    json_path = os.path.join(a.out, "device.json")

    def save():
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    def stage(name, fn):
        """Runs fn() unless the budget is spent; records seconds, or the skip, or the error."""
        start = time.perf_counter()
        if start - t0 > a.budget_s:
            result["stages"][name] = {"status": "skipped: budget"}
        else:
            try:
                fn()
                result["stages"][name] = {"status": "ok",
                                          "seconds": time.perf_counter() - start}
            except Exception as e:  # recorded: the other stages still run
                result["stages"][name] = {"status": f"failed: {type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc(limit=8)}
        print(f"[device] {name}: {result['stages'][name]['status']} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        save()

    models = {}

    def build():
        models["target"] = random_model(tcfg, a.dtype, 0)
        models["draft"] = random_model(dcfg, a.dtype, 1)

    stage("build random models", build)
    for who, cfg in (("target", tcfg), ("draft", dcfg)):
        def forwards(who=who, cfg=cfg):
            result["t_of_T"][who] = time_forwards(models[who], sizes, context, reps)
            if acc is not None:
                result["roofline"][who] = {n: forward_seconds(acc, cfg, n, context)
                                           for n in sizes}
        stage(f"t(T) {who}", forwards)

    def vanilla_bound():
        b = bandwidth_bound(models["target"], acc)
        b["tokens_per_second_at_t1"] = 1.0 / result["t_of_T"]["target"][1]
        result["vanilla_bound"] = b

    stage("vanilla bandwidth bound", vanilla_bound)

    in_budget = lambda: time.perf_counter() - t0 < a.budget_s  # noqa: E731
    schemes = [x.strip() for x in a.quantize.split(",") if x.strip()]

    def quant():
        from experiments.device.quantized import SIZES as QS, TINY_SIZES as QT, quant_stage

        def keep(part):
            result["quantized"] = part
            save()

        # --tiny leaves the demo pair's int8 exactness to the CPU tests (tests/test_quant.py):
        # its compiles are most of the stage's time on a CPU
        keep(quant_stage(models, pairs, methods, QT if a.tiny else QS, context, reps,
                         new_tokens, demo_prompts, demo_tokens, in_budget, keep, schemes,
                         demo=not a.tiny))

    if schemes:
        stage("quantized weights", quant)

    def demo():
        from experiments.device.demo_pair import demo_rows

        for row in demo_rows(methods, demo_dtypes, demo_prompts, demo_tokens, in_budget):
            result["demo_pair"].append(row)
            save()

    if demo_dtypes:
        stage("demo pair: exactness and speed", demo)
    for name, (pt, pd) in pairs.items():
        def pair(name=name, pt=pt, pd=pd):
            entry = result["pairs"][name] = {"target": repr(pt), "draft": repr(pd)}
            for who, cfg, seed in (("target", pt, 2), ("draft", pd, 3)):
                model = random_model(cfg, a.dtype, seed)
                entry[who] = time_forwards(model, sizes, context, reps)
                del model
            entry["file"] = write_latency(os.path.join(a.out, f"latency-{name}.json"),
                                          entry["target"], entry["draft"], context,
                                          f"{name} shapes measured on {dev.device_kind} by "
                                          f"the device script, random {a.dtype} weights, "
                                          f"batch 1")
        stage(f"t(T) pair {name}", pair)

    def rounds():
        prompt_len = min(128, tcfg.max_position_embeddings // 4)
        for row in round_times(models["target"], models["draft"], prompt_len, new_tokens,
                               methods, in_budget):
            result["rounds"].append(row)
            save()
        van = [r for r in result["rounds"] if r["method"] == "vanilla"]
        if van and result["vanilla_bound"] is not None:
            result["vanilla_bound"]["tokens_per_second_measured"] = van[0]["tokens_per_second"]

    stage("per-round time of every method", rounds)
    if result["t_of_T"].get("target"):
        # the cost model's table format: `bench --latency-json device.json` reads it
        result["latency"] = {"target": result["t_of_T"]["target"],
                             "draft": result["t_of_T"].get("draft") or {},
                             "context": context,
                             "note": f"measured on {dev.device_kind} by the device script, "
                                     f"random {a.dtype} weights, batch 1"}

    def plots():
        result["plot"] = plot(result, os.path.join(a.out, "device.png"))

    stage("plot", plots)
    result["seconds"] = time.perf_counter() - t0
    save()
    print(json.dumps({k: result[k] for k in ("device", "stages", "seconds")}, default=str))
    print(summary(result))
    if result.get("quantized"):
        from experiments.device.quantized import summary_lines

        print("\n".join(summary_lines(result["quantized"])))
    return result


if __name__ == "__main__":
    main()
