"""The device script's work (bench/device/run.sh): what the first accelerator at hand should
measure, in one run of a few minutes, with nothing downloaded.

    python -m ouroboros_jax.bench.device.probe --out $OUT            # Llama 3.1-8B / 3.2-1B
    python -m ouroboros_jax.bench.device.probe --tiny --out /tmp/x   # CI: tiny shapes, CPU

1. t(T): one bf16 forward of T = 1 ... 256 tokens at batch 1 after `--context` cached tokens,
   for the target (Llama-3.1-8B shape) and the draft (Llama-3.2-1B shape), random weights built
   on the device (`models.timing.forward_timer`, the timer the cost model and auto share), beside
   the roofline the projection assumes (bench/accelerator.py) when the device is a known one.
2. Per-round time of every method (vanilla, speculative, lookahead, prompt lookup, Ouroboros)
   at the paper's recipe (config=None) and at `config="auto"`'s choice: generate's seconds over
   target forwards, a fixed number of new tokens (EOS ignored). Random weights agree on
   nothing, so η is about 1 here: the round's cost is what is measured, not its yield.
3. Vanilla tokens/s against the HBM-bandwidth bound (weight bytes / bandwidth per token).

Written under --out: device.json (everything, with a `latency` table in the cost model's
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
    from ...models.config import ModelConfig

    t = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    d = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    return t, d


def full_configs():
    from ...models.presets import PRESETS

    return PRESETS["llama-3.1-8b"], PRESETS["llama-3.2-1b"]


def random_model(config, dtype: str, seed: int):
    """A `Model` of random weights in `dtype`, built by one jitted call on the default device
    (an 8B model never exists on the host)."""
    import jax
    import jax.numpy as jnp

    from ...models import Model
    from ...models.llama import init_params

    params = jax.jit(lambda k: init_params(config, k, jnp.dtype(dtype)))(jax.random.key(seed))
    return Model(config=config, params=jax.block_until_ready(params))


def known_device():
    """The `bench/accelerator.py` entry of the default device, or None (a CPU, an unknown
    chip): matched on jax's device_kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite", ...)."""
    import jax

    from ..accelerator import ACCELERATORS

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

    from ..cost_model import forward_timer

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

    from ... import generate
    from ...decoding import METHODS as SPECS

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
    from ...models.layout import weight_bytes

    w = weight_bytes(model.params)
    return {"weight_bytes": w,
            "hbm_gbps": None if acc is None else acc.hbm_gbps,
            "tokens_per_second_bound": None if acc is None else acc.hbm_gbps * 1e9 / w}


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
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which remaining stages are skipped (recorded)")
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}")
    for name in ("context", "reps", "new_tokens"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    context = a.context or (16 if a.tiny else 512)
    reps = a.reps or (3 if a.tiny else 10)
    new_tokens = a.new_tokens or (4 if a.tiny else 64)
    sizes = TINY_SIZES if a.tiny else SIZES
    os.makedirs(a.out, exist_ok=True)

    import jax

    from ..accelerator import forward_seconds

    t0 = time.perf_counter()
    tcfg, dcfg = tiny_configs() if a.tiny else full_configs()
    acc = known_device()
    dev = jax.devices()[0]
    result: dict = {"device": {"platform": dev.platform, "kind": dev.device_kind,
                               "count": jax.device_count(),
                               "projection_entry": None if acc is None else acc.name},
                    "settings": {"tiny": a.tiny, "dtype": a.dtype, "context": context,
                                 "reps": reps, "new_tokens": new_tokens, "sizes": list(sizes),
                                 "target": repr(tcfg), "draft": repr(dcfg)},
                    "t_of_T": {}, "roofline": {}, "rounds": [], "vanilla_bound": None,
                    "stages": {}}
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

    def rounds():
        prompt_len = min(128, tcfg.max_position_embeddings // 4)
        in_budget = lambda: time.perf_counter() - t0 < a.budget_s  # noqa: E731
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
    return result


if __name__ == "__main__":
    main()
