"""Benchmarks (speed is claimed here, side by side in one run, never in unit tests): what
`ouroboros-jax bench` and `ouroboros-jax tune` run. bench/README.md maps the modules; one-off
experiments live outside the package, in the repository's experiments/ folder.

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
