"""The bench runner: every method on the same prompts, in one process, in a fixed order.

For each method (a `MethodRun`): a warm-up call per distinct compiled shape (prompt bucket,
cache bucket) of the first turns, timed and reported as `compile_seconds`; then `repeats`
passes over the prompts in file order. This project's methods are timed interleaved
(`run_interleaved`: every warm-up first, then each prompt run by every method in turn), so
that the machine's drift during a run weighs on every row alike; the transformers peers run
after them, one after the other. Compilation that still happens while measuring (a later
turn landing in a new bucket) is caught through `jax.monitoring` and subtracted from that call's
time (`recompiled_calls` counts them), so tokens/s never include compilation.

A phrase pool is carried from call to call within a pass (history, when the method's config
has it on) and reset at the start of every pass, so repeats measure the same thing.

Peers (`kind="hf"`) run transformers' own `generate` with torch on CPU on the very same
weights: greedy, assisted generation (draft as `assistant_model`) and prompt lookup decoding.
Every method's tokens are compared with this project's vanilla tokens, prompt by prompt.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np

from ..heap import freeze_heap
from .workloads import Prompt

HF_PEERS = {"hf-greedy": {}, "hf-assisted": {"assistant": True},
            "hf-pld": {"prompt_lookup_num_tokens": 10}}
TURN_SEPARATOR = "\n\n"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


@dataclasses.dataclass(frozen=True)
class MethodRun:
    """label: the name in the report; method: an `oj.decoding.METHODS` name, or one of
    HF_PEERS for transformers peers (kind "hf"); config: that method's config (None: default)."""

    label: str
    method: str
    config: Any = None
    kind: str = "oj"

    @property
    def charges_compiles(self) -> bool:
        """Whether compiles during measured calls stay in their time (config="auto": what it
        compiles after the first call is what the user waits for), instead of being
        subtracted as a fixed config's stray recompiles are."""
        return self.config == "auto"


class CompileClock:
    """Seconds jax spent tracing/lowering/compiling since the last `take()`."""

    _installed = None

    def __init__(self):
        self.total = 0.0

    @classmethod
    def get(cls) -> "CompileClock":
        if cls._installed is None:
            import jax

            clock = cls()

            def listener(event, duration, **kw):
                if event in COMPILE_EVENTS:
                    clock.total += duration

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = clock
        return cls._installed

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


# -- tokens ----------------------------------------------------------------------------------


def encode(model, text, first: bool = True) -> list[int]:
    """Token ids of `text` with the model's tokenizer. Models without one (random test models)
    get a deterministic byte mapping into [3, V) so text workloads still run."""
    if not isinstance(text, str):
        return [int(t) for t in text]
    tok = model.tokenizer
    if tok is not None:
        return list(tok(text, add_special_tokens=first)["input_ids"])
    V = model.config.vocab_size
    return [3 + b % (V - 3) for b in text.encode("utf-8")]


def _fit(ids: list[int], n: int, limit: int, margin: int = 64) -> list[int]:
    """Keeps the last tokens of a context so that context + n (+ margin) fits the cache."""
    room = max(limit - n - margin, 1)
    return ids[-room:]


# -- environment -----------------------------------------------------------------------------


def environment() -> dict:
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
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        env["cpu_model"] = names[0] if names else None
    except OSError:
        env["cpu_model"] = platform.processor() or None
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


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def config_dict(cfg) -> Optional[dict]:
    if cfg is None:
        return None
    if cfg == "auto":
        return {"auto": True}
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return {"repr": repr(cfg)}


def model_info(model) -> dict:
    c = model.config
    return {"path": model.path, "params": int(c.num_params()), "layers": c.num_layers,
            "hidden": c.hidden_size, "vocab": c.vocab_size, "dtype": str(model.dtype),
            "tokenizer": model.tokenizer is not None}


# -- one method ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Call:
    id: str
    task: str
    turn: int
    repeat: int
    tokens: list
    seconds: float
    compile_seconds: float
    stats: dict
    prompt_tokens: int = 0


def _oj_caller(run: MethodRun, target, draft, eos):
    from ..decoding import METHODS
    from ..generate import generate

    spec = METHODS[run.method]
    kw = dict(method=run.method, config=run.config, eos_token_id=eos,
              draft=draft if spec.needs_draft else None)

    def call(ids, n, pool):
        # the wall clock of the whole call, as the user feels it (stats["seconds"] is kept too)
        t0 = time.perf_counter()
        o = generate(target, [ids], max_new_tokens=n, pool=pool, **kw)
        return o.tokens[0], time.perf_counter() - t0, o.stats, o.pool

    def shape_key(ids, n):
        from ..request import bucket

        cfg = spec.default_config() if run.config in (None, "auto") else run.config
        P = bucket(len(ids))
        return P, bucket(P + n + spec.margin(cfg), minimum=64)

    return call, shape_key


class _HFModels:
    """torch copies of the target/draft, loaded once per bench from the same checkpoints (HF
    directories or GGUF files), on first use: the peers run after every method of ours, whose
    packed copies are dropped first, so a 1.5B/0.5B fp32 pair's four copies (ours, packed,
    torch's) never sit in memory at once (measured: 20 GB peak, then refused, on 24 GB)."""

    def __init__(self, target, draft):
        if target.path is None:
            raise FileNotFoundError("the target was not loaded from a directory or GGUF file "
                                    "(no .path); transformers peers need the checkpoint")
        import torch  # noqa: F401  (a peer without torch is skipped before anything runs)
        import transformers  # noqa: F401

        self._paths = (target.path, draft.path if draft is not None else None)
        self._ours = (target, draft)
        self._loaded = None

    @property
    def has_draft(self) -> bool:
        return self._paths[1] is not None

    def _load(self):
        if self._loaded is None:
            import gc

            import jax

            from ..models import layout

            for m in self._ours:
                if m is not None:
                    layout.release(m)
            gc.collect()
            jax.clear_caches()
            t, d = self._paths
            self._loaded = (hf_load(t), hf_load(d) if d else None)
        return self._loaded

    @property
    def target(self):
        return self._load()[0]

    @property
    def draft(self):
        return self._load()[1]


def hf_load(path: str):
    """transformers' fp32 copy of the checkpoint at `path`: an HF directory, or a GGUF file
    (transformers dequantizes it itself, `gguf_file=`), so the peers run the same weights."""
    import torch
    import transformers

    from ..models.gguf import is_gguf_path

    if is_gguf_path(path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
            dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_caller(run: MethodRun, hf: _HFModels, eos):
    import torch

    extra = dict(HF_PEERS[run.method])
    if extra.pop("assistant", False):
        if hf.draft is None:
            raise FileNotFoundError("assisted generation needs the draft's HF directory")
        extra["assistant_model"] = hf.draft

    def call(ids, n, pool):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=n, eos_token_id=None if eos == -1 else eos,
                                     pad_token_id=0, **extra)
        s = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        return toks, s, {"new_tokens": len(toks)}, None

    return call, lambda ids, n: (len(ids), n)


def _next_context(model, ctx: list[int], answer: list[int], turn_text) -> list[int]:
    return ctx + list(answer) + encode(model, TURN_SEPARATOR + turn_text, first=False) \
        if isinstance(turn_text, str) else ctx + list(answer) + list(turn_text)


@dataclasses.dataclass
class _Runner:
    """One method's state through a bench: its caller, its prompts' first turns as ids, its
    warm-up, its calls so far and the pool its pass carries from call to call."""

    run: MethodRun
    call: Any
    shape_key: Any
    first: list
    limit: int
    compile_s: float = 0.0
    n_warm: int = 0
    calls: list = dataclasses.field(default_factory=list)
    pool: Any = None


def _runner(run: MethodRun, target, draft, prompts: list[Prompt], eos, hf) -> _Runner:
    if run.kind == "hf":
        call, shape_key = _hf_caller(run, hf, eos)
    else:
        call, shape_key = _oj_caller(run, target, draft, eos)
    limit = target.config.max_position_embeddings
    first = [_fit(encode(target, p.turns[0]), p.max_new_tokens, limit) for p in prompts]
    return _Runner(run, call, shape_key, first, limit)


def _warm_up(rn: _Runner, prompts: list[Prompt]) -> None:
    """One call per distinct compiled shape of the first turns (torch: one short call), timed
    as the method's compile_seconds."""
    clock = CompileClock.get()
    clock.take()
    t0 = time.perf_counter()
    warm = {}
    for ids, p in zip(rn.first, prompts):
        k = rn.shape_key(ids, p.max_new_tokens)
        if k not in warm and (rn.run.kind == "oj" or not warm):
            warm[k] = True
            rn.call(ids, p.max_new_tokens if rn.run.kind == "oj" else min(8, p.max_new_tokens),
                    None)
    rn.compile_s, rn.n_warm = time.perf_counter() - t0, len(warm)
    clock.take()


def _run_prompt(rn: _Runner, target, i: int, p: Prompt, repeat: int, progress=None) -> None:
    """Every turn of prompt i (p) once, timed; the pool carried on within the pass."""
    clock = CompileClock.get()
    ctx = rn.first[i]
    for t, turn in enumerate(p.turns):
        if t > 0:
            ctx = _fit(_next_context(target, ctx, rn.calls[-1].tokens, turn), p.max_new_tokens,
                       rn.limit)
        clock.take()
        toks, secs, stats, rn.pool = rn.call(ctx, p.max_new_tokens, rn.pool)
        comp = clock.take()
        # config="auto" is measured as users get it: whatever it compiles or probes after the
        # warm-up call is part of its calls' time
        if not rn.run.charges_compiles:
            secs = max(secs - comp, 1e-9)
        rn.calls.append(_Call(p.id, p.task, t, repeat, toks, secs, comp, stats, len(ctx)))
        if progress is not None:
            progress.update(1)


def run_method(run: MethodRun, target, draft, prompts: list[Prompt], *, repeats: int = 1,
               eos: int = -1, hf: Optional[_HFModels] = None, progress=None,
               settle: float = 0.0) -> tuple[dict, list]:
    """Runs one method over the prompts; returns (summary dict, list of _Call).

    settle: seconds of idle before measuring. Thread pools of the previous method (XLA's,
    torch's OpenMP) keep competing for the cores for a moment after their work; on a small
    machine that slows whatever runs next."""
    rn = _runner(run, target, draft, prompts, eos, hf)
    _warm_up(rn, prompts)
    freeze_heap()  # what lives from here on is the run's: full GC passes skip it (heap.py)
    if settle > 0:
        time.sleep(settle)
    for r in range(repeats):
        rn.pool = None  # each pass starts from an empty pool
        for i, p in enumerate(prompts):
            _run_prompt(rn, target, i, p, r, progress)
    return _summarize(run, rn.calls, rn.compile_s, rn.n_warm), rn.calls


def _charge_background(auto_runner: _Runner) -> None:
    """Waits out any loop config="auto" compiles in the background (`auto.switch`) and adds
    the wait to the last auto call's time: interleaved, that compile would otherwise overlap
    another method's timed call. Charged whole, as if it had run serially: an upper bound of
    what the auto user's next calls lose to it (they share the cores with it)."""
    from ..auto import wait_for_background

    t0 = time.perf_counter()
    wait_for_background()
    if auto_runner.calls:
        auto_runner.calls[-1].seconds += time.perf_counter() - t0


def run_interleaved(runs: list[MethodRun], target, draft, prompts: list[Prompt], *,
                    repeats: int = 1, eos: int = -1, progress=None, settle: float = 0.0
                    ) -> list[tuple[dict, list]]:
    """This project's methods timed side by side: every method's warm-up first, then each
    prompt of each pass run by every method in turn, so that a machine that slows down or
    speeds up during the bench (10-15% within one run on a shared 2-core VM: vanilla timed
    first ran 14% faster than the same loop timed ten minutes later) weighs on every row
    alike. Returns run_method's (summary, calls) per run, in order."""
    runners = [_runner(r, target, draft, prompts, eos, None) for r in runs]
    growth = []
    for rn in runners:
        if progress is not None:
            progress.set_description(f"bench warm-up {rn.run.label}")
        rss0 = _peak_rss_mib()
        _warm_up(rn, prompts)
        growth.append(_peak_rss_mib() - rss0)
    if progress is not None:
        progress.set_description("bench (methods interleaved)")
    freeze_heap()  # full GC passes skip the warmed-up heap (heap.py)
    if settle > 0:
        time.sleep(settle)
    last_auto = None
    for r in range(repeats):
        for rn in runners:
            rn.pool = None  # each pass starts from an empty pool
        for i, p in enumerate(prompts):
            for rn in runners:
                if not rn.run.charges_compiles and last_auto is not None:
                    _charge_background(last_auto)
                _run_prompt(rn, target, i, p, r, progress)
                if rn.run.charges_compiles:
                    last_auto = rn
    if last_auto is not None:  # nothing compiles behind the peers' calls either
        _charge_background(last_auto)
    out = []
    for rn, g in zip(runners, growth):
        summary = _summarize(rn.run, rn.calls, rn.compile_s, rn.n_warm)
        # ru_maxrss is the process's high-water mark: what the method's warm-up added to it
        summary["peak_rss_growth_mib"] = g
        out.append((summary, rn.calls))
    return out


def summed_histograms(histograms) -> list:
    """Element-wise sum of per-call acceptance histograms, shorter ones padded with zeros:
    config="auto" may size each call differently (gamma 3, then 4, or vanilla's 2 bins)."""
    hs = [np.asarray(h) for h in histograms]
    out = np.zeros(max(len(h) for h in hs), dtype=np.int64)
    for h in hs:
        out[:len(h)] += h.astype(np.int64)
    return out.tolist()


def _summarize(run: MethodRun, calls: list[_Call], compile_s: float, n_warm: int) -> dict:
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
        "peak_rss_mib": _peak_rss_mib(),
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


# -- the whole bench -------------------------------------------------------------------------


def _compare(calls: list, ref: dict) -> tuple[bool, list]:
    bad = []
    for c in calls:
        if c.repeat == 0 and ref.get((c.id, c.turn)) != list(c.tokens):
            bad.append(f"{c.id}#turn{c.turn}")
    return not bad, bad


def run_bench(target, draft, prompts: list[Prompt], runs: list[MethodRun], *, repeats: int = 1,
              ignore_eos: bool = False, progress: bool = True, log=None,
              settle: float = 0.0) -> dict:
    """All `runs` on `prompts` (order kept) in this process -> results dict (see module doc).

    "vanilla" is run first whatever its place in `runs` (it is the reference); a run whose
    method is not registered, or a peer that cannot be built, is skipped with the reason in
    results["skipped"]."""
    from ..decoding import METHODS

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    eos = -1
    if not ignore_eos:
        from ..request import default_eos_ids

        e = default_eos_ids(target)  # one id, a tuple of ids, or None
        eos = -1 if e is None else (list(e) if isinstance(e, tuple) else int(e))
    runs = sorted(runs, key=lambda r: r.label != "vanilla")
    if not runs or runs[0].label != "vanilla":
        runs.insert(0, MethodRun("vanilla", "vanilla"))
    skipped: dict[str, str] = {}
    ok_runs = []
    hf = None
    for r in runs:
        if r.kind == "oj" and r.method not in METHODS:
            skipped[r.label] = (f"method {r.method!r} is not registered in "
                                f"ouroboros_jax.decoding.METHODS ({sorted(METHODS)})")
        elif r.kind == "oj" and METHODS[r.method].needs_draft and draft is None:
            skipped[r.label] = "needs a draft model"
        elif r.kind == "hf":
            if r.method not in HF_PEERS:
                skipped[r.label] = f"unknown peer {r.method!r}"
                continue
            try:
                hf = hf or _HFModels(target, draft)
                if r.method == "hf-assisted" and not hf.has_draft:
                    raise FileNotFoundError("no draft HF directory")
                ok_runs.append(r)
            except (ImportError, OSError) as e:
                skipped[r.label] = f"transformers peer unavailable: {e}"
        else:
            ok_runs.append(r)
    for k, v in skipped.items():
        log(f"[bench] skipping {k}: {v}")
    ok_runs.sort(key=lambda r: r.kind == "hf")  # peers last: they load their copies then

    n_calls = sum(len(p.turns) for p in prompts) * repeats
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_calls * len(ok_runs), file=sys.stderr, unit="call", desc="bench",
                   dynamic_ncols=True)
    methods: dict[str, dict] = {}
    ref: dict = {}
    hf_greedy_tps = None
    ours = [r for r in ok_runs if r.kind == "oj"]
    done = run_interleaved(ours, target, draft, prompts, repeats=repeats, eos=eos, progress=bar,
                           settle=settle)
    for r in ok_runs[len(ours):]:  # peers after: torch's threads would slow the next JAX call
        if bar is not None:
            bar.set_description(f"bench {r.label}")
        rss0 = _peak_rss_mib()
        summary, calls = run_method(r, target, draft, prompts, repeats=repeats, eos=eos, hf=hf,
                                    progress=bar, settle=settle)
        # ru_maxrss is the process's high-water mark: growth is what this method added to it
        summary["peak_rss_growth_mib"] = summary["peak_rss_mib"] - rss0
        done.append((summary, calls))
    for r, (summary, calls) in zip(ok_runs, done):
        try:  # other processes' load on a shared machine skews timings: keep it with them
            summary["load_average_after"] = list(os.getloadavg())
        except OSError:
            pass
        if r.label == "vanilla":
            ref = {(c.id, c.turn): list(c.tokens) for c in calls if c.repeat == 0}
        summary["identical"], summary["mismatches"] = _compare(calls, ref)
        methods[r.label] = summary
        if r.method == "hf-greedy":
            hf_greedy_tps = summary["tokens_per_second"]
    if bar is not None:
        bar.close()
    van = methods["vanilla"]
    for s in methods.values():
        s["speedup"] = (s["tokens_per_second"] / van["tokens_per_second"]
                        if s["tokens_per_second"] and van["tokens_per_second"] else None)
        s["speedup_vs_transformers_greedy"] = (s["tokens_per_second"] / hf_greedy_tps
                                               if hf_greedy_tps and s["tokens_per_second"]
                                               else None)
        for task, t in s["per_task"].items():
            vt = van["per_task"].get(task, {}).get("tokens_per_second")
            t["speedup"] = t["tokens_per_second"] / vt if vt and t["tokens_per_second"] else None
    tasks: dict[str, int] = {}
    for p in prompts:
        tasks[p.task] = tasks.get(p.task, 0) + 1
    return {
        "schema": 1,
        "environment": environment(),
        "settings": {"repeats": repeats, "ignore_eos": ignore_eos, "eos_token_id": eos,
                     "settle_seconds": settle,
                     "prompt_order": [p.id for p in prompts],
                     "target": model_info(target),
                     "draft": model_info(draft) if draft is not None else None,
                     "batch": 1, "greedy": True},
        "workload": {"tasks": tasks,
                     "prompts": [{"id": p.id, "task": p.task, "turns": len(p.turns),
                                  "max_new_tokens": p.max_new_tokens} for p in prompts]},
        "methods": methods,
        "skipped": skipped,
    }
