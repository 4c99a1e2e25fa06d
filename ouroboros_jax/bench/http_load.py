"""The client side of a load on an OpenAI-compatible server, one format for both serving
benches: `bench --serve` (serve.py, our engine in this process) and `bench --serve --peer`
(serve_peer.py, servers in their own processes).

A record is one streamed request as the client saw it: {ttft_s, latency_s, tokens, ...}; a
level's quantiles are read from its records (`quantile_fields`), and the tables print them with
`fmt_ms` / `fmt_s`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Awaitable, Callable, Optional


def concurrency_levels(text: Optional[str], default: tuple) -> tuple:
    """--serve-concurrency "1,4,16" -> (1, 4, 16); None -> default."""
    if text is None:
        return default
    try:
        cs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        cs = ()
    if not cs or min(cs) < 1:
        raise ValueError(f"--serve-concurrency must be comma-separated integers >= 1, e.g. "
                         f"1,4,16; got {text!r}")
    return cs


def percentile(xs: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) with linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def quantile_fields(records: list[dict], quantiles) -> dict:
    """{ttft_pQ_s, latency_pQ_s} for each Q of `quantiles`, over one level's records (a request
    that streamed no token has no TTFT)."""
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    lat = [r["latency_s"] for r in records]
    return {f"{name}_p{q}_s": percentile(xs, q)
            for name, xs in (("ttft", ttft), ("latency", lat)) for q in quantiles}


def fmt_ms(v: Optional[float]) -> str:
    """Seconds as whole milliseconds for a table cell ("-" for no value)."""
    return "-" if v is None else f"{v * 1e3:.0f}"


def fmt_s(v: Optional[float]) -> str:
    """Seconds with two decimals for a table cell ("-" for no value)."""
    return "-" if v is None else f"{v:.2f}"


async def stream_events(client, url: str, body: dict) -> AsyncIterator[dict]:
    """POSTs `body` to `url` with streaming on and yields each server-sent event's JSON; an HTTP
    error or an error event raises RuntimeError with the server's words."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            yield ev


async def closed_loop(send: Callable[..., Awaitable[dict]], jobs: int, concurrency: int, *,
                      timeout_s: float) -> tuple[list[dict], float]:
    """`jobs` requests, `send(client, i)` each, with `concurrency` in flight at all times ->
    (records in job order, wall seconds)."""
    import httpx

    out: list = [None] * jobs
    it = iter(range(jobs))
    limits = httpx.Limits(max_connections=max(concurrency, 1))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        async def worker():
            for i in it:
                out[i] = await send(client, i)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, jobs))))
        wall = time.perf_counter() - t0
    return out, wall

