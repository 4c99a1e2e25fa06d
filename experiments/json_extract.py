"""Structured output on a JSON extraction workload: does the constraint keep every output valid,
what does it cost plain decoding, and how fast do the speculative methods run under it?

    python -m experiments.json_extract --target ~/.cache/ouroboros-real/smollm2-135m-instruct-q4_1.gguf
    python -m experiments.json_extract \
        --target ~/.cache/ouroboros-real/qwen2.5-coder-1.5b-instruct-q4_k.gguf \
        --draft ~/.cache/ouroboros-real/qwen2.5-coder-0.5b-instruct-q4.gguf

Eight held-out tasks written for this script (`TASKS`: a text in, an object matching a schema
out; not tuned on). Each row runs every task at B = 1, greedy, twice: the first call compiles,
the second is timed (calls 2 onward, as the bench times). Rows: unconstrained vanilla,
constrained vanilla, then each method constrained (`--methods`; speculative and ouroboros need
--draft). Columns: validity (the output parsed and validated with jsonschema), tokens/s of the
timed calls, x constrained vanilla (side by side in one process), forced tokens per answer
(tokens the automaton allowed alone), and whether the greedy tokens equal constrained
vanilla's. Also: the largest schema's table (MiB) and its build time (first build; later calls
read the cache).

Peer row (`--peer`): transformers' greedy `generate` with `constrain.peer.TableLogitsProcessor`
(the same table, host state per row), the model loaded by transformers from the same GGUF
(dequantised to float32 by transformers; practical for SmolLM2, minutes and ~4x the memory for
the real pair). Its tokens are compared with constrained vanilla's too.

Prints one JSON object (rows and the table figures) and a table.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

TASKS = [
    ("Maria Lopez, 34, moved from Lisbon to Berlin last spring to work as a nurse.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                       "age": {"type": "integer"},
                                       "city": {"type": "string", "maxLength": 30}},
      "required": ["name", "age", "city"]}),
    ("The Acme X200 vacuum costs $149.99 and ships in 3 days; it is currently in stock.",
     {"type": "object", "properties": {"product": {"type": "string", "maxLength": 40},
                                       "price": {"type": "number"},
                                       "in_stock": {"type": "boolean"}},
      "required": ["product", "price", "in_stock"]}),
    ("Team meeting on 2024-03-15 at 10:30 in room B12 with Alice, Bob and Chen.",
     {"type": "object", "properties": {"date": {"type": "string", "maxLength": 12},
                                       "room": {"type": "string", "maxLength": 10},
                                       "attendees": {"type": "array", "maxItems": 6,
                                                     "items": {"type": "string",
                                                               "maxLength": 20}}},
      "required": ["date", "room", "attendees"]}),
    ("Order #5521 by Ken Ito: 2 notebooks and 1 pen, paid by card.",
     {"type": "object", "properties": {"order_id": {"type": "integer"},
                                       "customer": {"type": "string", "maxLength": 30},
                                       "payment": {"enum": ["card", "cash", "transfer"]}},
      "required": ["order_id", "customer", "payment"]}),
    ("The film Night Harbor (2019), directed by Ana Ruiz, runs 112 minutes and is rated PG-13.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "year": {"type": "integer"},
                                       "director": {"type": "string", "maxLength": 30},
                                       "minutes": {"type": "integer"}},
      "required": ["title", "year", "director", "minutes"]}),
    ("Flight LH 455 from Frankfurt to San Francisco departs at 13:20 and is delayed.",
     {"type": "object", "properties": {"flight": {"type": "string", "maxLength": 10},
                                       "origin": {"type": "string", "maxLength": 30},
                                       "destination": {"type": "string", "maxLength": 30},
                                       "status": {"enum": ["on time", "delayed", "cancelled"]}},
      "required": ["flight", "origin", "destination", "status"]}),
    ("Sensor 7 reported 21.5 degrees and 40 percent humidity; battery is low.",
     {"type": "object", "properties": {"sensor": {"type": "integer"},
                                       "temperature": {"type": "number"},
                                       "humidity": {"type": "integer"},
                                       "battery_low": {"type": "boolean"}},
      "required": ["sensor", "temperature", "humidity", "battery_low"]}),
    ("Dr. Sam Okafor, a cardiologist at St. Mary's, can be reached at sam.okafor@stmarys.org.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                       "specialty": {"type": "string", "maxLength": 30},
                                       "email": {"type": "string", "maxLength": 40}},
      "required": ["name", "specialty", "email"]}),
]


def messages(text: str, schema: dict) -> list:
    return [{"role": "system", "content": "You extract facts from text into JSON. Answer with "
                                          "the JSON object only."},
            {"role": "user", "content": f"Schema: {json.dumps(schema)}\nText: {text}"}]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "extract", "schema": schema}}


def log(msg: str) -> None:
    import sys

    print(f"[json_extract] {msg}", file=sys.stderr, flush=True)


FREE_ROW = "ouroboros+free"
GAMMA_ROW = "speculative+g"  # speculative+gN: speculative's loop at an explicit γ N


def row_kwargs(method, constrained, draft, schema, max_new, config) -> dict:
    """generate's keywords for a row; a method named `ouroboros+freeN` is an explicit config:
    Ouroboros' SD step (γ 10, the chain auto ran here) with free drafts at matches >= N;
    `speculative+gN`: speculative's loop at γ N."""
    if method.startswith(FREE_ROW):
        from ouroboros_jax.decoding.ouroboros_config import OuroborosConfig

        config = OuroborosConfig(gamma=10, window=2, ngram=3, guesses=2, suffixes=1,
                                 phrase_drafting=False, lengthening=False, recycling=False,
                                 context_phrases=False, free_drafts=True,
                                 free_threshold=int(method[len(FREE_ROW):]))
        method = "ouroboros"
    if method.startswith(GAMMA_ROW):
        from ouroboros_jax.decoding.speculative import SpeculativeConfig

        config = SpeculativeConfig(gamma=int(method[len(GAMMA_ROW):]))
        method = "speculative"
    return dict(method=method, config=config, max_new_tokens=max_new,
                draft=draft if method in ("speculative", "ouroboros") else None,
                response_format=fmt(schema) if constrained else None)


def run_rows(oj, target, draft, plan, tasks, max_new, config, reps: int = 1, warm: int = 1):
    """Every (method, constrained) row of `plan` over every task, B = 1: first `warm` passes of
    each row's calls per task (compiles; auto may explore, then switch and compile in the
    background, which is waited out, per prompt bucket), then `reps` timed passes interleaved task by task and row by row, so
    that a load change on a shared machine falls on every row alike. Returns per row: (per
    task: tokens, text, stats of the last timed call), seconds and tokens of the timed calls,
    and per task the median timed seconds."""
    from ouroboros_jax.auto import wait_for_background

    for method, constrained in plan:
        for _ in range(warm):  # auto's first call explores, and a switch compiles per bucket
            for text, schema in tasks:
                oj.generate(target, [messages(text, schema)],
                            **row_kwargs(method, constrained, draft, schema, max_new, config))
                wait_for_background()
        log(f"first calls done: {method}{' constrained' if constrained else ''}")
    res = {row: dict(outs=[None] * len(tasks), secs=[[] for _ in tasks]) for row in plan}
    for _ in range(reps):
        for i, (text, schema) in enumerate(tasks):
            for row in plan:
                kw = row_kwargs(*row, draft, schema, max_new, config)
                t0 = time.perf_counter()
                out = oj.generate(target, [messages(text, schema)], **kw)
                res[row]["secs"][i].append(time.perf_counter() - t0)
                res[row]["outs"][i] = (out.tokens[0], out.texts[0], out.stats)
                wait_for_background()
            log(f"timed pass {_ + 1}/{reps}: task {i + 1}/{len(tasks)}")
    return {row: (r["outs"], sum(float(np.median(x)) for x in r["secs"]),
                  sum(len(o[0]) for o in r["outs"]), [float(np.median(x)) for x in r["secs"]])
            for row, r in res.items()}


def prefill_seconds(oj, target, draft, plan, tasks, config) -> dict:
    """Per row, the median seconds of a call that emits one token (its prompt's prefill, the
    loop's set-up and one round), summed over the tasks: the floor of that row's calls on
    this workload, however fast its rounds (calls 2 onward; each row's call 1 compiles)."""
    out = {}
    for row in plan:
        tot = 0.0
        for text, schema in tasks:
            kw = row_kwargs(*row, draft, schema, 1, config)
            oj.generate(target, [messages(text, schema)], **kw)
            ts = []
            for _ in range(2):
                t0 = time.perf_counter()
                oj.generate(target, [messages(text, schema)], **kw)
                ts.append(time.perf_counter() - t0)
            tot += min(ts)
        out[row] = tot
    return out


def run_peer(target_path, target, tasks, max_new):
    """transformers + the table's LogitsProcessor, greedy, B = 1: (per task: tokens, text,
    stats), seconds and tokens of the timed (second) calls."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from ouroboros_jax.chat import apply_chat
    from ouroboros_jax.constrain import table_for
    from ouroboros_jax.constrain.peer import TableLogitsProcessor
    from ouroboros_jax.request import default_eos_ids

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = os.path.expanduser(target_path)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              torch_dtype=torch.float32).eval()
    eos = default_eos_ids(target)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    outs, seconds, tokens = [], 0.0, 0
    for text, schema in tasks:
        table = table_for(fmt(schema), target.tokenizer, target.config.vocab_size, eos)
        ids = torch.tensor([apply_chat(target.tokenizer, messages(text, schema))])
        for call in range(2):  # call 1 warms up, as the other rows
            proc = TableLogitsProcessor(table, ids.shape[1])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(ids, max_new_tokens=max_new, do_sample=False,
                                  logits_processor=LogitsProcessorList([proc]),
                                  eos_token_id=eos, pad_token_id=eos[0])
            dt = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        seconds += dt
        tokens += len(new)
        outs.append((new, target.tokenizer.decode(new, skip_special_tokens=True), {}))
    return outs, seconds, tokens


def constraint_cost(oj, target, tasks, lengths, config, reps: int = 2) -> dict:
    """The constraint's cost to vanilla at equal tokens, paired: per task, constrained vanilla
    and unconstrained vanilla with max_new_tokens = the constrained answer's length (its
    tokens and prefill share alike), timed alternately `reps` times (both compiled already),
    so load changes on a shared machine hit both alike."""
    secs = {True: 0.0, False: 0.0}
    toks = {True: 0, False: 0}
    for (text, schema), n in zip(tasks, lengths):
        for _ in range(reps):
            for c in (True, False):
                kw = dict(method="vanilla", max_new_tokens=n, config=config,
                          response_format=fmt(schema) if c else None)
                if _ == 0:  # compile this length's loop (its cache slots may differ from the
                    # rows' calls at max_new_tokens) outside the timings, for both
                    oj.generate(target, [messages(text, schema)], **kw)
                t0 = time.perf_counter()
                out = oj.generate(target, [messages(text, schema)], **kw)
                secs[c] += time.perf_counter() - t0
                toks[c] += len(out.tokens[0])
    rate = {c: toks[c] / secs[c] for c in secs}
    return dict(constraint_cost=1 - rate[True] / rate[False], constrained_tok_s=rate[True],
                unconstrained_same_lengths_tok_s=rate[False], reps=reps)


def sampled_validity(oj, target, draft, plan, tasks, max_new, config, temperature: float
                     ) -> dict:
    """Per constrained row, the share of its sampled answers (one call per task at
    `temperature`, seed = the task's index) that parse and validate against the task's schema:
    the constraint must hold for sampled tokens too (untimed)."""
    out = {}
    for row in plan:
        ok = 0
        for i, (text, schema) in enumerate(tasks):
            kw = row_kwargs(*row, draft, schema, max_new, config)
            got = oj.generate(target, [messages(text, schema)], temperature=temperature,
                              seed=i, **kw)
            ok += valid(got.texts[0], schema)
        out[row] = ok / len(tasks)
        log(f"sampled calls done: {row[0]}")
    return out


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--methods", default=None,
                    help="comma-separated (default: prompt_lookup,lookahead, plus speculative,"
                         "ouroboros with --draft)")
    ap.add_argument("--tasks", type=int, default=len(TASKS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--config", default="none", choices=["none", "auto"],
                    help="none: each method's paper recipe (default); auto: config='auto'")
    ap.add_argument("--reps", type=int, default=1,
                    help="timed passes (interleaved); each task's median is summed")
    ap.add_argument("--no-unconstrained", dest="unconstrained", action="store_false",
                    help="leave out the unconstrained vanilla row")
    ap.add_argument("--no-cost", dest="cost", action="store_false",
                    help="leave out the constraint's cost to vanilla (paired calls)")
    ap.add_argument("--warm", type=int, default=1,
                    help="untimed passes per row before the timed ones (2: auto's switch "
                         "compiles every prompt bucket's loop before the timings)")
    ap.add_argument("--floors", action="store_true",
                    help="also time each constrained row's one-token calls (prefill and set-up)")
    ap.add_argument("--sampled", type=float, default=0.0, metavar="T",
                    help="also sample each constrained row once per task at temperature T and "
                         "report the share of valid answers (0: not run)")
    ap.add_argument("--peer", action="store_true",
                    help="add the transformers + table LogitsProcessor row")
    ap.add_argument("--draft-quantize", default="auto",
                    choices=["auto", "off", "int8", "int4", "w8a8"],
                    help="how the draft is loaded, as the CLI's flag (auto: w8a8 or int8 where the "
                         "few-row kernel runs)")
    args = ap.parse_args(argv)

    import ouroboros_jax as oj
    from ouroboros_jax.constrain import table_for
    from ouroboros_jax.models.quant import draft_scheme
    from ouroboros_jax.request import default_eos_ids

    target = oj.load_model(args.target)
    draft = (oj.load_model(args.draft, quantize=draft_scheme(args.draft_quantize, None,
                                                              "float32"))
             if args.draft else None)
    methods = (args.methods.split(",") if args.methods else
               ["prompt_lookup", "lookahead"] + (["speculative", "ouroboros"] if draft else []))
    tasks = TASKS[:args.tasks]
    config = None if args.config == "none" else "auto"
    eos = default_eos_ids(target)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    builds = []
    for _, schema in tasks:
        t0 = time.perf_counter()
        t = table_for(fmt(schema), target.tokenizer, target.config.vocab_size, eos)
        builds.append(dict(states=int(t.next_state.shape[0]), classes=int(t.next_state.shape[1]),
                           mib=t.nbytes / 2**20, build_s=time.perf_counter() - t0))
    rows = []
    ref = cost = None
    plan = ([("vanilla", False)] if args.unconstrained else []) + [("vanilla", True)] + [
        (m, True) for m in methods]
    timed = run_rows(oj, target, draft, plan, tasks, args.max_new_tokens, config, args.reps,
                     args.warm)
    floors = (prefill_seconds(oj, target, draft, plan[1:], tasks, config)
              if args.floors else {})
    sampled = (sampled_validity(oj, target, draft, plan[1 if args.unconstrained else 0:], tasks,
                                args.max_new_tokens, config, args.sampled)
               if args.sampled > 0 else {})
    if args.peer:
        plan.append(("transformers+processor", True))
        timed[plan[-1]] = run_peer(args.target, target, tasks, args.max_new_tokens) + (None,)
    for method, constrained in plan:
        outs, secs, toks, per_task = timed[(method, constrained)]
        if method == "vanilla" and constrained:
            ref = outs
        row = dict(method=method, constrained=constrained,
                   validity=sum(valid(o[1], s) for o, (_, s) in zip(outs, tasks)) / len(tasks),
                   tok_s=toks / secs, tokens=toks, seconds=secs, seconds_per_task=per_task,
                   forced_per_answer=(sum(o[2].get("forced_tokens", 0) for o in outs)
                                      / len(tasks)),
                   forced_proposed_per_answer=(sum(o[2].get("forced_tokens_proposed", 0)
                                                   for o in outs) / len(tasks)),
                   tokens_per_answer=toks / len(tasks),
                   eta=(sum(o[2].get("new_tokens", 0) for o in outs)
                        / max(1, sum(o[2].get("target_calls", 0) for o in outs))),
                   auto=[(o[2].get("auto") or {}).get("config") for o in outs])
        if (method, constrained) in sampled:
            row["validity_sampled"] = sampled[(method, constrained)]
        if (method, constrained) in floors:
            row["one_token_call_seconds"] = floors[(method, constrained)]
        if constrained and ref is not None:
            row["equals_constrained_vanilla"] = all(a[0] == b[0] for a, b in zip(outs, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.cost:
        cost = constraint_cost(oj, target, tasks, [len(o[0]) for o in ref], config)
        print(json.dumps(cost), flush=True)
    base = next(r["tok_s"] for r in rows if r["method"] == "vanilla" and r["constrained"])
    for r in rows:
        r["x_constrained_vanilla"] = r["tok_s"] / base
    largest = max(builds, key=lambda b: b["mib"])
    result = dict(command="python -m experiments.json_extract " + " ".join(argv or []),
                  target=args.target, draft=args.draft, rows=rows, largest_table=largest,
                  constraint_cost=cost,
                  tables=builds)
    print(json.dumps(result, indent=1))
    print(f"\n{'row':36s} {'valid':>6s} {'tok/s':>7s} {'x c-van':>8s} {'forced':>7s} "
          f"{'f-prop':>7s} {'tok/ans':>7s} {'eta':>5s} {'==c-van':>7s} {'valid@T':>7s}")
    for r in rows:
        name = ("constrained " if r["constrained"] else "unconstrained ") + r["method"]
        print(f"{name:36s} {r['validity']:6.0%} {r['tok_s']:7.2f} "
              f"{r['x_constrained_vanilla']:8.2f} {r['forced_per_answer']:7.1f} "
              f"{r['forced_proposed_per_answer']:7.1f} {r['tokens_per_answer']:7.1f} "
              f"{r['eta']:5.2f} {str(r.get('equals_constrained_vanilla', '-')):>7s} "
              f"{format(r['validity_sampled'], '.0%') if 'validity_sampled' in r else '-':>7s}")
    if cost is not None:
        print(f"the constraint's cost to vanilla at equal tokens (paired): "
              f"{cost['constraint_cost']:.1%}")
    print(f"largest table: {largest['mib']:.2f} MiB ({largest['states']} states x "
          f"{largest['classes']} classes), built in {largest['build_s']:.2f} s")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
