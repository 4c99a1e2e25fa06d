"""The bench: quick end-to-end run (CLI, JSON fields, plots), the identical-output check against
a deliberately wrong method, the cost model on a hand-computed example, the workload readers.

One bench run (module fixture) on the session's tiny pair serves every end-to-end assertion.
"""

import dataclasses
import json
import os
import time

import pytest

import ouroboros_jax as oj
from ouroboros_jax.bench import cost_model
from ouroboros_jax.bench.workloads import (read_humaneval, read_prompt_jsonl, read_spec_bench,
                                           limit_per_task)
from ouroboros_jax.decoding import METHODS, MethodSpec

SPEC_LINES = [
    {"question_id": 1, "category": "writing",
     "turns": ["Write a sea haiku", "Rhyme"]},
    {"question_id": 2, "category": "translation", "turns": ["Translate: guten Morgen"]},
    {"question_id": 3, "category": "translation", "turns": ["Translate: bonne nuit"]},
]


def _write_jsonl(path, objs, extra_lines=()):
    with open(path, "w") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


# Every prompt (the second turn after an 8-token answer too) fits the 32-token prompt bucket.

# -- a deliberately wrong method: vanilla with one token changed ------------------------------

def _perturbed_run(pair, prompt, plens, limits, sp, pool, *, cfg, slots, greedy):
    seq, stats, pool = METHODS["vanilla"].runner(pair, prompt, plens, limits, sp, pool, cfg=cfg,
                                                 slots=slots, greedy=greedy)
    # the third generated token of row 0 -> another id: output differs, shapes do not
    i = plens[0] + 2
    tok = seq.tokens[0, i]
    seq = seq.replace(tokens=seq.tokens.at[0, i].set(3 + (tok - 2) % 90))
    return seq, stats, pool


@pytest.fixture(scope="module")
def bench_run(tiny_pair, tmp_path_factory):
    from ouroboros_jax.cli import main

    target, draft, _ = tiny_pair
    d = tmp_path_factory.mktemp("bench")
    spec = _write_jsonl(d / "question.jsonl", SPEC_LINES)
    METHODS["perturbed"] = MethodSpec(runner=_perturbed_run, needs_draft=False,
                                      config_type=type(None), default_config=lambda: None,
                                      margin=lambda cfg: 0)
    try:
        main(["bench", "--quick", "--target", target.path, "--draft", draft.path,
              "--spec-bench", spec, "--prompts-per-task", "1", "--no-progress", "--ignore-eos",
              "--max-new-tokens", "8",
              "--methods", "vanilla,speculative,peers,speculative@auto,lookahead,ouroboros,"
                           "perturbed",
              "--sweep", "pool", "--sweep", "history", "--sweep", "length",
              "--sweep", "confidence", "--project", "h100",
              "--out", str(d / "out")])
    finally:
        del METHODS["perturbed"]
    with open(d / "out" / "results.json") as f:
        return json.load(f), d / "out"


def _h100_seconds(calls, sizes, tcfg, dcfg, ctx):
    """The H100 roofline price of these per-call counts at forward sizes (n_T, n_S, n_S1), by
    hand: prefill per call, (t_T + round overhead) per target call, t_S per draft forward and
    a round's first draft forward at n_S1."""
    from ouroboros_jax.bench.accelerator import ACCELERATORS, ROUND_OVERHEAD_S, forward_seconds
    from ouroboros_jax.bench.cost_model import prompt_bucket

    t = lambda cfg, n, c=ctx: forward_seconds(ACCELERATORS["h100"], cfg, n, c)  # noqa: E731
    n_t, n_s, n_s1 = sizes
    tc = sum(c["target_calls"] for c in calls)
    df = sum(c["draft_forwards"] for c in calls)
    secs = sum(t(tcfg, prompt_bucket(c["prompt_tokens"]), 0)
               + (t(dcfg, prompt_bucket(c["prompt_tokens"]), 0) if n_s else 0) for c in calls)
    secs += tc * (t(tcfg, n_t) + ROUND_OVERHEAD_S)
    if n_s:
        secs += df * t(dcfg, n_s) + min(tc, df) * (t(dcfg, n_s1) - t(dcfg, n_s))
    return secs


def _auto_groups(row):
    """{(method auto ran, its recipe): [calls]} of a METHOD@auto row, from the runner's
    per-call stats["auto"]."""
    groups = {}
    for c in row["per_call"]:
        groups.setdefault((c["auto"]["method"], c["auto"]["config"]), []).append(c)
    return groups


@pytest.fixture(scope="module")
def bench_configs(tiny_pair):
    target, draft, _ = tiny_pair
    return target.config, draft.config


def test_quick_bench_json_has_every_field(bench_run, bench_configs):
    res, out = bench_run
    env = res["environment"]
    for k in ("python", "jax", "transformers", "torch", "cpu_model", "git_commit", "cpus"):
        assert k in env
    assert env["jax"] and env["python"]
    st = res["settings"]
    assert st["repeats"] == 1 and st["prompt_order"] == ["spec_bench/1", "spec_bench/2"]
    assert res["workload"]["tasks"] == {"mt-bench": 1, "translation": 1}
    m = res["methods"]
    assert list(m)[0] == "vanilla"
    # the peers run after every method of ours (their torch copies are loaded then), though
    # --methods names them third
    kinds = ["hf" if k.startswith("hf-") else "oj" for k in m]
    assert kinds == sorted(kinds, key=lambda k: k == "hf") and kinds[-1] == "hf"
    for label in ("vanilla", "speculative", "lookahead", "ouroboros", "hf-greedy",
                  "hf-assisted", "hf-pld"):
        s = m[label]
        assert s["calls"] == 3  # two turns + one single-turn prompt
        for k in ("tokens_per_second", "speedup", "compile_seconds", "peak_rss_mib",
                  "identical", "per_task", "per_call", "new_tokens", "seconds"):
            assert s[k] is not None, (label, k)
        assert s["tokens_per_second"] > 0 and s["peak_rss_mib"] > 0
        assert s["identical"] is True, (label, s["mismatches"])
        assert set(s["per_task"]) == {"mt-bench", "translation"}
    assert m["vanilla"]["speedup"] == pytest.approx(1.0)
    # METHOD@auto: generate's default config, its calls timed with what auto compiles in them
    a = m["speculative@auto"]
    assert a["config"] == {"auto": True} and a["method"] == "speculative"
    assert a["identical"] is True and a["calls"] == 3
    assert a["recompile_seconds_excluded"] == 0.0
    assert a["recompile_seconds_included"] == pytest.approx(
        sum(c["compile_seconds"] for c in a["per_call"]))
    for label in ("speculative", "lookahead", "ouroboros"):
        s = m[label]
        assert s["eta"] >= 1.0 and s["target_calls"] > 0
        assert sum(s["acceptance_histogram"]) == s["target_calls"]
    assert m["ouroboros"]["c"] > 0 and m["ouroboros"]["draft_forwards"] > 0
    for label in ("lookahead", "ouroboros"):
        g = m[label]["pool_growth"]
        assert len(g) == 3 and g == sorted(g) and g[-1] > 0  # history on: the pool only grows
        assert 0 <= m[label]["pool_hit_rate"] <= 1
    assert "suffix_tokens_accepted" in m["ouroboros"]
    # the second turn is fed after the first answer: its context is longer
    calls = m["vanilla"]["per_call"]
    assert [(c["id"], c["turn"]) for c in calls] == [("spec_bench/1", 0), ("spec_bench/1", 1),
                                                      ("spec_bench/2", 0)]
    cm = res["cost_model"]
    # every row of ours, METHOD@auto too (priced by what auto ran: test_auto_row_...)
    assert {r["method"] for r in cm["rows"]} == {"vanilla", "speculative", "lookahead",
                                                 "ouroboros", "speculative@auto"}
    assert all(r["predicted_speedup"] > 0 and r["prefill_seconds"] > 0 for r in cm["rows"])
    assert cm["latency"]["target_prefill"] and cm["latency"]["draft_prefill"]
    # weights-bound pricing of the same counts: vanilla is 1x by construction, and a method's
    # prediction is vanilla's calls over (target calls + draft forwards * draft/target params)
    wb = {r["method"]: r for r in cm["weights_bound"]["rows"]}
    st = res["settings"]
    ratio = st["draft"]["params"] / st["target"]["params"]
    van = m["vanilla"]["target_calls"]
    for label, r in wb.items():
        expect = van / (m[label]["target_calls"] + m[label]["draft_forwards"] * ratio)
        assert r["predicted_speedup"] == pytest.approx(expect)
    assert wb["vanilla"]["predicted_speedup"] == pytest.approx(1.0)
    # --project h100: the same counts priced with the roofline of both models' shapes
    # (bench/accelerator.py, tested by hand in test_accelerator.py), round overhead included
    from ouroboros_jax.bench.cost_model import forward_sizes

    pj = cm["projections"]["h100"]
    assert "not a measurement" in pj["note"] and "PROJECTION" in pj["latency"]["note"]
    rows = {r["method"]: r for r in pj["rows"]}
    assert set(rows) == {r["method"] for r in cm["rows"]}
    assert rows["vanilla"]["predicted_speedup"] == pytest.approx(1.0)
    tcfg, dcfg = bench_configs
    ctx = pj["latency"]["context"]
    base = _h100_seconds(m["vanilla"]["per_call"], (1, 0, 0), tcfg, dcfg, ctx)
    from ouroboros_jax.bench.configs import method_runs

    cfgs = {run.label: run.config for run in method_runs(["speculative", "ouroboros"], True, {})}
    for label in ("speculative", "ouroboros"):
        sizes = forward_sizes(label, cfgs[label])
        assert rows[label]["predicted_speedup"] == pytest.approx(
            base / _h100_seconds(m[label]["per_call"], sizes, tcfg, dcfg, ctx), rel=1e-6)
    sw = res["sweeps"]
    assert [p["value"] for p in sw["pool"]["points"]] == [4, "default"]
    assert [p["value"] for p in sw["history"]["points"]] == [
        "on, file order", "off, file order", "on, reversed", "off, reversed"]
    assert [p["value"] for p in sw["length"]["points"]] == [8, 16]
    assert sw["length"]["points"][0]["new_tokens"] == 3 * 8  # --ignore-eos: full length
    assert [p["value"] for p in sw["confidence"]["points"]] == [0.0, 0.5]
    # prompts sized so that every call (second turns included) shares one compiled shape
    assert all(m[k]["recompiled_calls"] == 0 for k in ("vanilla", "ouroboros"))
    for s in sw.values():
        for p in s["points"]:
            assert p["identical"] is True and p["tokens_per_second"] > 0
    for f in ("results.md", "speedup_by_task.png", "acceptance_hist.png", "pool_growth.png",
              "sweep_pool.png", "sweep_history.png", "sweep_length.png",
              "sweep_confidence.png"):
        assert os.path.getsize(out / f) > 0, f
    md = (out / "results.md").read_text()
    assert "| ouroboros |" in md and "| hf-assisted |" in md


def test_auto_row_projected_as_the_config_it_ran(bench_run, bench_configs):
    """--project h100 on a METHOD@auto row: each call's counts priced at the forward sizes of
    the config auto chose for it (vanilla's when it turned speculation off), the row named
    after it."""
    from ouroboros_jax.bench.cost_model import forward_sizes
    from ouroboros_jax.decoding.speculative import SpeculativeConfig

    res, out = bench_run
    m = res["methods"]
    pj = res["cost_model"]["projections"]["h100"]
    rows = {r["method"]: r for r in pj["rows"]}
    auto = rows["speculative@auto"]
    groups = _auto_groups(m["speculative@auto"])
    names = [recipe or method for method, recipe in groups]
    assert auto["ran"] == "speculative@auto (ran " + (
        names[0] if len(names) == 1 else ", ".join(
            f"{n} on {len(g)} calls" for n, g in zip(names, groups.values()))) + ")"
    assert [p["calls"] for p in auto["ran_parts"]] == [len(g) for g in groups.values()]
    tcfg, dcfg = bench_configs
    ctx = pj["latency"]["context"]
    base = _h100_seconds(m["vanilla"]["per_call"], (1, 0, 0), tcfg, dcfg, ctx)
    secs = 0.0
    for (method, recipe), calls in groups.items():
        cfg = None if recipe is None else eval(recipe, {"SpeculativeConfig": SpeculativeConfig})
        secs += _h100_seconds(calls, forward_sizes(method, cfg), tcfg, dcfg, ctx)
    assert auto["predicted_speedup"] == pytest.approx(base / secs, rel=1e-6)
    md = (out / "results.md").read_text()
    assert f"| {auto['ran']} |" in md


def test_cpu_validation_is_the_cost_models_price(bench_run):
    """The validation column: each row's measured time against the CPU cost model's price of
    its counted forwards (this CPU's latency table), the relative error, the count within
    10%; the error follows the measured time (not a constant), the price does not."""
    import copy

    from ouroboros_jax.bench.cost_model import TOLERANCE, validate

    res, out = bench_run
    cm = res["cost_model"]
    table = cost_model.LatencyTable.from_json(cm["latency"])
    van = res["methods"]["vanilla"]
    rows = {r["method"]: r for r in cm["rows"]}
    # vanilla by hand: a prefill per call plus one 1-token target forward per target call
    expect = table.prefill_seconds([c["prompt_tokens"] for c in van["per_call"]], False) \
        + van["target_calls"] * table.t_target(1)
    assert rows["vanilla"]["predicted_seconds"] == pytest.approx(expect)
    for r in cm["rows"]:
        assert r["measured_seconds"] == res["methods"][r["method"]]["seconds"]
        assert r["cpu_error"] == pytest.approx(r["measured_seconds"] / r["predicted_seconds"]
                                               - 1)
        assert r["within_tolerance"] == (abs(r["cpu_error"]) <= TOLERANCE)
    v = cm["validation"]
    assert (v["within"], v["rows"]) == (sum(r["within_tolerance"] for r in cm["rows"]),
                                        len(cm["rows"]))
    # the projection rows carry the same validation beside the projected speedup
    for r in cm["projections"]["h100"]["rows"]:
        assert r["cpu_error"] == rows[r["method"]]["cpu_error"]
        assert r["cpu_predicted_seconds"] == rows[r["method"]]["predicted_seconds"]
    md = (out / "results.md").read_text()
    assert v["summary"] in md and "CPU model error" in md
    # a run twice as slow: the same price, an error of 2 * (1 + e) - 1
    slow = copy.deepcopy(res)
    for s in slow["methods"].values():
        s["seconds"] *= 2
    from experiments.reproject import configs_of

    again = cost_model.cost_rows(slow, table, {**configs_of(slow), "vanilla": None})
    validate(again)
    for r in again:
        assert r["predicted_seconds"] == pytest.approx(rows[r["method"]]["predicted_seconds"])
        assert r["cpu_error"] == pytest.approx(2 * (1 + rows[r["method"]]["cpu_error"]) - 1)


def test_saved_counts_reprojected_onto_preset_shapes(bench_run, capsys):
    """`python -m experiments.reproject results.json --target ... --draft ...`:
    the saved run's counts priced with other shapes, on each device asked; vanilla 1x by
    construction."""
    from experiments.reproject import main as reproject

    res, out = bench_run
    rows = reproject([str(out / "results.json"), "--target", "llama-3.1-8b", "--draft",
                      "llama-3.2-1b", "--project", "h100", "--project", "v5e"])
    text = capsys.readouterr().out
    assert "PROJECTION (not a measurement)" in text
    by = {(r["device"], r["method"]): r for r in rows}
    assert {m for _, m in by} == {"vanilla", "speculative", "lookahead", "ouroboros",
                                  "speculative@auto"}
    # a METHOD@auto row re-projected by the configs its calls ran, named as in the run
    saved = {r["method"]: r for r in res["cost_model"]["rows"]}
    assert by[("h100", "speculative@auto")]["ran"] == saved["speculative@auto"]["ran"]
    assert by[("h100", "speculative@auto")]["cpu_error"] == saved["speculative@auto"]["cpu_error"]
    assert f"| h100 | {saved['speculative@auto']['ran']} |" in text
    for dev in ("h100", "v5e"):
        assert by[(dev, "vanilla")]["projected_speedup"] == pytest.approx(1.0)
        # the counts are the run's, whatever the shapes
        for m in ("speculative", "ouroboros", "speculative@auto"):
            assert by[(dev, m)]["target_calls"] == res["methods"][m]["target_calls"]


def test_identical_check_catches_a_wrong_method(bench_run):
    res, out = bench_run
    bad = res["methods"]["perturbed"]
    assert bad["identical"] is False
    assert bad["mismatches"] == ["spec_bench/1#turn0", "spec_bench/1#turn1",
                                 "spec_bench/2#turn0"]
    assert "NO (3 differ)" in (out / "results.md").read_text()


def test_cost_model_hand_computed():
    table = cost_model.LatencyTable(target={1: 0.010, 11: 0.020}, draft={28: 0.004})
    # interpolation between measured sizes, exact at measured ones
    assert table.t_target(6) == pytest.approx(0.015)
    assert table.t_target(11) == pytest.approx(0.020)
    # 100 vanilla forwards at 10 ms = 1 s; the method: 25 * 20 ms + 60 * 4 ms = 0.74 s
    assert cost_model.predict_seconds(25, 60, 11, 28, table) == pytest.approx(0.74)
    assert cost_model.predict_speedup(100, 25, 60, 11, 28, table) == pytest.approx(1 / 0.74)
    # JSON round trip (a table measured on another machine)
    again = cost_model.LatencyTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.t_draft(28) == pytest.approx(0.004)
    from_results = cost_model.LatencyTable.from_json({"cost_model": {"latency": table.to_json()}})
    assert from_results.t_target(1) == pytest.approx(0.010)
    # prefill: one per call and model, at the prompt's bucket (10 -> 16, 20 -> 32 tokens)
    assert table.prefill_seconds([10, 20], True) == 0.0  # a table without prefill timings
    table.target_prefill, table.draft_prefill = {16: 0.05, 32: 0.08}, {16: 0.01, 32: 0.02}
    assert table.prefill_seconds([10, 20], False) == pytest.approx(0.13)
    assert table.prefill_seconds([10, 20], True) == pytest.approx(0.16)
    # (0.13 + 1.0) / (0.16 + 0.74)
    assert cost_model.predict_speedup(100, 25, 60, 11, 28, table, vanilla_prefill=0.13,
                                      prefill=0.16) == pytest.approx(1.13 / 0.90)

    from ouroboros_jax.decoding.ouroboros import OuroborosConfig
    from ouroboros_jax.tree import chain_with_branches, jacobi_tree

    cfg = OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2)
    n_t, n_s, n_s1 = cost_model.forward_sizes("ouroboros", cfg)
    assert n_t == chain_with_branches(1 + 4, 2, 3).size == 11
    assert n_s == jacobi_tree(4, 4, 4).size == 24 and n_s1 == 24 + 4  # + the N-slot prefix
    assert cost_model.forward_sizes("ouroboros", dataclasses.replace(cfg, lengthening=False)) \
        == (5, 24, 25)
    # 25 rounds: each has one first draft forward of 28 tokens (4 ms) and the rest of 24
    table.draft[24] = 0.003
    assert cost_model.predict_seconds(25, 60, 11, 24, table, n_draft_first=28) == \
        pytest.approx(25 * 0.020 + 25 * 0.004 + 35 * 0.003)
    # a round's first draft forward timed after a target forward (weights evicted) replaces
    # the warm timing of that size, and survives the JSON round trip
    table.draft_first = {28: 0.006}
    again = cost_model.LatencyTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.t_draft_first(28) == pytest.approx(0.006) and again.t_draft(28) == 0.004
    assert cost_model.predict_seconds(25, 60, 11, 24, again, n_draft_first=28) == \
        pytest.approx(25 * 0.020 + 25 * 0.006 + 35 * 0.003)
    # speculative's draft catches up through its one-token loop: no wider first forward
    from ouroboros_jax.decoding.speculative import SpeculativeConfig

    assert cost_model.forward_sizes("speculative", SpeculativeConfig(gamma=3)) == (4, 1, 1)


def test_auto_row_with_changing_choices_priced_per_choice():
    """A METHOD@auto row whose choice changed between calls (vanilla, then gamma 3): each
    call's counts priced at its own config's forward sizes, summed; acceptance histograms of
    different lengths summed bin by bin."""
    from ouroboros_jax.bench.auto_rows import config_from_recipe
    from ouroboros_jax.bench.records import summed_histograms
    from ouroboros_jax.decoding.speculative import SpeculativeConfig

    spec3 = {"method": "speculative", "config": "SpeculativeConfig(gamma=3)"}
    call = lambda tc, df, auto: {"prompt_tokens": 10, "target_calls": tc,  # noqa: E731
                                 "draft_forwards": df, "auto": auto}
    van = {"method": "vanilla", "kind": "oj", "config": None, "seconds": 1.0, "speedup": 1.0,
           "target_calls": 300, "draft_forwards": 0, "per_call": [call(100, 0, None)] * 3}
    auto = {"method": "speculative", "kind": "oj", "config": {"auto": True}, "seconds": 0.9,
            "speedup": 1.1, "target_calls": 200, "draft_forwards": 300,
            "per_call": [call(100, 0, {"method": "vanilla", "config": None}),
                         call(50, 150, spec3), call(50, 150, spec3)]}
    results = {"methods": {"vanilla": van, "speculative@auto": auto}}
    table = cost_model.LatencyTable(target={1: 0.002, 4: 0.004}, draft={1: 0.001, 2: 0.0015},
                                    target_prefill={16: 0.01}, draft_prefill={16: 0.005})
    rows = {r["method"]: r for r in cost_model.cost_rows(
        results, table, {"vanilla": None, "speculative@auto": "auto"})}
    r = rows["speculative@auto"]
    # vanilla's call: prefill + 100 steps; gamma 3's: prefills of both models, 100 verifications
    # of 4 tokens, 300 one-token draft forwards (the catch-up is one of them)
    expect = (0.01 + 100 * 0.002) + (2 * 0.015 + 100 * 0.004 + 300 * 0.001)
    assert r["predicted_seconds"] == pytest.approx(expect)
    assert r["ran"] == ("speculative@auto (ran vanilla on 1 calls, "
                        "SpeculativeConfig(gamma=3) on 2 calls)")
    assert (r["n_target"], r["n_draft"]) == (4, 1)  # the sizes of most calls
    assert rows["vanilla"]["ran"] == "vanilla"
    assert config_from_recipe("speculative", spec3["config"]) == SpeculativeConfig(gamma=3)
    for bad in ("__import__('os').getcwd()", "LookaheadConfig(window=4)",
                "SpeculativeConfig(gamma=g)"):
        with pytest.raises(ValueError, match="auto recipe"):
            config_from_recipe("speculative", bad)
    assert summed_histograms([[0, 5], [1, 2, 3], [0, 1]]) == [1, 8, 3]


def test_context_mix_hand_computed():
    # prompt 100, 200 new tokens: forwards after 99 .. 298 committed tokens; blocks of 128:
    # 99..128 (30 contexts, 1 live block), 129..256 (128, 2 blocks), 257..298 (42, 3 blocks)
    from experiments.cost_check import context_mix

    mix = context_mix([100], 200, block=128)
    assert [w for _, w in mix] == pytest.approx([30 / 200, 128 / 200, 42 / 200])
    assert [c for c, _ in mix] == [pytest.approx(113.5, abs=0.5), pytest.approx(192.5, abs=0.5),
                                   pytest.approx(277.5, abs=0.5)]
    # two prompts pool their contexts
    assert sum(w for _, w in context_mix([10, 300], 50)) == pytest.approx(1.0)


def test_weights_bound_table_hand_computed():
    wb = cost_model.weights_bound_table(20_000_000, 5_000_000)
    # 100 vanilla forwards vs 25 target calls (tree of 11) and 60 draft forwards (of 28):
    # sizes do not matter, 100 / (25 + 60 * 0.25) = 2.5
    assert cost_model.predict_speedup(100, 25, 60, 11, 28, wb, n_draft_first=30) == \
        pytest.approx(2.5)


def test_spec_bench_reader(tmp_path):
    p = _write_jsonl(tmp_path / "q.jsonl", SPEC_LINES)
    qs = read_spec_bench(p)
    assert [q.task for q in qs] == ["mt-bench", "translation", "translation"]
    assert qs[0].turns == ("Write a sea haiku", "Rhyme")
    assert qs[1].max_new_tokens == 64 and qs[0].max_new_tokens == 128
    assert [q.id for q in read_spec_bench(p, tasks=["translation"])] == ["spec_bench/2",
                                                                         "spec_bench/3"]
    assert read_spec_bench(p, lengths={"translation": 7})[1].max_new_tokens == 7
    assert len(limit_per_task(qs, 1)) == 2

    bad = _write_jsonl(tmp_path / "bad.jsonl", SPEC_LINES, ['{"question_id": 9, "category'])
    with pytest.raises(ValueError, match="line 4"):
        read_spec_bench(bad)
    bad2 = _write_jsonl(tmp_path / "bad2.jsonl",
                        SPEC_LINES[:1] + [{"question_id": 5, "category": "qa", "turns": []}])
    with pytest.raises(ValueError, match="line 2.*turns"):
        read_spec_bench(bad2)
    bad3 = _write_jsonl(tmp_path / "bad3.jsonl", [{"question_id": 5, "turns": ["x"]}])
    with pytest.raises(ValueError, match="line 1.*category"):
        read_spec_bench(bad3)


def test_prompt_jsonl_and_humaneval_readers(tmp_path):
    p = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b", "task": "code"}])
    ps = read_prompt_jsonl(p)
    assert [(x.task, x.max_new_tokens) for x in ps] == [("prompts", 128), ("code", 512)]
    with pytest.raises(ValueError, match="line 2"):
        read_prompt_jsonl(_write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}, {"text": "b"}]))
    he = read_humaneval()
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].max_new_tokens == 512
    assert he[0].turns[0].startswith("from typing import List")
    # trailing whitespace stripped (the raw prompts end in '"""\n'), nothing else touched
    raw = read_humaneval(strip=False)
    assert all(r.turns[0].endswith("\n") for r in raw)
    assert all(h.turns[0] == r.turns[0].rstrip() for h, r in zip(he, raw))
    assert sum(h.turns[0].endswith('"""') for h in he) > 140  # most end at the docstring


def test_tuner_follows_algorithm_1(monkeypatch):
    """gamma first, then W, then N, then K, each by least measured time; recipe evaluates to the
    chosen OuroborosConfig. Timing is faked:
    seconds = (gamma - 0.45 W)^2 + (N - 6)^2 + (K - 3)^2 + 1."""
    from ouroboros_jax.bench import tune
    from ouroboros_jax.decoding.ouroboros import OuroborosConfig

    seen = []

    def fake_run_method(run, target, draft, prompts, repeats=1, eos=-1):
        c = run.config
        seen.append((c.gamma, c.window, c.ngram, c.suffixes))
        s = (c.gamma - 0.45 * c.window) ** 2 + (c.ngram - 6) ** 2 + (c.suffixes - 3) ** 2 + 1
        return {"seconds": s, "tokens_per_second": 100 / s, "eta": 1.0}, []

    monkeypatch.setattr(tune, "run_method", fake_run_method)
    grid = {"gamma": [4, 8, 12], "window": [8, 15, 20], "ngram": [5, 6, 7], "suffixes": [1, 3, 5]}
    res = tune.tune(None, None, [], grid=grid, start={"gamma": 12, "window": 20, "ngram": 5,
                                                      "suffixes": 1}, log=lambda m: None)
    assert [t["knob"] for t in res["trials"]] == ["gamma"] * 3 + ["window"] * 2 + \
        ["ngram"] * 2 + ["suffixes"] * 2  # the current point is not re-measured
    assert seen[:3] == [(4, 20, 5, 1), (8, 20, 5, 1), (12, 20, 5, 1)]
    assert res["config"] == OuroborosConfig(gamma=8, window=20, ngram=6, guesses=20, suffixes=3)
    assert eval(res["recipe"], {"OuroborosConfig": OuroborosConfig}) == res["config"]


def test_tuner_tunes_the_baselines_knobs(monkeypatch):
    """--method speculative tunes gamma alone, --method lookahead W (G = W) then N; the recipe
    evaluates to the chosen config of that method."""
    from ouroboros_jax.bench import tune
    from ouroboros_jax.decoding.lookahead import LookaheadConfig
    from ouroboros_jax.decoding.speculative import SpeculativeConfig

    def fake_run_method(run, target, draft, prompts, repeats=1, eos=-1):
        c = run.config
        s = 1 + (getattr(c, "gamma", 0) - 6) ** 2 + (getattr(c, "window", 0) - 4) ** 2 \
            + (getattr(c, "ngram", 0) - 3) ** 2
        return {"seconds": s, "tokens_per_second": 100 / s, "eta": 1.0}, []

    monkeypatch.setattr(tune, "run_method", fake_run_method)
    grid = {"gamma": [2, 4, 6, 8], "window": [2, 4, 6], "ngram": [3, 4, 5], "suffixes": [1]}
    start = {"gamma": 4, "window": 6, "ngram": 5, "suffixes": 1}
    spec = tune.tune(None, None, [], grid=grid, start=start, method="speculative",
                     log=lambda m: None)
    assert spec["config"] == SpeculativeConfig(gamma=6)
    assert [t["knob"] for t in spec["trials"]] == ["gamma"] * 4
    assert eval(spec["recipe"], {"SpeculativeConfig": SpeculativeConfig}) == spec["config"]
    la = tune.tune(None, None, [], grid=grid, start=start, method="lookahead",
                   log=lambda m: None)
    assert la["config"] == LookaheadConfig(window=4, ngram=3, guesses=4)
    assert eval(la["recipe"], {"LookaheadConfig": LookaheadConfig}) == la["config"]
    with pytest.raises(ValueError, match="method"):
        tune.tune(None, None, [], method="vanilla")


def test_batch_sizes_table_plot_and_exactness(tiny_pair, tmp_path):
    """`bench --batch-sizes`: every method at every batch size, config=auto, tokens checked
    against vanilla's at the same batch, a table and a plot written."""
    from ouroboros_jax.bench.batch import batch_markdown, parse_batch_sizes
    from ouroboros_jax.cli import main

    target, draft, _ = tiny_pair
    spec = _write_jsonl(tmp_path / "question.jsonl", SPEC_LINES)
    out = tmp_path / "out"
    main(["bench", "--quick", "--target", target.path, "--draft", draft.path, "--spec-bench", spec,
          "--prompts-per-task", "1", "--no-progress", "--ignore-eos", "--max-new-tokens", "6",
          "--methods", "vanilla,speculative,lookahead,ouroboros", "--batch-sizes", "2,1",
          "--out", str(out)])
    rows = json.loads((out / "batch.json").read_text())["batch"]
    assert [(r["method"], r["batch"]) for r in rows] == [
        (m, b) for b in (1, 2) for m in ("vanilla", "speculative", "lookahead", "ouroboros")]
    assert all(r["identical"] for r in rows)
    assert all(r["auto"]["asked"] == r["method"] for r in rows if r["method"] != "vanilla")
    assert all(r["speedup"] == 1.0 for r in rows if r["method"] == "vanilla")
    assert (out / "batch_throughput.png").stat().st_size > 1000
    md = (out / "batch.md").read_text()
    assert md == batch_markdown(rows) + "\n" and "batch 1" in md and "batch 2" in md
    assert parse_batch_sizes("8, 1,2,2") == [1, 2, 8]
    for bad in ("0,1", "a,b", ""):
        with pytest.raises(ValueError, match="--batch-sizes"):
            parse_batch_sizes(bad)


def test_cpu_forward_bench_times_every_size_and_both_vanilla_rates(tiny_target, capsys):
    """experiments/cpu_forward on a tokenizer-less tiny model without llama.cpp: every requested
    forward size is timed and reported relative to T = 1, vanilla's whole-call and decode-only
    rates are positive, and llama.cpp is reported as skipped, not compared."""
    from experiments import cpu_forward

    assert cpu_forward.main(["--target", tiny_target.path, "--max-new-tokens", "24",
                             "--reps", "1", "--sizes", "4,2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["forward_vs_T1"]) == {"1", "2", "4"} and res["forward_vs_T1"]["1"] == 1.0
    assert all(res["median"][f"forward_s_T{T}"] > 0 for T in (1, 2, 4))
    assert res["median"]["vanilla_call_s_per_token"] > 0
    assert res["median"]["vanilla_decode_s_per_token"] > 0
    assert res["llama_cpp"] == "not installed or no --gguf"
    assert "vanilla_speed_vs_llama_cpp_call" not in res
    # the tiny model stays stacked by default, and the A/B against stacked is still timed
    assert res["layout"] == "stacked" and len(res["layout_speedup_call_per_rep"]) == 1
    assert set(res["layout_speedup_forward"]) == {"1", "2", "4"}


@pytest.mark.parametrize("argv, message", [(["--sizes", "1,x"], "--sizes"),
                                           (["--sizes", "0"], "--sizes"),
                                           (["--reps", "0"], "--reps")])
def test_cpu_forward_bench_refuses_bad_flags(argv, message):
    from experiments import cpu_forward

    with pytest.raises(SystemExit, match=message):
        cpu_forward.main(["--target", "unused"] + argv)


def test_auto_check_reads_its_noise_pass_by_pass():
    """auto_check's noise columns: auto over the best row per interleaved pass, and over the grid
    row of the config auto ran (matched by its knobs, the grid repr naming every field)."""
    from types import SimpleNamespace

    from experiments.auto_check import noise, per_pass

    def calls(walls):  # 10 tokens per call
        return [(0, SimpleNamespace(stats={"new_tokens": 10}), w) for w in walls]

    assert per_pass(calls([1.0, 1.0, 0.5, 0.5]), 2) == [10.0, 20.0]
    top = {"config": "SpeculativeConfig(gamma=2, confidence=0.0)", "tokens_per_second": 10.0,
           "pass_tokens_per_second": [10.0, 8.0, 12.0]}
    mine = {"config": "SpeculativeConfig(gamma=1, confidence=0.0)", "tokens_per_second": 8.0,
            "pass_tokens_per_second": [8.0, 8.0, 8.0]}
    auto_row = {"config": "auto -> SpeculativeConfig(gamma=1)", "tokens_per_second": 9.0,
                "pass_tokens_per_second": [9.0, 10.0, 6.0]}
    out = noise(auto_row, top, [top, mine])
    assert out["auto_over_best_by_pass"] == {"median": 0.9, "low": 0.5, "high": 1.25}
    assert out["auto_over_same_config"] == pytest.approx(9.0 / 8.0)
    other = dict(auto_row, config="auto -> SpeculativeConfig(gamma=3)")
    assert noise(other, top, [top, mine])["auto_over_same_config"] is None


def test_spec_bound_is_the_rounds_forwards_against_vanilla_steps():
    """spec_bound's arithmetic: eta from the agreement by depth, the decode bound eta * t_step /
    t_round, and the call's bound with both prefills over N new tokens."""
    from experiments.spec_bound import bound_rows
    from ouroboros_jax.decoding.cost import DepthAgreement

    every = DepthAgreement((1.0, 1.0), 1.0)  # every draft token accepted: eta = gamma + 1
    (row,) = bound_rows([3], every, 0.25, {3: 0.5}, 2.0, 1.0, 100)
    assert row["eta"] == pytest.approx(4.0)
    assert row["decode_bound"] == pytest.approx(4 * 0.25 / 0.5)
    assert row["call_bound"] == pytest.approx((2.0 + 100 * 0.25) / (2.0 + 1.0 + 100 / 4 * 0.5))
    half = DepthAgreement((0.5,), 0.5)  # 1 + 0.5 + 0.25
    assert bound_rows([2], half, 1.0, {2: 1.0}, 0.0, 0.0, 10)[0]["decode_bound"] == \
        pytest.approx(1.75)


def test_methods_are_timed_interleaved_and_auto_pays_its_background_compile(tiny_pair,
                                                                              monkeypatch):
    """run_bench: every method's warm-up first, then each prompt by every method in turn (so the
    machine's drift weighs on every row alike); a background compile of config="auto" is waited
    out before a fixed config's call and charged to the auto row."""
    from ouroboros_jax import auto
    from ouroboros_jax.bench import runner
    from ouroboros_jax.bench.workloads import Prompt

    target, draft, _ = tiny_pair
    log = []
    real = runner._oj_caller

    def logged(run, *a):
        call, shape_key = real(run, *a)

        def call_logged(ids, n, pool):
            log.append((run.label, tuple(ids)))
            return call(ids, n, pool)
        return call_logged, shape_key

    waits = []

    def background(timeout=None):  # as if auto's last call had started a 0.2 s compile
        waits.append(1)
        time.sleep(0.2)

    monkeypatch.setattr(runner, "_oj_caller", logged)
    monkeypatch.setattr(auto, "wait_for_background", background)
    prompts = [Prompt("a", "t", ((5, 6, 7),), 6), Prompt("b", "t", ((8, 9, 10, 11),), 6)]
    runs = [runner.MethodRun("vanilla", "vanilla"),
            runner.MethodRun("speculative@auto", "speculative", "auto"),
            runner.MethodRun("speculative", "speculative", oj.SpeculativeConfig(gamma=2))]
    res = runner.run_bench(target, draft, prompts, runs, progress=False, ignore_eos=True)
    a, b = (5, 6, 7), (8, 9, 10, 11)
    labels = [r.label for r in runs]
    # warm-ups: one call per compiled shape (both prompts share one bucket), method by method
    assert log[:3] == [(m, a) for m in labels]
    assert log[3:] == [(m, a) for m in labels] + [(m, b) for m in labels]
    auto_calls = res["methods"]["speculative@auto"]["per_call"]
    fixed_calls = res["methods"]["speculative"]["per_call"]
    # a wait before each fixed call once auto has run, and one at the end: each charged to the
    # auto call before it (prompt a's: before speculative's a and vanilla's b; b's: the rest)
    assert len(waits) == 4
    assert all(c["seconds"] >= 0.4 for c in auto_calls)
    assert all(c["seconds"] < 0.2 for c in fixed_calls)
    assert all(m["identical"] for m in res["methods"].values())


def test_auto_check_median_calls_ignore_one_stalled_call():
    """median_calls: each prompt's calls at their median wall time (a stalled call moves it no
    more than any other), tokens per prompt as its calls made them."""
    from types import SimpleNamespace

    from experiments.auto_check import median_calls

    def c(i, n, w):
        return (i, SimpleNamespace(stats={"new_tokens": n}), w)

    calls = [c(0, 64, 0.30), c(1, 32, 0.20), c(0, 64, 0.32), c(1, 32, 0.22), c(0, 64, 5.0),
             c(1, 32, 0.21)]
    assert median_calls(calls) == pytest.approx((64 + 32) / (0.32 + 0.21))
    # even passes: the mean of the middle two
    assert median_calls(calls[:4]) == pytest.approx(96 / (0.31 + 0.21))
