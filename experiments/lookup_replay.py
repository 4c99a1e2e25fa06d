"""Which prompt-lookup config drafts the most accepted tokens? Result: docs/methods.md ("Prompt
lookup") and the default config in ouroboros_jax/decoding/prompt_lookup.py.

Prompt lookup's candidates replayed over vanilla's greedy outputs: tokens per target forward
(eta) for each config, beside what an oracle choosing candidates could reach, with no timing.

    python -m experiments.lookup_replay --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --spec-bench ../shared/data/spec_bench/question.jsonl --per-task 3 \
        --configs 1x4,1x8,1x16,2x4,2x8,3x4

Greedy prompt lookup emits exactly vanilla's tokens, so its rounds follow from vanilla's output
alone: at each round the method's own `find_candidates` proposes X candidates of M tokens from
prompt + output so far, the round accepts the longest prefix of any candidate that equals the
output's next tokens, plus the target's own token. So eta per config costs one vanilla call
per prompt and no forward per config; it is what `generate(method="prompt_lookup")` measures as
tokens per target call (`test_bench.py` checks the two agree).

The oracle takes, at each round, the longest span of the context so far (any start) that
equals the output's next tokens, up to M: no candidate ranking reaches more, so it bounds what
better ranking could add. Speed on a device is eta over the cost of a 1 + X*M token forward
relative to a 1-token one (`experiments/cpu_forward.py --sizes`).

Prints one JSON object: per config and task the mean eta, and the oracle's per M.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def replay_eta(prompt: list[int], out: list[int], cfg, find=None) -> float:
    """Tokens per round greedy prompt lookup with `cfg` (a PromptLookupConfig) takes to emit
    `out` after `prompt`. find: a jitted `find_candidates` for cfg (made here when None)."""
    import jax
    import jax.numpy as jnp

    from ouroboros_jax.decoding.prompt_lookup import find_candidates

    if not out:
        return 0.0
    if find is None:
        find = jax.jit(lambda t, n: find_candidates(t, n, cfg))
    row = np.zeros(len(prompt) + len(out) + cfg.length + 1, np.int32)
    row[:len(prompt)] = prompt
    row[len(prompt):len(prompt) + len(out)] = out
    done = rounds = 0
    while done < len(out):
        cand, valid = find(jnp.asarray(row[None]), jnp.asarray([len(prompt) + done], jnp.int32))
        cand, valid = np.asarray(cand[0]), np.asarray(valid[0])
        best = 0
        for x in range(cfg.candidates):
            a = 0
            while (a < cfg.length and done + a < len(out) and valid[x, a]
                   and cand[x, a] == out[done + a]):
                a += 1
            best = max(best, a)
        done += min(best + 1, len(out) - done)
        rounds += 1
    return len(out) / rounds


def oracle_eta(prompt: list[int], out: list[int], length: int) -> float:
    """Tokens per round when each round's one candidate is the best span of the context so far
    (up to `length` tokens equal to the output's next ones, any start)."""
    if not out:
        return 0.0
    row = list(prompt) + list(out)
    done = rounds = 0
    while done < len(out):
        ctx_len = len(prompt) + done
        best = 0
        for j in range(ctx_len):
            a = 0
            while (a < length and done + a < len(out) and j + a < ctx_len
                   and row[j + a] == out[done + a]):
                a += 1
            best = max(best, a)
        done += min(best + 1, len(out) - done)
        rounds += 1
    return len(out) / rounds


def parse_configs(text: str) -> list[tuple[int, int]]:
    """"XxM,XxM" -> [(candidates, length), ...]."""
    out = []
    for item in text.split(","):
        x, sep, m = item.strip().partition("x")
        if not sep or not x.isdigit() or not m.isdigit() or int(x) < 1 or int(m) < 1:
            raise SystemExit(f"--configs: each item must be CANDIDATESxLENGTH with both >= 1 "
                             f"(e.g. 2x8), got {item!r}")
        out.append((int(x), int(m)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.lookup_replay",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model directory or GGUF")
    ap.add_argument("--spec-bench", help="Spec-Bench question.jsonl (summarization + RAG)")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--configs", default="1x4,1x8,1x16,2x4,2x8,3x4",
                    help="CANDIDATESxLENGTH items, comma-separated")
    a = ap.parse_args(argv)
    configs = parse_configs(a.configs)
    for name in ("per_task", "max_new_tokens", "max_ngram"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    import jax

    import ouroboros_jax as oj
    from ouroboros_jax.decoding.prompt_lookup import PromptLookupConfig, find_candidates
    from experiments.copy_heavy import chat_ids
    from ouroboros_jax.bench.workloads import copy_heavy_prompts, limit_per_task

    target = oj.load_model(a.target)
    prompts = limit_per_task(copy_heavy_prompts(a.spec_bench), a.per_task)
    runs = []
    for i, p in enumerate(prompts):
        ids = chat_ids(target, p.turns[0])
        out = oj.generate(target, [ids], max_new_tokens=a.max_new_tokens, method="vanilla")
        runs.append((p.task, ids, [int(t) for t in out.tokens[0]]))
        print(f"[lookup_replay] vanilla {i + 1}/{len(prompts)} ({p.task})", file=sys.stderr,
              flush=True)
    tasks = list(dict.fromkeys(t for t, _, _ in runs))

    def by_task(eta_of) -> dict:
        per = {t: float(np.mean([eta_of(ids, out) for task, ids, out in runs if task == t]))
               for t in tasks}
        return {**{t: round(v, 3) for t, v in per.items()},
                "mean": round(float(np.mean(list(per.values()))), 3)}

    res = {"command": "python -m experiments.lookup_replay " + " ".join(
        sys.argv[1:] if argv is None else argv), "prompts": len(runs),
        "new_tokens": sum(len(o) for _, _, o in runs), "eta": {}, "oracle_eta": {}}
    for x, m in configs:
        cfg = PromptLookupConfig(max_ngram=a.max_ngram, candidates=x, length=m)
        find = jax.jit(lambda t, n, cfg=cfg: find_candidates(t, n, cfg))
        res["eta"][f"{x}x{m}"] = by_task(lambda ids, out: replay_eta(ids, out, cfg, find))
    for m in sorted({m for _, m in configs}):
        res["oracle_eta"][str(m)] = by_task(lambda ids, out: oracle_eta(ids, out, m))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
