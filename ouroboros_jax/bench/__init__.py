"""Benchmarks (speed is claimed here, side by side in one run, never in unit tests).

  workloads.py   Spec-Bench / HumanEval / jsonl / demo prompt readers, generation length per task
  configs.py     method names -> MethodRuns: paper or --quick configs, overrides, Table 4 steps
  pair.py        the target/draft pair: given directories, the demo pair, or a tiny random pair
  runner.py      every method (and transformers peers) on the same prompts in one process
  cost_model.py  predicted speedup from counted forwards and a per-forward latency table
  sweeps.py      K, gamma, pool capacity, history/order, generation length
  tune.py        `ouroboros-jax tune`: the paper's Algorithm 1
  report.py      markdown table and PNG plots
  suite.py       `ouroboros-jax bench`: all of the above -> results.json, results.md, *.png

Only `suite.bench_main` and `tune.tune_main` see argparse namespaces; every other function takes
plain arguments (a `WorkloadSpec` for the prompts).

    from ouroboros_jax.bench import run_suite, method_runs, read_spec_bench
    res = run_suite(target, draft, read_spec_bench("question.jsonl"),
                    method_runs(["vanilla", "ouroboros", "peers"]))
"""

from .configs import method_runs
from .runner import MethodRun, run_bench
from .suite import run_suite
from .workloads import (Prompt, demo_code_prompts, read_humaneval, read_prompt_jsonl,
                        read_spec_bench)

__all__ = ["MethodRun", "Prompt", "demo_code_prompts", "method_runs", "read_humaneval",
           "read_prompt_jsonl", "read_spec_bench", "run_bench", "run_suite"]
