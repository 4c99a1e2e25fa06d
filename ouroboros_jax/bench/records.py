"""What a bench run records: each timed call (`Call`), a method's figures over its calls
(`summarize`), and the environment the figures depend on (`environment`, `machine`)."""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import subprocess
import sys
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass
class Call:
    """One timed generate call (one turn of one prompt in one pass) and its stats."""

    id: str
    task: str
    turn: int
    repeat: int
    tokens: list
    seconds: float
    compile_seconds: float
    stats: dict
    prompt_tokens: int = 0


def environment() -> dict:
    """Versions, devices, CPU, git commit (and whether the tree was dirty), load average and
    torch's thread count: what a run's figures depend on beyond its code."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "cpus": os.cpu_count()}
    for mod in ("jax", "jaxlib", "transformers", "torch", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            env[mod] = None
    try:
        import jax

        env["jax_backend"] = jax.default_backend()
        env["devices"] = [str(d) for d in jax.devices()][:8]
    except Exception:  # noqa: BLE001
        pass
    env["cpu_model"] = cpu_model()
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        env["git_dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    try:
        env["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        pass
    return env


def peak_rss_mib() -> float:
    """The process's resident-memory high-water mark (ru_maxrss), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def config_dict(cfg) -> Optional[dict]:
    """A method config as JSON: its fields, {"auto": True}, or its repr."""
    if cfg is None:
        return None
    if cfg == "auto":
        return {"auto": True}
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return {"repr": repr(cfg)}


def model_info(model) -> dict:
    """A model's path, size and shape for the results' settings."""
    c = model.config
    return {"path": model.path, "params": int(c.num_params()), "layers": c.num_layers,
            "hidden": c.hidden_size, "vocab": c.vocab_size, "dtype": str(model.dtype),
            "tokenizer": model.tokenizer is not None}


def cpu_model() -> Optional[str]:
    """The CPU's model name (/proc/cpuinfo, else platform's guess; None when neither knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def machine() -> dict:
    """Where a served load ran: platform, cores, CPU, Python, niceness, load average now."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu_model() or "",
            "python": platform.python_version(), "niceness": os.nice(0),
            "loadavg_at_start": list(os.getloadavg())}


def summed_histograms(histograms) -> list:
    """Element-wise sum of per-call acceptance histograms, shorter ones padded with zeros:
    config="auto" may size each call differently (gamma 3, then 4, or vanilla's 2 bins)."""
    hs = [np.asarray(h) for h in histograms]
    out = np.zeros(max(len(h) for h in hs), dtype=np.int64)
    for h in hs:
        out[:len(h)] += h.astype(np.int64)
    return out.tolist()


def summarize(run, calls: list[Call], compile_s: float, n_warm: int) -> dict:
    """A `MethodRun`'s figures over its calls (bench/README.md, "Measures"), raw calls kept
    under "per_call"."""
    new = sum(len(c.tokens) for c in calls)
    secs = sum(c.seconds for c in calls)
    s: dict[str, Any] = {
        "method": run.method, "kind": run.kind, "config": config_dict(run.config),
        "compile_seconds": compile_s, "warmup_calls": n_warm,
        "recompiled_calls": sum(1 for c in calls if c.compile_seconds > 0),
        "recompile_seconds_excluded": (0.0 if run.charges_compiles
                                       else sum(c.compile_seconds for c in calls)),
        "recompile_seconds_included": (sum(c.compile_seconds for c in calls)
                                       if run.charges_compiles else 0.0),
        "calls": len(calls), "seconds": secs, "new_tokens": new,
        "tokens_per_second": new / secs if secs > 0 else None,
        "peak_rss_mib": peak_rss_mib(),
    }
    if run.kind == "oj":
        tc = sum(c.stats["target_calls"] for c in calls)
        dc = sum(c.stats["draft_calls"] for c in calls)
        df = sum(c.stats.get("draft_forwards", c.stats["draft_calls"]) for c in calls)
        dtok = sum(c.stats["c"] * c.stats["draft_calls"] for c in calls)
        hist = summed_histograms([c.stats["acceptance_histogram"] for c in calls])
        s.update(target_calls=tc, draft_calls=dc, draft_forwards=df,
                 eta=new / tc if tc else None, c=dtok / dc if dc else None,
                 acceptance_histogram=hist)
        if "pool_hit_rate" in calls[0].stats:
            hits = sum(c.stats.get("pool_hits", 0) for c in calls)
            rounds = sum(c.stats["target_calls"] for c in calls)
            s["pool_hit_rate"] = hits / rounds if rounds else None
            s["pool_growth"] = [int(c.stats.get("pool_occupancy", 0)) for c in calls
                                if c.repeat == 0]
            s["pool_bytes"] = calls[-1].stats.get("pool_bytes")
        for k in ("suffix_tokens_accepted", "guess_tokens_accepted"):
            if k in calls[0].stats:
                s[k] = sum(int(c.stats.get(k, 0)) for c in calls)
        mvas = [c.stats["match_vs_accept"] for c in calls if "match_vs_accept" in c.stats]
        if "match_vs_accept" in calls[0].stats and len({len(m) for m in mvas}) == 1:
            s["match_vs_accept"] = [float(x) for x in np.mean(mvas, axis=0)]
    else:
        s.update(target_calls=None, draft_calls=None, draft_forwards=None,
                 eta=1.0 if run.method == "hf-greedy" else None, c=None,
                 acceptance_histogram=None)
    tasks: dict[str, dict] = {}
    for c in calls:
        t = tasks.setdefault(c.task, {"new_tokens": 0, "seconds": 0.0, "target_calls": 0})
        t["new_tokens"] += len(c.tokens)
        t["seconds"] += c.seconds
        t["target_calls"] += c.stats.get("target_calls", 0)
    for t in tasks.values():
        t["tokens_per_second"] = t["new_tokens"] / t["seconds"] if t["seconds"] else None
        t["eta"] = t["new_tokens"] / t["target_calls"] if t["target_calls"] else None
    s["per_task"] = tasks
    s["per_call"] = [{"id": c.id, "task": c.task, "turn": c.turn, "repeat": c.repeat,
                      "prompt_tokens": c.prompt_tokens,
                      "new_tokens": len(c.tokens), "seconds": c.seconds,
                      "compile_seconds": c.compile_seconds,
                      "target_calls": c.stats.get("target_calls"),
                      "draft_forwards": c.stats.get("draft_forwards", c.stats.get("draft_calls")),
                      "eta": c.stats.get("eta"), "pool_occupancy": c.stats.get("pool_occupancy"),
                      # config="auto": what it chose for this call (method, recipe, why)
                      "auto": c.stats.get("auto")}
                     for c in calls]
    return s
