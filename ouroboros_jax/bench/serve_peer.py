"""`ouroboros-jax bench --serve --peer NAME=URL|COMMAND`: our OpenAI server beside a peer's.

    ouroboros-jax bench --serve --model F32.gguf --methods vanilla,prompt_lookup,lookahead \
        --spec-bench question.jsonl --prompts-per-task 1 --max-new-tokens 96 \
        --serve-requests 16 --serve-concurrency 1,4,16 \
        --peer 'llama.cpp=python -m llama_cpp.server --model F32.gguf --port {port} \
                --n_threads 2 --interrupt_requests False'

Each server runs alone, one after the other: ours once per method (`ouroboros-jax serve
--model M --method X --port P`, every other flag at its default), then each peer. A peer is a
URL of a server already up, or a command the bench starts (`{port}` becomes a free port) and
stops when its levels are done. Every server gets the same closed-loop load: at concurrency c,
max(requests, c) streamed /v1/chat/completions requests (greedy, a fixed max_tokens, one user
turn each) with c in flight at all times, after a warm-up that sends every prompt once
(16 tokens each, at the highest concurrency).

Each row: completion tokens/s over the level's wall time, req/s, and the client's time to first
token and end-to-end latency at p50/p95. Completion tokens are the usage chunk's
(`stream_options.include_usage`) where the server sends one, else the content chunks (one per
token in llama-cpp-python's stream). Which method each of our rows ran comes from the server's
startup line; its /metrics after the levels says whether it speculated (accepted tokens by
source). Greedy answers are compared with the first server's: ours must agree exactly (the
methods are exact); a peer's agreement is reported, not required (other kernels, other sums).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from . import http_load
from .http_load import concurrency_levels, fmt_ms, fmt_s, quantile_fields, stream_events
from .records import machine
from .report import bench_command, pyplot, save_figure, write_json, write_markdown

CONCURRENCY = (1, 4, 16)
QUANTILES = (50, 95)
START_TIMEOUT_S = 900.0
WARMUP_TOKENS = 16


@dataclass
class Server:
    """One server the bench loads: `url` when it is already up, else `command` (a list; the
    string "{port}" in it becomes a free port) that the bench starts and stops."""

    name: str
    kind: str  # "ours" or "peer"
    url: Optional[str] = None
    command: Optional[list] = None
    method: Optional[str] = None  # ours: the --method asked for
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    log_path: Optional[str] = None


def parse_peer(spec: str) -> Server:
    """--peer NAME=URL or NAME=COMMAND -> a Server."""
    import shlex

    name, eq, rest = spec.partition("=")
    if not eq or not name.strip() or not rest.strip():
        raise ValueError(f"--peer must look like NAME=URL or NAME=COMMAND (with {{port}} in "
                         f"the command), got {spec!r}")
    rest = rest.strip()
    if rest.startswith(("http://", "https://")):
        return Server(name.strip(), "peer", url=rest.rstrip("/"))
    if "{port}" not in rest:
        raise ValueError(f"--peer {name.strip()}: a command must contain {{port}} (where the "
                         f"bench puts the port it listens on), got {rest!r}")
    return Server(name.strip(), "peer", command=shlex.split(rest))


def our_server(model: str, method: str) -> Server:
    """Our server for one method: `ouroboros-jax serve` with every flag but the model, the
    method and the port at its default (the cache sized by memory)."""
    cmd = [sys.executable, "-m", "ouroboros_jax.cli", "serve", "--model", model,
           "--method", method, "--port", "{port}"]
    return Server(f"ouroboros-jax {method}", "ours", command=cmd, method=method)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    import httpx

    return httpx.get(url, timeout=timeout)


def start(server: Server, log_dir: str, timeout: float = START_TIMEOUT_S) -> str:
    """Starts a command server (its output to LOG_DIR/NAME.log) and waits until /v1/models
    answers -> the model id to send. A URL server: only the wait."""
    if server.command is not None:
        port = _free_port()
        cmd = [c.replace("{port}", str(port)) for c in server.command]
        server.command = cmd
        server.url = f"http://127.0.0.1:{port}"
        server.log_path = os.path.join(log_dir, re.sub(r"[^\w.-]+", "_", server.name) + ".log")
        with open(server.log_path, "w") as log:
            server.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    while True:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before it "
                               f"served; its output: {startup_lines(server)[-5:]}")
        try:
            r = _get(server.url + "/v1/models")
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except Exception:  # noqa: BLE001  (not listening yet)
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{server.name} did not answer /v1/models in {timeout:.0f} s")
        time.sleep(0.5)


def stop(server: Server) -> None:
    """Ends a server the bench started (SIGTERM, then SIGKILL after 30 s)."""
    if server.proc is None or server.proc.poll() is not None:
        return
    server.proc.terminate()
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


def startup_lines(server: Server) -> list[str]:
    """The server's output lines so far (ours: "ouroboros-jax serve: ..." lines only)."""
    if not server.log_path or not os.path.exists(server.log_path):
        return []
    with open(server.log_path, errors="replace") as f:
        lines = [ln.rstrip() for ln in f if ln.strip()]
    if server.kind == "ours":
        return [ln for ln in lines if ln.startswith("ouroboros-jax serve:")]
    return lines[:20]


def method_ran(lines: list[str]) -> Optional[str]:
    """The method of our startup line "NAME (METHOD, N slots) on http://..." (None: none)."""
    for ln in lines:
        m = re.search(r"\((\w+), \d+ slots", ln)
        if m:
            return m.group(1)
    return None


def spec_counters(metrics_text: str) -> dict:
    """/metrics (Prometheus text) -> its spec-decode samples {name{labels}: value}."""
    out = {}
    for ln in metrics_text.splitlines():
        if ln.startswith("ouroboros:spec_decode_num_") and " " in ln:
            k, v = ln.rsplit(" ", 1)
            out[k[len("ouroboros:"):]] = float(v)
    return out


async def chat_request(client, url: str, model: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy chat request -> {ttft_s, latency_s, tokens, text, finish_reason}."""
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, chunks, usage, finish = None, [], 0, None, None
    async for ev in stream_events(client, url + "/v1/chat/completions", body):
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(piece)
                chunks += 1
            finish = ch.get("finish_reason") or finish
    n = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "tokens": n,
            "counted": "usage" if usage else "chunks", "text": "".join(parts),
            "finish_reason": finish}


async def closed_loop(url: str, model: str, jobs: list[str], concurrency: int,
                      max_tokens: int) -> tuple[list[dict], float]:
    """The jobs with `concurrency` in flight at all times -> (records in job order, wall s)."""
    async def send(client, i):
        return await chat_request(client, url, model, jobs[i], max_tokens)

    return await http_load.closed_loop(send, len(jobs), concurrency, timeout_s=1800.0)


def level_row(server: Server, method: Optional[str], c: int, recs: list[dict],
              wall: float) -> dict:
    """One server x concurrency level -> its figures."""
    toks = sum(r["tokens"] for r in recs)
    return {"server": server.name, "kind": server.kind, "method": method, "concurrency": c,
            "requests": len(recs), "wall_s": wall, "req_per_s": len(recs) / wall,
            "tok_per_s": toks / wall, "completion_tokens": toks,
            "tokens_counted_by": sorted({r["counted"] for r in recs}),
            "unfinished": sum(r["finish_reason"] is None for r in recs),
            **quantile_fields(recs, QUANTILES)}


def bench_server(server: Server, texts: list[str], *, concurrency, requests: int,
                 max_tokens: int, log_dir: str, log=None) -> dict:
    """Starts (or reaches) one server, warms it, runs every level, stops it -> its results:
    {"name", "kind", "command"|"url", "method", "startup", "levels", "answers", "spec"}."""
    log = log or (lambda m: None)
    t0 = time.perf_counter()
    model = start(server, log_dir)
    log(f"[peer] {server.name}: up in {time.perf_counter() - t0:.1f} s ({server.url})")
    res = {"name": server.name, "kind": server.kind, "url": server.url,
           "command": server.command, "startup_s": time.perf_counter() - t0, "levels": []}
    try:
        # every prompt once at the busiest level: compiles (ours) and page-ins happen here
        asyncio.run(closed_loop(server.url, model, texts, max(concurrency),
                                min(max_tokens, WARMUP_TOKENS)))
        lines = startup_lines(server)
        res["startup"] = lines
        res["method"] = method_ran(lines) if server.kind == "ours" else None
        for c in concurrency:
            jobs = [texts[i % len(texts)] for i in range(max(requests, c))]
            recs, wall = asyncio.run(closed_loop(server.url, model, jobs, c, max_tokens))
            if c == concurrency[0]:
                res["answers"] = [r["text"] for r in recs[:len(texts)]]
            row = level_row(server, res["method"], c, recs, wall)
            res["levels"].append(row)
            log(f"[peer] {server.name:<26} c={c:<3} {row['tok_per_s']:7.1f} tok/s  ttft p50 "
                f"{row['ttft_p50_s'] * 1e3:7.0f} ms  latency p50 {row['latency_p50_s']:6.2f} s")
        if server.kind == "ours":
            res["spec"] = spec_counters(_get(server.url + "/metrics").text)
    finally:
        stop(server)
    return res


def agreement(results: dict) -> dict:
    """{server: answers equal to the first server's, of those compared}."""
    done = [r for r in results.values() if r.get("answers")]
    if not done:
        return {}
    ref = done[0]["answers"]
    return {r["name"]: {"same": sum(a == b for a, b in zip(r["answers"], ref)),
                        "of": min(len(ref), len(r["answers"]))} for r in done}


def run_peer_bench(servers: list[Server], texts: list[str], *, concurrency=CONCURRENCY,
                   requests: int = 16, max_tokens: int = 96, log_dir: str, log=None,
                   on_server=None) -> dict:
    """Every server, one at a time, at every level -> results dict (JSON-ready). texts: one
    user message each. on_server(results): called after each server."""
    os.makedirs(log_dir, exist_ok=True)
    results = {"settings": {"concurrency": list(concurrency), "requests_per_level": requests,
                            "max_tokens": max_tokens, "prompts": len(texts),
                            "temperature": 0, "stream": True, "endpoint": "/v1/chat/completions"},
               "servers": {}}
    for s in servers:
        try:
            results["servers"][s.name] = bench_server(s, texts, concurrency=concurrency,
                                                      requests=requests, max_tokens=max_tokens,
                                                      log_dir=log_dir, log=log)
        except Exception as e:  # noqa: BLE001  (one server's failure is a result, not the end)
            stop(s)
            if log:
                log(f"[peer] {s.name}: FAILED {type(e).__name__}: {e}")
            results["servers"][s.name] = {"name": s.name, "kind": s.kind, "levels": [],
                                          "command": s.command, "url": s.url,
                                          "error": f"{type(e).__name__}: {e}"}
        results["agreement"] = agreement(results["servers"])
        if on_server is not None:
            on_server(results)
    return results


def _accepted(res: dict) -> str:
    """Our server's accepted draft tokens over its run (/metrics), "-" for a peer."""
    spec = res.get("spec")
    if spec is None:
        return "-"
    n = spec.get("spec_decode_num_accepted_tokens_total")
    return "0 (no drafts)" if n is None else f"{n:.0f}"


def peer_markdown(results: dict) -> str:
    """The results as a markdown table: one row per server x concurrency."""
    st = results["settings"]
    lines = [f"{st['prompts']} prompts, {st['requests_per_level']} requests per level (at "
             f"least the concurrency), max_tokens {st['max_tokens']}, greedy, streamed "
             f"{st['endpoint']}; servers one at a time.", "",
             "| server | method ran | concurrency | tok/s | req/s | TTFT p50 / p95 (ms) | "
             "latency p50 / p95 (s) | completion tokens | accepted draft tokens |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in results["servers"].items():
        for r in res["levels"]:
            lines.append(f"| {name} | {r['method'] or '-'} | {r['concurrency']} | "
                         f"{r['tok_per_s']:.1f} | {r['req_per_s']:.2f} | "
                         f"{fmt_ms(r['ttft_p50_s'])} / {fmt_ms(r['ttft_p95_s'])} | "
                         f"{fmt_s(r['latency_p50_s'])} / {fmt_s(r['latency_p95_s'])} | "
                         f"{r['completion_tokens']} | {_accepted(res)} |")
        if res.get("error"):
            lines.append(f"| {name} | failed: {res['error'][:120]} | | | | | | | |")
    agree = results.get("agreement") or {}
    if agree:
        first = next(iter(agree))
        lines += ["", f"Greedy answers equal to {first}'s (at concurrency "
                      f"{st['concurrency'][0]}): " + ", ".join(
                          f"{n} {a['same']}/{a['of']}" for n, a in agree.items()) + "."]
    return "\n".join(lines)


def plot_peer(results: dict, path: str) -> str:
    """Three panels by concurrency: tok/s, TTFT p50 (band to p95), latency p50 (band to p95);
    one line per server."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("tok_per_s", None, "completion tokens/s (all requests)", "Throughput"),
              ("ttft_p50_s", "ttft_p95_s", "TTFT p50 (band to p95), s", "Time to first token"),
              ("latency_p50_s", "latency_p95_s", "latency p50 (band to p95), s", "Latency"))
    for name, res in results["servers"].items():
        rows = sorted(res["levels"], key=lambda r: r["concurrency"])
        if not rows:
            continue
        xs = [r["concurrency"] for r in rows]
        style = "--" if res["kind"] == "peer" else "-"
        for ax, (key, band, _, _) in zip(axes, panels):
            ax.plot(xs, [r[key] for r in rows], style, marker="o", label=name)
            if band:
                ax.fill_between(xs, [r[key] for r in rows], [r[band] for r in rows], alpha=0.12)
    for ax, (_, _, ylabel, title) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def peer_servers(a, names: Optional[list]) -> list[Server]:
    """Ours (one per --methods entry, default vanilla, prompt_lookup, lookahead: the methods
    without a draft), then each --peer; flags checked before anything starts."""
    from ..decoding import METHODS

    if not a.target:
        raise ValueError("--peer needs --model (the weights our server loads; give the peer "
                         "the same file)")
    methods = names or ["vanilla", "prompt_lookup", "lookahead"]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods with --peer: unknown {unknown}; choose from "
                         f"{sorted(METHODS)}")
    needs = [m for m in methods if METHODS[m].needs_draft]
    if needs and not a.draft:
        raise ValueError(f"--methods {','.join(needs)} with --peer need --draft")
    ours = [our_server(a.target, m) for m in methods]
    if a.draft:
        for s in ours:
            s.command[-2:-2] = ["--draft", a.draft]
    return ours + [parse_peer(p) for p in a.peer]


def peer_main(a, names: Optional[list], log, workload) -> dict:
    """`bench --serve --peer ...`: flags -> run_peer_bench -> JSON, markdown, plot. names: the
    methods asked for, None for the default (the methods that need no draft); workload: the
    suite's WorkloadSpec of the flags (`suite.workload_of_args`)."""
    from .workloads import load_workload

    servers = peer_servers(a, names)
    conc = concurrency_levels(a.serve_concurrency, CONCURRENCY)
    requests = a.serve_requests or 16
    if requests < 1:
        raise ValueError(f"--serve-requests must be >= 1, got {requests}")
    max_tokens = a.max_new_tokens or 96
    prompts = load_workload(workload, a.quick)
    texts = [p.turns[0] for p in prompts]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("--peer sends chat messages: give text prompts (--spec-bench, "
                         "--prompts-jsonl, --humaneval), not token ids")
    out = a.out or os.path.join("runs", "bench-serve-peer")
    os.makedirs(out, exist_ok=True)
    log(f"[peer] {len(texts)} prompts; servers: {', '.join(s.name for s in servers)}")

    def save(r):
        write_json(os.path.join(out, "serve_peer.json"), r)

    settings = {"command": bench_command(), "machine": machine()}
    res = run_peer_bench(servers, texts, concurrency=conc, requests=requests,
                         max_tokens=max_tokens, log_dir=os.path.join(out, "logs"), log=log,
                         on_server=lambda r: save({**r, "partial": True}))
    res["settings"].update(settings)
    res["settings"]["machine"]["loadavg_at_end"] = list(os.getloadavg())
    save(res)
    write_markdown(os.path.join(out, "serve_peer.md"), peer_markdown(res))
    if not a.no_plots:
        log(f"[peer] plot: {plot_peer(res, os.path.join(out, 'serve_peer.png'))}")
    log(f"[peer] wrote {out}/serve_peer.json, serve_peer.md")
    return res
