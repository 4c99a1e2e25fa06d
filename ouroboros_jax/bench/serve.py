"""`ouroboros-jax bench --serve`: the OpenAI-compatible server under load, per method.

    ouroboros-jax bench --serve --demo-prompts --max-new-tokens 64 --ignore-eos   # demo pair
    ouroboros-jax bench --serve --quick                                           # seconds

For each method (vanilla, speculative, Ouroboros with one shared phrase pool, Ouroboros with
per-request pools) an `Engine` is served by uvicorn on 127.0.0.1 in a thread of this process,
and a bounded asyncio client (httpx, streamed /v1/completions) loads it two ways:

- closed loop at concurrency 1, 2, 4, 8, 16: that many requests in flight at all times;
- open loop: Poisson arrivals at a few rates (requests/s), at most 64 in flight (the bound).

Each level reports req/s, tok/s (completion tokens of all requests over the level's wall time),
time to first token and end-to-end latency at p50/p95/p99 (measured by the client), and the
pool hit rate over the level (the engine's counters). The Poisson rates are fractions of the
first method's req/s at concurrency 8, so every method sees the same arrival rates. Levels
start after a warm-up that compiles every prompt bucket and load level, so compile time is in
no figure. Greedy outputs are checked against the first method's: a method that changes them
is a bug, and the bench says so.

The client and the server share this process (and its cores): on a small CPU the client's
event loop takes some of the time the engine would have, the same for every method.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Optional

from . import http_load
from .http_load import concurrency_levels, fmt_ms, fmt_s, quantile_fields, stream_events
from .report import bench_command, pyplot, save_figure, write_json, write_markdown

CONCURRENCY = (1, 2, 4, 8, 16)
RATE_FRACTIONS = (0.25, 0.5, 0.9)
MAX_IN_FLIGHT = 64
DEFAULT_METHODS = ("vanilla", "speculative", "ouroboros", "ouroboros-private")


def method_engine_args(name: str) -> dict:
    """A serve-bench method name -> Engine keyword arguments."""
    if name == "ouroboros-private":
        return dict(method="ouroboros", shared_pool=False)
    if name == "ouroboros-shared":
        return dict(method="ouroboros", shared_pool=True)
    return dict(method=name)


async def _request(client, url: str, prompt: list[int], max_tokens: int, ignore_eos: bool,
                   model: str) -> dict:
    """One streamed completion -> {ttft_s, latency_s, tokens, token_ids}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": ignore_eos}
    t0 = time.perf_counter()
    ttft, ids = None, []
    async for ev in stream_events(client, url + "/v1/completions", body):
        for ch in ev["choices"]:
            if ch.get("token_ids"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(ch["token_ids"])
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "tokens": len(ids),
            "token_ids": ids}


async def closed_loop(url: str, jobs: list[tuple[list[int], int]], concurrency: int, *,
                      ignore_eos: bool, model: str) -> tuple[list[dict], float]:
    """Sends jobs with `concurrency` in flight at all times -> (records in job order, wall s)."""
    async def send(client, i):
        p, n = jobs[i]
        return await _request(client, url, p, n, ignore_eos, model)

    return await http_load.closed_loop(send, len(jobs), concurrency, timeout_s=600.0)


async def poisson(url: str, jobs: list[tuple[list[int], int]], rate: float, *, ignore_eos: bool,
                  model: str, seed: int = 0,
                  max_in_flight: int = MAX_IN_FLIGHT) -> tuple[list[dict], float]:
    """Sends jobs at Poisson arrivals of `rate` per second (at most max_in_flight at once)."""
    import httpx

    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in jobs]
    out: list = [None] * len(jobs)
    bound = asyncio.Semaphore(max_in_flight)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=max_in_flight)) as client:
        async def one(i):
            async with bound:
                p, n = jobs[i]
                out[i] = await _request(client, url, p, n, ignore_eos, model)

        t0 = time.perf_counter()
        tasks = []
        for i, g in enumerate(gaps):
            await asyncio.sleep(g)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return out, wall


def summarize(records: list[dict], wall: float, pool: tuple[int, int]) -> dict:
    """Client records of one level + (pool hits, lookups) over it -> the level's figures."""
    toks = sum(r["tokens"] for r in records)
    return {"requests": len(records), "wall_s": wall, "req_per_s": len(records) / wall,
            "tok_per_s": toks / wall, "completion_tokens": toks,
            "pool_hit_rate": pool[0] / pool[1] if pool[1] else None,
            **quantile_fields(records, (50, 95, 99))}


def _pool_counts(engine) -> tuple[int, int]:
    m = engine.metrics()
    return int(m.get("pool_hits", 0) or 0), int(m.get("pool_lookups", 0) or 0)


def _rates_from(levels: list[dict], concurrency, fractions) -> list[float]:
    """Poisson rates: fractions of the req/s at concurrency 8 (or the largest below it)."""
    c = max([c for c in concurrency if c <= 8] or concurrency)
    base = next(r["req_per_s"] for r in levels if r["load"] == "concurrency" and r["value"] == c)
    return [round(f * base, 3) for f in fractions]


def bench_method(name: str, target, draft, jobs, *, concurrency=CONCURRENCY,
                 rates: Optional[list[float]] = None, rate_fractions=RATE_FRACTIONS,
                 requests_per_level: int, slots: int, max_cache_len: int, ignore_eos: bool,
                 config="auto", log=None) -> dict:
    """Serves one method and runs every level -> {"method", "levels", "rates", "outputs",
    "engine"}. rates None: fractions of this method's own req/s at concurrency 8."""
    from ..serving.engine import Engine
    from ..serving.server import ServerThread, create_app

    log = log or (lambda m: None)
    kw = method_engine_args(name)
    engine = Engine(target, draft if kw["method"] != "vanilla" else None, config=config,
                    slots=slots, max_cache_len=max_cache_len, max_queue=4 * MAX_IN_FLIGHT, **kw)
    srv = ServerThread(create_app(engine, model_names=["bench"])).start()
    levels, outputs = [], None

    def level(kind, v):
        h0 = _pool_counts(engine)
        if kind == "concurrency":
            load = [jobs[i % len(jobs)] for i in range(max(requests_per_level, v))]
            recs, wall = asyncio.run(closed_loop(srv.url, load, v, ignore_eos=ignore_eos,
                                                 model="bench"))
        else:
            load = [jobs[i % len(jobs)] for i in range(requests_per_level)]
            recs, wall = asyncio.run(poisson(srv.url, load, v, ignore_eos=ignore_eos,
                                             model="bench"))
        h1 = _pool_counts(engine)
        row = {"method": name, "load": kind, "value": v,
               **summarize(recs, wall, (h1[0] - h0[0], h1[1] - h0[1]))}
        levels.append(row)
        log(f"[serve] {name:<18} {kind:<11} {v:<6g} {row['req_per_s']:7.2f} req/s "
            f"{row['tok_per_s']:8.1f} tok/s  ttft p50 {row['ttft_p50_s'] * 1e3:7.1f} ms  "
            f"latency p50 {row['latency_p50_s']:6.2f} s p99 {row['latency_p99_s']:6.2f} s")
        return recs

    try:
        # warm-up: every prompt at full load (all prompt buckets, the busiest load level),
        # then one alone (the idlest); the greedy outputs of the first pass are kept
        recs, _ = asyncio.run(closed_loop(srv.url, jobs, max(concurrency), ignore_eos=
                                          ignore_eos, model="bench"))
        outputs = [r["token_ids"] for r in recs]
        asyncio.run(closed_loop(srv.url, jobs[:1], 1, ignore_eos=ignore_eos, model="bench"))
        for c in concurrency:
            level("concurrency", c)
        if rates is None:
            rates = _rates_from(levels, concurrency, rate_fractions)
        for r in rates:
            level("rate", r)
        em = engine.metrics()
    finally:
        srv.stop(cancel=True)
    return {"method": name, "levels": levels, "rates": list(rates), "outputs": outputs,
            "engine": {k: v for k, v in em.items() if isinstance(v, (int, float, str, list))}}


def run_serve_bench(target, draft, prompts: list[list[int]], max_tokens: list[int], *,
                    methods=DEFAULT_METHODS, concurrency=CONCURRENCY,
                    rate_fractions=RATE_FRACTIONS, rates: Optional[list[float]] = None,
                    requests_per_level: int = 32, slots: int = 8, ignore_eos: bool = True,
                    log=None, on_method=None) -> dict:
    """Every method at every level -> results dict (JSON-ready). prompts: token ids. The
    Poisson rates (unless given) come from the first method's req/s at concurrency 8.
    on_method(results): called after each method (e.g. to save what is done so far)."""
    jobs = list(zip(prompts, max_tokens))
    cache = max(len(p) + n for p, n in jobs)
    limit = target.config.max_position_embeddings
    if cache > limit:
        raise ValueError(f"the longest prompt + max tokens ({cache}) exceeds the model's "
                         f"{limit} positions; pass a smaller --max-new-tokens")
    results = {"settings": {"methods": list(methods), "concurrency": list(concurrency),
                            "requests_per_level": requests_per_level, "slots": slots,
                            "prompts": len(prompts), "max_tokens": sorted(set(max_tokens)),
                            "ignore_eos": ignore_eos, "max_cache_len": cache,
                            "max_in_flight": MAX_IN_FLIGHT},
               "methods": {}, "mismatches": []}
    ref = None
    for name in methods:
        try:
            res = bench_method(name, target, draft, jobs, concurrency=concurrency, rates=rates,
                               rate_fractions=rate_fractions,
                               requests_per_level=requests_per_level, slots=slots,
                               max_cache_len=cache, ignore_eos=ignore_eos, log=log)
        except Exception as e:  # noqa: BLE001  (one method's failure is a result, not the end)
            if log:
                log(f"[serve] {name}: FAILED {type(e).__name__}: {e}")
            results["methods"][name] = {"method": name, "levels": [],
                                        "error": f"{type(e).__name__}: {e}"}
            continue
        rates = res["rates"]
        results["methods"][name] = res
        if ref is None:
            ref = res["outputs"]
        elif res["outputs"] != ref:
            results["mismatches"].append(name)
        results["settings"]["rates"] = rates
        if on_method is not None:
            on_method({**results, "methods": {n: {k: v for k, v in r.items() if k != "outputs"}
                                              for n, r in results["methods"].items()}})
    results["settings"]["rates"] = rates
    for r in results["methods"].values():
        r.pop("outputs", None)
    return results


def serve_markdown(results: dict) -> str:
    """The results as a markdown table (one row per method x level)."""
    st = results["settings"]
    lines = [f"Slots {st['slots']}, {st['prompts']} prompts, max tokens {st['max_tokens']}, "
             f"{st['requests_per_level']} requests per level (closed loop: at least the "
             f"concurrency), ignore_eos={st['ignore_eos']}; Poisson rates "
             f"{st.get('rates', [])} req/s (at most {st['max_in_flight']} in flight).", "",
             "| method | load | req/s | tok/s | TTFT p50 / p95 / p99 (ms) | latency p50 / p95 / "
             "p99 (s) | pool hit rate |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, res in results["methods"].items():
        for r in res["levels"]:
            load = (f"{r['value']} in flight" if r["load"] == "concurrency"
                    else f"Poisson {r['value']:g}/s")
            hit = "-" if r["pool_hit_rate"] is None else f"{r['pool_hit_rate']:.2f}"
            lines.append(f"| {name} | {load} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | "
                         f"{fmt_ms(r['ttft_p50_s'])} / {fmt_ms(r['ttft_p95_s'])} / "
                         f"{fmt_ms(r['ttft_p99_s'])} | {fmt_s(r['latency_p50_s'])} / "
                         f"{fmt_s(r['latency_p95_s'])} / {fmt_s(r['latency_p99_s'])} | {hit} |")
    failed = {n: r["error"] for n, r in results["methods"].items() if r.get("error")}
    for n, err in failed.items():
        lines.append(f"| {n} | failed: {err[:120]} | | | | | |")
    if results.get("mismatches"):
        lines += ["", f"**Greedy outputs differ from the first method's for: "
                      f"{', '.join(results['mismatches'])}** (a bug)."]
    else:
        lines += ["", "Greedy outputs of every method equal the first method's."]
    return "\n".join(lines)


def plot_serve(results: dict, path: str) -> str:
    """Two panels: tok/s by concurrency, and p50 latency by Poisson rate; one line per method."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, res in results["methods"].items():
        cl = sorted((r for r in res["levels"] if r["load"] == "concurrency"),
                    key=lambda r: r["value"])
        op = sorted((r for r in res["levels"] if r["load"] == "rate"), key=lambda r: r["value"])
        if cl:
            a.plot([r["value"] for r in cl], [r["tok_per_s"] for r in cl], marker="o",
                   label=name)
        if op:
            b.plot([r["value"] for r in op], [r["latency_p50_s"] for r in op], marker="o",
                   label=name)
            b.fill_between([r["value"] for r in op], [r["latency_p50_s"] for r in op],
                           [r["latency_p99_s"] for r in op], alpha=0.12)
    a.set_xscale("log", base=2)
    a.set_xlabel("requests in flight (closed loop)")
    a.set_ylabel("tokens/s (all requests)")
    a.set_title("Throughput by concurrency")
    b.set_xlabel("Poisson arrival rate (requests/s)")
    b.set_ylabel("latency p50 (band to p99), s")
    b.set_title("Latency under open-loop load")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def serve_main(a, target, draft, prompts, names, log) -> dict:
    """`bench --serve`: the CLI layer (flags -> run_serve_bench -> JSON, markdown, plot).
    names: the methods asked for, None for this bench's defaults."""
    from .runner import encode

    methods = DEFAULT_METHODS if names is None else tuple(names)
    unknown = [m for m in methods if m not in ("vanilla", "speculative", "lookahead",
                                               "prompt_lookup", "ouroboros", "ouroboros-shared",
                                               "ouroboros-private")]
    if unknown:
        raise ValueError(f"--methods for --serve: unknown {unknown}; choose from vanilla, "
                         "speculative, lookahead, prompt_lookup, ouroboros (shared pool), "
                         "ouroboros-private (per-request pools)")
    if draft is None and any(method_engine_args(m)["method"] in ("speculative", "ouroboros")
                             for m in methods):
        raise ValueError("--serve with speculative/ouroboros needs a draft (--draft DIR)")
    quick = a.quick
    ids = [encode(target, p.turns[0]) for p in prompts]
    lens = [p.max_new_tokens for p in prompts]
    conc = concurrency_levels(a.serve_concurrency, (1, 2) if quick else CONCURRENCY)
    n_req = a.serve_requests or (4 if quick else 32)
    if n_req < 1:
        raise ValueError(f"--serve-requests must be >= 1, got {n_req}")
    slots = a.serve_slots or (4 if quick else 8)
    if slots < 1:
        raise ValueError(f"--serve-slots must be >= 1, got {slots}")
    fracs = (0.5,) if quick else RATE_FRACTIONS
    log(f"[serve] {len(ids)} prompts, methods {', '.join(methods)}, slots {slots}")
    out = a.out or os.path.join("runs", "bench-serve-quick" if quick else "bench-serve")
    os.makedirs(out, exist_ok=True)

    def save(r):
        write_json(os.path.join(out, "serve.json"), r)

    command = bench_command()
    res = run_serve_bench(target, draft, ids, lens, methods=methods, concurrency=conc,
                          rate_fractions=fracs, requests_per_level=n_req, slots=slots,
                          ignore_eos=a.ignore_eos or quick, log=log,
                          on_method=lambda r: save({**r, "partial": True}))
    res["settings"]["command"] = command
    save(res)
    write_markdown(os.path.join(out, "serve.md"), serve_markdown(res))
    if not a.no_plots:
        log(f"[serve] plot: {plot_serve(res, os.path.join(out, 'serve.png'))}")
    log(f"[serve] wrote {out}/serve.json, serve.md")
    return res
