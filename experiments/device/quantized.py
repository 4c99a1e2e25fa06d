"""What do int8 and int4 weights buy on the device? The device script's quantized-weights stage
(issue 56; `python -m experiments.device.probe`, stage "quantized weights").

Decode is memory-bound, so weights read as int8 codes should cut vanilla's ms per token toward
half of bf16's (gate: 8B int8 vanilla <= 0.6x bf16's) and int4 toward a quarter. Measured here,
side by side in one process on one device:

1. t(T) for T = 1..64 of the Llama-3.1-8B-shaped target with int8 and int4 weights (random
   bf16 weights quantized on the device, `quant.quantize_params`; bf16's t(T) is stage 1's),
   and vanilla's ms per token through `generate` in bf16, int8 and int4;
2. every method's round at 8B/1B shapes with int8 target and draft (the paper's recipe), and
   whether its greedy tokens equal int8 vanilla's (random weights: near-ties are many, so a
   difference here is counted, not a verdict);
3. exactness on real weights: the shipped demo pair quantized to int8 (float32 activations),
   every method's greedy tokens against int8 vanilla's, prompt by prompt;
4. t(T) of further pairs' shapes (the real Qwen2.5-Coder 1.5B/0.5B pair) in int8 and int4;
5. the candidate product side by side: `quant.set_matmul("dequantize")` (the weight
   dequantized to bf16, then a plain matmul, left to XLA to fuse) against the default grouped
   product, t(T) at T = 1 and 16 and vanilla ms per token, 8B int8 ("matmul_variants").
"""

from __future__ import annotations

import time

SCHEMES = ("int8", "int4")
SIZES = (1, 2, 4, 8, 16, 32, 64)
TINY_SIZES = (1, 4)


def quantized(model, scheme: str):
    """The `Model` with its linear weights quantized on its device by one jitted call."""
    import jax

    from ouroboros_jax.models import Model
    from ouroboros_jax.models.quant import quantize_params

    params = jax.jit(lambda p: quantize_params(p, model.config, scheme))(model.params)
    return Model(config=model.config, params=jax.block_until_ready(params),
                 tokenizer=model.tokenizer)


def vanilla_seconds_per_token(model, prompt_len: int, new_tokens: int) -> float:
    """Seconds per token of vanilla greedy decoding, batch 1, the second of two calls."""
    import numpy as np

    from ouroboros_jax import generate

    prompt = [list(np.random.default_rng(0).integers(1, model.config.vocab_size, prompt_len))]
    kw = dict(method="vanilla", config=None, max_new_tokens=new_tokens, eos_token_id=-1)
    generate(model, prompt, **kw)
    st = generate(model, prompt, **kw).stats
    return st["seconds"] / st["new_tokens"]


def method_rounds(target, draft, methods, prompt_len: int, new_tokens: int, in_budget):
    """Per method (the paper's recipe): seconds per round and token, and whether its greedy
    tokens equal vanilla's on the same (quantized) weights, first difference where not."""
    import numpy as np

    from ouroboros_jax import generate
    from ouroboros_jax.decoding import METHODS as SPECS
    from experiments.device.demo_pair import first_difference

    prompt = [list(np.random.default_rng(0).integers(1, target.config.vocab_size, prompt_len))]
    ref = None
    rows = []
    for m in ("vanilla", *[m for m in methods if m != "vanilla"]):
        if not in_budget():
            rows.append({"method": m, "skipped": "budget"})
            continue
        kw = dict(draft=draft if SPECS[m].needs_draft else None, method=m, config=None,
                  max_new_tokens=new_tokens, eos_token_id=-1)
        start = time.perf_counter()
        generate(target, prompt, **kw)
        first = time.perf_counter() - start
        out = generate(target, prompt, **kw)
        st = out.stats
        ref = out.tokens[0] if m == "vanilla" else ref
        rows.append({"method": m, "first_call_seconds": first,
                     "round_seconds": st["seconds"] / max(st["target_calls"], 1),
                     "seconds_per_token": st["seconds"] / st["new_tokens"], "eta": st["eta"],
                     "first_difference": first_difference(out.tokens[0], ref)})
    return rows


def demo_exactness(methods, scheme: str, num_prompts: int, new_tokens: int, in_budget):
    """The demo pair quantized (float32 activations): per method, prompts whose greedy tokens
    equal quantized vanilla's, and the first differences."""
    from ouroboros_jax import generate
    from ouroboros_jax.decoding import METHODS as SPECS
    from experiments.device.demo_pair import first_difference, load_demo

    target, draft, texts = load_demo("float32")
    target, draft = quantized(target, scheme), quantized(draft, scheme)
    prompts = texts[:num_prompts]
    ref, rows = None, []
    for m in ("vanilla", *[m for m in methods if m != "vanilla"]):
        if not in_budget():
            rows.append({"method": m, "skipped": "budget"})
            continue
        kw = dict(draft=draft if SPECS[m].needs_draft else None, method=m, config=None,
                  max_new_tokens=new_tokens)
        toks = [generate(target, [p], **kw).tokens[0] for p in prompts]
        ref = toks if m == "vanilla" else ref
        diffs = [first_difference(a, b) for a, b in zip(toks, ref)]
        rows.append({"method": m, "scheme": scheme, "identical": sum(d < 0 for d in diffs),
                     "prompts": len(prompts), "first_difference": diffs})
    return rows


def quant_stage(models: dict, pairs: dict, methods, sizes, context: int, reps: int,
                new_tokens: int, demo_prompts: int, demo_tokens: int, in_budget, save,
                schemes=SCHEMES, demo: bool = True) -> dict:
    """Runs 1-4 of the module docstring (3 only when `demo`); `models` holds stage 1's bf16
    "target" and "draft" (random weights). Fills and returns the "quantized" entry of
    device.json, calling save() after each part so a cut run keeps what it measured."""
    import jax

    from experiments.device.probe import random_model, time_forwards

    from ouroboros_jax.models.quant import params_nbytes

    out: dict = {"schemes": list(schemes), "sizes": list(sizes), "t_of_T": {},
                 "weight_bytes": {}, "vanilla_seconds_per_token": {}, "rounds": {},
                 "demo_exact": [], "pairs": {}}
    target, draft = models["target"], models["draft"]
    prompt_len = min(128, target.config.max_position_embeddings // 4)
    out["weight_bytes"]["bfloat16"] = params_nbytes(target.params)
    out["vanilla_seconds_per_token"]["bfloat16"] = vanilla_seconds_per_token(
        target, prompt_len, new_tokens)
    save(out)
    for scheme in schemes:
        if not in_budget():
            out["t_of_T"][scheme] = "skipped: budget"
            continue
        q = quantized(target, scheme)
        out["weight_bytes"][scheme] = params_nbytes(q.params)  # vanilla reads these a token
        out["t_of_T"][scheme] = time_forwards(q, sizes, context, reps)
        out["vanilla_seconds_per_token"][scheme] = vanilla_seconds_per_token(
            q, prompt_len, new_tokens)
        if scheme == schemes[0]:  # every method's round on int8 target and draft
            qd = quantized(draft, scheme)
            out["rounds"][scheme] = method_rounds(q, qd, methods, prompt_len, new_tokens,
                                                  in_budget)
            del qd
        del q
        jax.clear_caches()
        save(out)
    if demo and in_budget():
        out["demo_exact"] = demo_exactness(methods, schemes[0], demo_prompts, demo_tokens,
                                           in_budget)
        save(out)
    if in_budget():
        out["matmul_variants"] = matmul_variants(target, schemes[0], context, reps,
                                                 prompt_len, new_tokens)
        save(out)
    for name, (pt, pd) in pairs.items():
        entry = out["pairs"][name] = {}
        for who, cfg, seed in (("target", pt, 2), ("draft", pd, 3)):
            if not in_budget():
                entry[who] = "skipped: budget"
                continue
            base = random_model(cfg, "bfloat16", seed)
            for scheme in schemes:
                entry.setdefault(scheme, {})[who] = time_forwards(quantized(base, scheme),
                                                                  sizes, context, reps)
            del base
        save(out)
    return out


def matmul_variants(target, scheme: str, context: int, reps: int, prompt_len: int,
                    new_tokens: int) -> dict:
    """{mode: {"t_of_T": {1, 16}, "vanilla_seconds_per_token"}} for each `quant.MATMULS`
    product on the target quantized to `scheme` (caches cleared between: read at trace time)."""
    import jax

    from ouroboros_jax.models import quant
    from experiments.device.probe import time_forwards

    q = quantized(target, scheme)
    out = {}
    try:
        for mode in quant.MATMULS:
            quant.set_matmul(mode)
            jax.clear_caches()
            out[mode] = {"t_of_T": time_forwards(q, (1, 16), context, reps),
                         "vanilla_seconds_per_token": vanilla_seconds_per_token(
                             q, prompt_len, new_tokens)}
    finally:
        quant.set_matmul("grouped")
        jax.clear_caches()
    return out


def summary_lines(q: dict) -> list:
    """The stage's digest: vanilla ms/token per weight format and its ratio to bf16, t(1) and
    t(64)/t(1) per scheme, each method's round and exactness."""
    lines = []
    v = q.get("vanilla_seconds_per_token") or {}
    bf = v.get("bfloat16")
    if bf:
        cells = ", ".join(f"{k} {s * 1e3:.2f} ms ({s / bf:.2f}x)" for k, s in v.items())
        lines.append(f"quantized vanilla per token: {cells}")
        wb = q.get("weight_bytes") or {}
        if wb.get("bfloat16"):
            lines.append("quantized weight bytes: " + ", ".join(
                f"{k} {b / 1e9:.2f} GB ({b / wb['bfloat16']:.2f}x)" for k, b in wb.items()))
    for scheme, t in (q.get("t_of_T") or {}).items():
        if isinstance(t, dict) and t:
            get = lambda x: t.get(str(x), t.get(x))  # noqa: E731
            last = max(int(k) for k in t)
            lines.append(f"quantized t(T) {scheme}: t(1)={get(1) * 1e3:.2f} ms, "
                         f"t({last})/t(1)={get(last) / get(1):.2f}")
    for scheme, rows in (q.get("rounds") or {}).items():
        for r in rows:
            if "skipped" in r:
                continue
            lines.append(f"quantized {scheme} round {r['method']}: "
                         f"{r['round_seconds'] * 1e3:.2f} ms/round, "
                         f"{r['seconds_per_token'] * 1e3:.2f} ms/token, first difference "
                         f"{r['first_difference']}")
    for mode, m in (q.get("matmul_variants") or {}).items():
        t = m["t_of_T"]
        lines.append(f"quantized matmul {mode}: t(1) {t.get('1', t.get(1)) * 1e3:.2f} ms, "
                     f"vanilla {m['vanilla_seconds_per_token'] * 1e3:.2f} ms/token")
    for r in q.get("demo_exact") or []:
        if "skipped" not in r:
            lines.append(f"quantized demo {r['scheme']} {r['method']}: identical "
                         f"{r['identical']}/{r['prompts']}, first difference "
                         f"{r['first_difference']}")
    return lines
