"""What does an Ouroboros round cost, mechanism by mechanism, against the price of its forwards?
Result: docs/real-pair.md ("Ouroboros on this CPU, mechanism by mechanism"); the fit on measured
device latencies: docs/bench/device-h200.md, section 4.

    python -m experiments.round_cost --prompts 2 --max-new-tokens 48 --reps 2
    python -m experiments.round_cost --target T.gguf --draft D.gguf --prompts 2 \\
        --max-new-tokens 48 --reps 2 --gamma 4 --window 4 --ngram 4 --guesses 4 --suffixes 2

Rows, all run in one process, interleaved per repetition (batch 1, greedy, EOS ignored, code
prompts; every row's tokens are checked against the first row's):

  speculative   SpeculativeConfig(gamma)
  SD            Ouroboros with every mechanism off (the ablation's SD step): the same forwards
                as speculative's, so the same time per round (+-5% is the bar)
  +phrase       phrase drafting only          +lengthen  lengthening only
  +recycle      recycling only                +context   context phrases only
  all           every mechanism on

For each row and repetition: the measured seconds per round (call seconds minus the prefills'
timed forwards, over target forwards), and, timed in the same minute after the runs, the price
of the forwards the row counted (`forward price`: t_T(n_T) + draft forwards per round x
t_S(n_S) + the round's first draft forward's extra t_S1(n_S1) - t_S(n_S), each forward timed at
its compiled size, logits only where the round asks for them), and the cost model's price
(`model price`: decoding/cost.py's `round_seconds` with the method's `RoundModel` at the
agreement speculative realised, on the same latency table). measured / forward price near 1
says the round costs its forwards and nothing else. Also printed: each row's compile time
(first call minus the median later call) and, as a projection (never a measurement), the
speed-up over speculative the same counted forwards give with flat latencies (an accelerator:
every forward costs its model's weights, whatever its size; `cost_model.weights_bound_table`).

Default models: the demo pair. --target/--draft: model directories or GGUF files (fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

ROWS = ("speculative", "SD", "+phrase", "+lengthen", "+recycle", "+context", "all")
OFF = dict(phrase_drafting=False, lengthening=False, recycling=False, context_phrases=False)
SINGLE = {"+phrase": "phrase_drafting", "+lengthen": "lengthening", "+recycle": "recycling",
          "+context": "context_phrases"}


def row_config(row: str, gamma: int, window: int, ngram: int, guesses: int, suffixes: int):
    """The config of a row (see the module docstring)."""
    import ouroboros_jax as oj

    if row == "speculative":
        return oj.SpeculativeConfig(gamma=gamma)
    knobs = dict(gamma=gamma, window=window, ngram=ngram, guesses=guesses, suffixes=suffixes)
    if row == "all":
        return oj.OuroborosConfig(**knobs)
    if row == "SD":
        return oj.OuroborosConfig(**knobs, **OFF)
    if row in SINGLE:
        return oj.OuroborosConfig(**knobs, **{**OFF, SINGLE[row]: True})
    raise ValueError(f"--rows: unknown row {row!r}; choose from {', '.join(ROWS)}")


def forward_shapes(cfg) -> dict:
    """{"t": (n_T,), "s": (n_S, q) or None, "s1": (n_S1, q) or None}: the sizes of the round's
    target forward, its draft forwards and its first draft forward, with q the nodes whose
    logits the draft forward computes (None: all)."""
    from ouroboros_jax.decoding import METHODS

    name = "speculative" if not hasattr(cfg, "window") else "ouroboros"
    n_t, n_s, n_s1 = METHODS[name].forward_sizes(cfg)
    if name == "ouroboros" and cfg.phrase_drafting:
        q = 1 + cfg.window + cfg.guesses * (cfg.ngram - 1)  # last, window tails, guesses
    else:
        q = 1
    return {"t": (n_t,), "s": (n_s, q), "s1": (n_s1, q)}


def round_price(shapes: dict, rounds: float, draft_forwards: float, lat: dict) -> float:
    """Seconds per round of the counted forwards: lat maps ("t", n_T), ("s", n_S, q) and
    ("ts1", n_T, n_S1, q) (a target forward then a round's first draft forward) to seconds."""
    n_t = shapes["t"][0]
    t = lat[("t", n_t)]
    per_round = draft_forwards / max(rounds, 1)
    if per_round:
        s = lat[("s", *shapes["s"])]
        s1 = lat[("ts1", n_t, *shapes["s1"])] - t
        t += per_round * s + min(per_round, 1.0) * (s1 - s)
    return t


def flat_projection(rows: dict, target, draft) -> dict:
    """{row: projected speed-up over speculative} from the counted forwards with flat latencies
    (every forward costs its model's weight bytes: the accelerator regime). A projection."""
    def params(m):
        import jax
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(m.params))

    ratio = params(draft) / params(target)
    cost = {r: (v["target_calls"] + ratio * v["draft_forwards"]) / max(v["new_tokens"], 1)
            for r, v in rows.items()}
    base = cost.get("speculative")
    return {r: (base / c if base else None) for r, c in cost.items()}


def parse_ms(text: str, flag: str) -> dict:
    """"1:122,4:182" -> {1: 0.122, 4: 0.182} (tokens: milliseconds); ValueError naming flag."""
    try:
        out = {int(k): float(v) / 1e3 for k, v in (x.split(":") for x in text.split(","))}
    except ValueError:
        raise ValueError(f"{flag}: expected tokens:milliseconds pairs like 1:122,4:182, got "
                         f"{text!r}") from None
    if not out or any(n < 1 or t <= 0 for n, t in out.items()):
        raise ValueError(f"{flag}: sizes must be >= 1 and times > 0, got {text!r}")
    return out


def fit(tt: dict, td: dict, agreement: float, draft_ratio: float) -> list:
    """The cost model's best config per Ouroboros variant (config="auto"'s grid: default
    switches, then each `Variant`) and speculative's best gamma, priced on the latency tables
    tt / td ({tokens: seconds}) and on flat latencies (every forward costs its model's weights:
    target 1, draft draft_ratio) -> [(label, config, rate here / speculative's best here,
    rate flat / speculative's best flat)]. A projection from decoding/cost.py, not a
    measurement."""
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.cost import rate
    from ouroboros_jax.decoding.knobs import GAMMA

    flat_t, flat_d = {1: 1.0}, {1: draft_ratio}
    spec = METHODS["speculative"]
    import ouroboros_jax as oj

    def best(spec_, cfgs, t, d):
        return max((rate(spec_.forward_sizes(c), spec_.round_model(c, agreement), t, d), i)
                   for i, c in enumerate(cfgs))

    spec_cfgs = [oj.SpeculativeConfig(gamma=g) for g in GAMMA.auto]
    s_here, i_here = best(spec, spec_cfgs, tt, td)
    s_flat, _ = best(spec, spec_cfgs, flat_t, flat_d)
    rows = [("speculative", spec_cfgs[i_here], 1.0, 1.0)]
    ours = METHODS["ouroboros"]
    space = oj.OuroborosConfig.KNOBS
    groups = [("Ouroboros, every mechanism", space.grid(oj.OuroborosConfig))]
    for v in space.variants:
        if v.switches.get("free_drafts"):  # priced from a measured profile: not here
            continue
        off = [k for k, on in v.switches.items() if not on]
        label = ("Ouroboros SD (every mechanism off)" if len(off) == len(space.switches) - 1
                 else "Ouroboros, " + ", ".join(off) + " off")
        full = {**space.values("auto"), **{f: (x,) for f, x in v.pinned.items()}}
        groups.append((label, space.grid(oj.OuroborosConfig, full, fixed=v.switches)))
    for label, cfgs in groups:
        r_here, i = best(ours, cfgs, tt, td)
        r_flat, j = best(ours, cfgs, flat_t, flat_d)
        rows.append((label, cfgs[i], r_here / s_here, r_flat / s_flat, cfgs[j]))
    return rows


def speculative_vs_vanilla(tt: dict, td: dict, agreement: float) -> float:
    """Speculative's best rate on the latency tables over vanilla's (a projection)."""
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.cost import rate, vanilla_rate
    from ouroboros_jax.decoding.knobs import GAMMA
    from ouroboros_jax.decoding.speculative import SpeculativeConfig

    spec = METHODS["speculative"]
    best = max(rate(spec.forward_sizes(c), spec.round_model(c, agreement), tt, td)
               for c in (SpeculativeConfig(gamma=g) for g in GAMMA.auto))
    return best / vanilla_rate(tt)


def print_fit(rows: list, agreement: float) -> None:
    from ouroboros_jax.decoding.knobs import recipe_of

    print(f"\nFitted by the cost model (decoding/cost.py) at agreement {agreement:.3f}: the best "
          "config of each variant, rate vs speculative's best; a projection, not a measurement")
    print("| variant | best config here | vs speculative here | flat latencies (projection): "
          "vs speculative | best config flat |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        flat_cfg = recipe_of(r[4]) if len(r) > 4 else recipe_of(r[1])
        print(f"| {r[0]} | {recipe_of(r[1])} | {r[2]:.3f} | {r[3]:.3f} | {flat_cfg} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.round_cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="", help="target model directory or GGUF (default: "
                    "the demo pair)")
    ap.add_argument("--draft", default="", help="draft model directory or GGUF")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS))
    for k, v in (("gamma", 4), ("window", 4), ("ngram", 4), ("guesses", 4), ("suffixes", 2)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--json")
    ap.add_argument("--fit-only", action="store_true", help="no runs: print the cost model's "
                    "fitted configs from --target-ms/--draft-ms/--agreement/--draft-ratio")
    ap.add_argument("--target-ms", default="1:122,4:182,8:218,16:279",
                    help="--fit-only: target forward ms by tokens (default: the Qwen2.5-Coder "
                    "1.5B Q4_K measured on a 2-core CPU, issue 28)")
    ap.add_argument("--draft-ms", default="1:57,4:69,16:104",
                    help="--fit-only: draft forward ms by tokens (default: the 0.5B, ditto)")
    ap.add_argument("--agreement", type=float, default=0.9)
    ap.add_argument("--draft-ratio", type=float, default=494 / 1544,
                    help="--fit-only: draft / target parameters (flat latencies)")
    a = ap.parse_args(argv)
    if a.fit_only:
        try:
            tt, td = parse_ms(a.target_ms, "--target-ms"), parse_ms(a.draft_ms, "--draft-ms")
        except ValueError as e:
            ap.error(str(e))
        if not 0 < a.agreement < 1:
            ap.error(f"--agreement must be in (0, 1), got {a.agreement}")
        print_fit(fit(tt, td, a.agreement, a.draft_ratio), a.agreement)
        print(f"speculative's best here: {speculative_vs_vanilla(tt, td, a.agreement):.3f}x "
              "vanilla (a row's 'vs speculative here' times this is its speed-up over vanilla)")
        return 0
    for name in ("prompts", "max_new_tokens", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if bool(a.target) != bool(a.draft):
        ap.error("--target and --draft go together")
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    try:
        cfgs = {r: row_config(r, a.gamma, a.window, a.ngram, a.guesses, a.suffixes) for r in rows}
    except ValueError as e:
        ap.error(str(e))

    import jax

    import ouroboros_jax as oj
    from ouroboros_jax.decoding import METHODS
    from ouroboros_jax.decoding.cost import agreement_from_eta, round_seconds
    from ouroboros_jax.models.timing import sequence_timer
    from ouroboros_jax.request import bucket, cache_slots
    from ouroboros_jax.bench.workloads import demo_code_prompts

    t0 = time.perf_counter()
    if a.target:
        target = oj.load_model(a.target, dtype="float32")
        draft = oj.load_model(a.draft, dtype="float32")
    else:
        target, draft = oj.demo_pair("float32")
    print(f"[round_cost] models loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
          flush=True)
    texts = [p.turns[0] for p in demo_code_prompts()[:a.prompts]]
    ids = [target.tokenizer(t)["input_ids"] for t in texts]
    N = a.max_new_tokens
    slots = max(cache_slots(bucket(len(i)), N, METHODS["ouroboros"].margin(cfgs[r])
                            if r != "speculative" else a.gamma + 1) for i in ids for r in rows)
    context = int(np.mean([len(i) for i in ids])) + N // 2  # the runs' mean committed length
    name = {r: "speculative" if r == "speculative" else "ouroboros" for r in rows}
    shapes = {r: forward_shapes(cfgs[r]) for r in rows}

    def run(r):
        """One pass over the prompts -> (seconds, target calls, draft forwards, new tokens,
        tokens)."""
        secs = tc = df = nt = 0
        toks = []
        for i in ids:
            s0 = time.perf_counter()
            out = oj.generate(target, [i], draft=draft, method=name[r], config=cfgs[r],
                              max_new_tokens=N, eos_token_id=-1)
            secs += time.perf_counter() - s0
            st = out.stats
            tc += st["target_calls"]
            df += st.get("draft_forwards", st["draft_calls"])
            nt += st["new_tokens"]
            toks.append(out.tokens[0])
        return secs, tc, df, nt, toks

    # timers: every forward size the rows use, and the prefills
    timers = {}
    for r in rows:
        sh = shapes[r]
        n_t = sh["t"][0]
        timers.setdefault(("t", n_t), ((target, n_t),))
        timers.setdefault(("s", *sh["s"]), ((draft, *sh["s"]),))
        timers.setdefault(("ts1", n_t, *sh["s1"]), ((target, n_t), (draft, *sh["s1"])))
    for P in sorted({bucket(len(i)) for i in ids}):
        timers[("pt", P)] = ((target, P, 1),)
        timers[("ps", P)] = ((draft, P, 1),)
    t0 = time.perf_counter()
    timed = {k: sequence_timer(list(v), context if k[0] not in ("pt", "ps") else 0,
                               max(slots, 2 * bucket(max(len(i) for i in ids))), inner=2)
             for k, v in timers.items()}
    print(f"[round_cost] {len(timed)} forward timers compiled in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    first, ref = {}, None
    for r in rows:  # first calls: compile + run
        s = run(r)
        first[r] = s[0]
        ref = s[4] if ref is None else ref
        if s[4] != ref:
            raise SystemExit(f"{r}: tokens differ from {rows[0]}'s")
        print(f"[round_cost] {r}: first pass {s[0]:.1f} s", file=sys.stderr, flush=True)

    samples = {r: [] for r in rows}
    for rep in range(a.reps):
        for r in rows:
            secs, tc, df, nt, toks = run(r)
            if toks != ref:
                raise SystemExit(f"{r}: tokens differ from {rows[0]}'s")
            samples[r].append(dict(seconds=secs, target_calls=tc, draft_forwards=df,
                                   new_tokens=nt))
        lat = {k: float(np.median([f() for _ in range(2)])) for k, f in timed.items()}
        pre = sum(lat[("pt", bucket(len(i)))] + lat[("ps", bucket(len(i)))] for i in ids)
        for r in rows:
            s = samples[r][-1]
            s["latency"] = {str(k): v for k, v in lat.items()}
            s["measured_round"] = (s["seconds"] - pre) / s["target_calls"]
            s["forward_price"] = round_price(shapes[r], s["target_calls"], s["draft_forwards"],
                                             lat)
            print(f"[round_cost] rep {rep}: {r}: {1e3 * s['measured_round']:.1f} ms/round, "
                  f"forwards {1e3 * s['forward_price']:.1f} ms", file=sys.stderr, flush=True)

    # the cost model's price, at the agreement speculative realised
    res_rows = {}
    spec_eta = None
    if "speculative" in rows:
        s = samples["speculative"][0]
        spec_eta = s["new_tokens"] / s["target_calls"]
    agree = agreement_from_eta(spec_eta, a.gamma) if spec_eta else 0.8
    for r in rows:
        v = samples[r]
        med = lambda k: float(np.median([x[k] for x in v]))  # noqa: E731
        cfg = cfgs[r]
        spec = METHODS[name[r]]
        lat = {eval(k): x for k, x in v[-1]["latency"].items()}  # noqa: S307 (our own keys)
        sh = shapes[r]
        tt = {k[1]: x for k, x in lat.items() if k[0] == "t"}
        td = {k[1]: x for k, x in lat.items() if k[0] == "s" and k[2] == sh["s"][1]}
        model_price = round_seconds(spec.forward_sizes(cfg), spec.round_model(cfg, agree), tt, td)
        steady = med("seconds")
        res_rows[r] = dict(
            config=repr(cfg), target_calls=v[0]["target_calls"],
            draft_forwards=v[0]["draft_forwards"], new_tokens=v[0]["new_tokens"],
            eta=v[0]["new_tokens"] / v[0]["target_calls"],
            draft_forwards_per_round=v[0]["draft_forwards"] / v[0]["target_calls"],
            n_target=sh["t"][0], n_draft=list(sh["s"]), n_draft_first=list(sh["s1"]),
            measured_round_ms=1e3 * med("measured_round"),
            forward_price_ms=1e3 * med("forward_price"),
            measured_over_forwards=float(np.median([x["measured_round"] / x["forward_price"]
                                                    for x in v])),
            model_price_ms=1e3 * model_price,
            measured_over_model=med("measured_round") / model_price,
            tokens_per_second=med("new_tokens") / steady, seconds=steady,
            first_pass_s=first[r], compile_s=first[r] - steady)
    proj = flat_projection(res_rows, target, draft)
    base = res_rows.get("speculative")
    print(f"\n{a.prompts} code prompts x {N} new tokens, batch 1, greedy, {a.reps} "
          f"repetitions; agreement {agree:.3f} (speculative's eta {spec_eta})")
    print("| row | eta | draft fwd/round | sizes T / S / S1 | measured ms/round | forward "
          "price ms | measured/forwards | model price ms | measured/model | tok/s vs spec "
          "| flat-latency projection vs spec | compile s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r, x in res_rows.items():
        vs = x["tokens_per_second"] / base["tokens_per_second"] if base else float("nan")
        pj = proj.get(r)
        print(f"| {r} | {x['eta']:.2f} | {x['draft_forwards_per_round']:.2f} | "
              f"{x['n_target']} / {x['n_draft'][0]} / {x['n_draft_first'][0]} | "
              f"{x['measured_round_ms']:.1f} | {x['forward_price_ms']:.1f} | "
              f"{x['measured_over_forwards']:.3f} | {x['model_price_ms']:.1f} | "
              f"{x['measured_over_model']:.3f} | {vs:.3f} | "
              f"{'' if pj is None else f'{pj:.3f}'} | {x['compile_s']:.1f} |")
    lat = {eval(k): x for k, x in samples[rows[0]][-1]["latency"].items()}  # noqa: S307
    tt = {k[1]: x for k, x in lat.items() if k[0] == "t"}
    td = {k[1]: x for k, x in lat.items() if k[0] == "s"}
    ratio = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(draft.params)) / sum(
        int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(target.params))
    fitted = fit(tt, td, agree, ratio)
    print_fit(fitted, agree)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"fit": [[r[0], repr(r[1]), r[2], r[3]] for r in fitted],
                       "command": "python -m experiments.round_cost " + " ".join(
                sys.argv[1:] if argv is None else argv), "agreement": agree, "rows": res_rows,
                "samples": samples, "flat_projection_vs_speculative": proj,
                "jax": jax.__version__}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
