"""What is the most speculative decoding can reach on this device and pair? Result:
docs/real-pair.md ("The bound on this CPU"). The bound behind a speed gate.

    python -m experiments.spec_bound --target T.gguf --draft D.gguf --prompts 3 \\
        --max-new-tokens 128 --gammas 2 4 6 8

A speculative round costs at least its forwards: gamma one-token draft steps and one target
forward of gamma + 1 tokens. Measured here, on the pair and device at hand:

- the round's forwards back to back in one compiled loop, with nothing between them
  (`models.timing.sequence_timer`, after a prompt-long cache): the draft's cache as the
  target's forward leaves it, no sampling, no accept walk, no commit; and vanilla's step, the
  target's 1-token forward, the same way;
- both prefills (each model's forward over the padded prompt);
- the pair's agreement by depth, from the acceptance histogram of one greedy speculative call
  per prompt at the deepest gamma (`cost.depth_counts`), and from it each gamma's expected
  tokens per round (`cost.chain_tokens`).

Per gamma the bound is eta * t_step / t_round (decode alone), and with both prefills over a call
of N new tokens (p_T + N t_step) / (p_T + p_S + N / eta * t_round). A loop also pays its round's
work outside the forwards, so no loop on this device beats the bound. `--measure` runs vanilla
and speculative at the best gamma on the same prompts (wall clock, after a first call), beside
it, with each loop's measured time per round against its forwards'. Prints a table, and
one JSON object with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def say(what: str) -> None:
    """Progress on stderr: each step compiles and runs seconds to minutes on a CPU."""
    print(f"spec_bound: {what}", file=sys.stderr, flush=True)


def seconds(steps: list, context: int, slots: int, reps: int) -> float:
    """Median seconds of `steps` [(model, tokens), ...] back to back in one compiled loop
    (`models.timing.sequence_timer`)."""
    from ouroboros_jax.models.timing import sequence_timer

    timer = sequence_timer(steps, context, slots, inner=2)
    return statistics.median(timer() for _ in range(reps))


def round_seconds(target, draft, gamma: int, context: int, slots: int, reps: int) -> float:
    """One round's forwards: gamma 1-token draft forwards, then the target's gamma + 1."""
    return seconds([(draft, 1)] * gamma + [(target, gamma + 1)], context, slots, reps)


def forward_seconds(model, n: int, context: int, slots: int, reps: int) -> float:
    return seconds([(model, n)], context, slots, reps)


def agreement(target, draft, ids: list, gamma: int, new: int):
    """(DepthAgreement, rounds) over greedy speculative calls at `gamma`, one per prompt."""
    import ouroboros_jax as oj

    from ouroboros_jax.decoding.cost import DepthAgreement, depth_counts

    counts = [[0, 0] for _ in range(gamma)]
    for row in ids:
        out = oj.generate(target, [row], draft=draft, method="speculative",
                          config=oj.SpeculativeConfig(gamma=gamma), max_new_tokens=new,
                          eos_token_id=-1)
        for k, (r, a) in enumerate(depth_counts(out.stats["acceptance_histogram"], gamma)):
            counts[k] = [counts[k][0] + r, counts[k][1] + a]
    by = tuple(a / r if r else 0.0 for r, a in counts)
    return DepthAgreement(by, by[-1]), counts[0][0]


def bound_rows(gammas, a, t_step: float, rounds: dict, p_t: float, p_s: float, new: int) -> list:
    """Per gamma: expected tokens per round, round seconds, and the bounds (pure arithmetic)."""
    from ouroboros_jax.decoding.cost import chain_tokens

    rows = []
    for g in gammas:
        eta = chain_tokens(a, g)
        rows.append({"gamma": g, "eta": eta, "round_ms": 1e3 * rounds[g],
                     "decode_bound": eta * t_step / rounds[g],
                     "call_bound": (p_t + new * t_step) / (p_t + p_s + new / eta * rounds[g])})
    return rows


def measure(target, draft, ids: list, gamma: int, new: int, prefill: dict) -> dict:
    """Wall-clock tokens/s of vanilla and speculative(gamma) over the prompts, after a first
    call of each (its compile), interleaved prompt by prompt; and each loop's seconds per
    round, its calls' loop time (prefill to result, `stats["decode_seconds"]`) less the
    prefills' measured seconds (`prefill`: {"vanilla": p_T, "speculative": p_T + p_S})."""
    import ouroboros_jax as oj

    kw = dict(max_new_tokens=new, eos_token_id=-1)
    runs = {"vanilla": dict(), "speculative": dict(draft=draft, method="speculative",
                                                   config=oj.SpeculativeConfig(gamma=gamma))}
    for r in runs.values():
        oj.generate(target, [ids[0]], **r, **kw)
    secs, loop, rounds = ({k: 0.0 for k in runs} for _ in range(3))
    for row in ids:
        for k, r in runs.items():
            t0 = time.perf_counter()
            out = oj.generate(target, [row], **r, **kw)
            secs[k] += time.perf_counter() - t0
            loop[k] += out.stats["decode_seconds"] - prefill[k]
            rounds[k] += out.stats["target_calls"]
    tps = {k: new * len(ids) / s for k, s in secs.items()}
    # a round of the loop as it runs (its forwards, and everything else it does), beside the
    # bound's round of forwards alone
    return {"gamma": gamma, "tokens_per_second": tps,
            "speculative_x_vanilla": tps["speculative"] / tps["vanilla"],
            "eta": new * len(ids) / rounds["speculative"],
            "loop_ms_per_round": {k: 1e3 * loop[k] / rounds[k] for k in runs}}


def run(target, draft, texts: list, gammas: list, new: int, reps: int, do_measure: bool) -> dict:
    from ouroboros_jax.request import cache_slots, pad_prompts

    ids = [list(target.tokenizer(t)["input_ids"]) for t in texts]
    width = pad_prompts(ids)[0].shape[1]
    slots = cache_slots(width, new, max(gammas) + 1)
    context = width + new // 2  # the middle of a call's decoding
    say(f"agreement: {len(ids)} greedy speculative calls at gamma {max(gammas)}")
    a, n_rounds = agreement(target, draft, ids, max(gammas), new)
    say("vanilla's step: the target's 1-token forward")
    t_step = forward_seconds(target, 1, context, slots, reps)
    rounds = {}
    for g in gammas:
        say(f"gamma {g}: {g} draft steps and a {g + 1}-token verification, back to back")
        rounds[g] = round_seconds(target, draft, g, context, slots, reps)
    say(f"prefills of {width} tokens")
    p_t = forward_seconds(target, width, 0, slots, reps)
    p_s = forward_seconds(draft, width, 0, slots, reps)
    rows = bound_rows(gammas, a, t_step, rounds, p_t, p_s, new)
    res = {"prompts": len(ids), "prompt_width": width, "max_new_tokens": new,
           "agreement_by_depth": list(a.by_depth), "agreement_rounds": n_rounds,
           "target_step_ms": 1e3 * t_step, "prefill_ms": {"target": 1e3 * p_t, "draft": 1e3 * p_s},
           "rows": rows}
    if do_measure:
        best = max(rows, key=lambda r: r["call_bound"])["gamma"]
        say(f"measuring vanilla and speculative at gamma {best} (wall clock)")
        res["measured"] = measure(target, draft, ids, best, new,
                                  {"vanilla": p_t, "speculative": p_t + p_s})
    return res


def table(res: dict) -> str:
    a = ", ".join(f"{x:.2f}" for x in res["agreement_by_depth"])
    out = [f"{res['prompts']} prompts (width {res['prompt_width']}), {res['max_new_tokens']} new "
           f"tokens; agreement by depth {a} ({res['agreement_rounds']} rounds)",
           f"target step {res['target_step_ms']:.0f} ms; prefill target "
           f"{res['prefill_ms']['target']:.0f} ms, draft {res['prefill_ms']['draft']:.0f} ms",
           f"{'gamma':>5}{'eta':>7}{'round ms':>10}{'bound, decode':>15}{'bound, call':>13}"]
    for r in res["rows"]:
        out.append(f"{r['gamma']:>5}{r['eta']:>7.2f}{r['round_ms']:>10.0f}"
                   f"{r['decode_bound']:>14.2f}x{r['call_bound']:>12.2f}x")
    m = res.get("measured")
    if m:
        r = m["loop_ms_per_round"]
        bound = next(x for x in res["rows"] if x["gamma"] == m["gamma"])
        out.append(f"measured at gamma {m['gamma']}: speculative {m['speculative_x_vanilla']:.2f}x "
                   f"vanilla ({m['tokens_per_second']['vanilla']:.2f} tok/s vanilla, wall clock), "
                   f"eta {m['eta']:.2f}")
        out.append(f"  the loop's round: {r['speculative']:.0f} ms (its forwards alone "
                   f"{bound['round_ms']:.0f}); vanilla's step {r['vanilla']:.0f} ms (its forward "
                   f"alone {res['target_step_ms']:.0f})")
    return "\n".join(out)


def main(argv=None):
    import ouroboros_jax as oj

    from experiments.auto_check import CODE_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target GGUF or checkpoint")
    ap.add_argument("--draft", required=True, help="draft GGUF or checkpoint")
    ap.add_argument("--prompts", type=int, default=3, help=f"code prompts (1-{len(CODE_PROMPTS)})")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--measure", action="store_true", help="also run vanilla and the best gamma")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not 1 <= a.prompts <= len(CODE_PROMPTS):
        ap.error(f"--prompts must be 1-{len(CODE_PROMPTS)}, got {a.prompts}")
    for name in ("max_new_tokens", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if min(a.gammas) < 1:
        ap.error(f"--gammas must be >= 1, got {min(a.gammas)}")
    for flag in ("target", "draft"):
        if not os.path.exists(getattr(a, flag)):
            ap.error(f"--{flag}: no such file or directory: {getattr(a, flag)}")
    target = oj.load_model(a.target, dtype="float32")
    draft = oj.load_model(a.draft, dtype="float32")
    res = run(target, draft, CODE_PROMPTS[:a.prompts], sorted(set(a.gammas)), a.max_new_tokens,
              a.reps, a.measure)
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
