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
import sys
import time
from typing import Any, Optional

from ..heap import freeze_heap
from .peers import HF_PEERS, HFModels, hf_caller
from .records import Call, environment, model_info, peak_rss_mib, summarize
from .workloads import Prompt
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


# -- one method ------------------------------------------------------------------------------


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
        from ..request import bucket, prompt_bucket

        cfg = spec.default_config() if run.config in (None, "auto") else run.config
        P = prompt_bucket(len(ids))
        return P, bucket(P + n + spec.margin(cfg), minimum=64)

    return call, shape_key


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
        call, shape_key = hf_caller(run, hf, eos)
    else:
        call, shape_key = _oj_caller(run, target, draft, eos)
    limit = target.config.max_position_embeddings
    first = [_fit(encode(target, p.turns[0]), p.max_new_tokens, limit) for p in prompts]
    return _Runner(run, call, shape_key, first, limit)


def _warm_up(rn: _Runner, prompts: list[Prompt]) -> None:
    """One call per distinct compiled shape of the first turns (torch: one short call), timed
    as the method's compile_seconds."""
    from ..auto import warming_up

    clock = CompileClock.get()
    clock.take()
    t0 = time.perf_counter()
    warm = {}
    with warming_up():  # (each method compiles its own choice, not another's loop)
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
        rn.calls.append(Call(p.id, p.task, t, repeat, toks, secs, comp, stats, len(ctx)))
        if progress is not None:
            progress.update(1)


def run_method(run: MethodRun, target, draft, prompts: list[Prompt], *, repeats: int = 1,
               eos: int = -1, hf: Optional[HFModels] = None, progress=None,
               settle: float = 0.0) -> tuple[dict, list]:
    """Runs one method over the prompts; returns (summary dict, list of `Call`).

    settle: seconds of idle before measuring. Thread pools of the previous method (XLA's,
    torch's OpenMP) keep competing for the cores for a moment after their work; on a small
    machine that slows whatever runs next."""
    return run_interleaved([run], target, draft, prompts, repeats=repeats, eos=eos, hf=hf,
                           progress=progress, settle=settle)[0]


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
                    repeats: int = 1, eos: int = -1, hf: Optional[HFModels] = None,
                    progress=None, settle: float = 0.0) -> list[tuple[dict, list]]:
    """This project's methods timed side by side: every method's warm-up first, then each
    prompt of each pass run by every method in turn, so that a machine that slows down or
    speeds up during the bench (10-15% within one run on a shared 2-core VM: vanilla timed
    first ran 14% faster than the same loop timed ten minutes later) weighs on every row
    alike. Returns (summary, calls) per run, in order."""
    runners = [_runner(r, target, draft, prompts, eos, hf) for r in runs]
    growth = []
    for rn in runners:
        if progress is not None:
            progress.set_description(f"bench warm-up {rn.run.label}")
        rss0 = peak_rss_mib()
        _warm_up(rn, prompts)
        growth.append(peak_rss_mib() - rss0)
    if progress is not None and len(runners) > 1:
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
        summary = summarize(rn.run, rn.calls, rn.compile_s, rn.n_warm)
        # ru_maxrss is the process's high-water mark: what the method's warm-up added to it
        summary["peak_rss_growth_mib"] = g
        out.append((summary, rn.calls))
    return out


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
                hf = hf or HFModels(target, draft)
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
        rss0 = peak_rss_mib()
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
