"""`ouroboros-jax bench --serve --quick`: the load bench runs end to end on the tiny random pair
and writes its JSON, markdown table and plot; every method's greedy outputs equal vanilla's."""

import json
import os

from ouroboros_jax.bench.http_load import percentile
from ouroboros_jax.bench.serve import serve_markdown, summarize
from ouroboros_jax.cli import main


def test_percentile_interpolates():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert abs(percentile(list(range(101)), 99) - 99.0) < 1e-12
    assert percentile([], 50) is None


def test_summarize_figures():
    recs = [{"ttft_s": 0.1, "latency_s": 1.0, "tokens": 10},
            {"ttft_s": 0.3, "latency_s": 2.0, "tokens": 30}]
    row = summarize(recs, 4.0, (3, 12))
    assert row["req_per_s"] == 0.5 and row["tok_per_s"] == 10.0
    assert row["pool_hit_rate"] == 0.25
    assert abs(row["ttft_p50_s"] - 0.2) < 1e-12 and row["latency_p99_s"] > 1.98
    assert summarize(recs, 4.0, (0, 0))["pool_hit_rate"] is None


def test_bench_serve_quick(tmp_path):
    out = tmp_path / "serve"
    main(["bench", "--serve", "--quick", "--quick-dir", str(tmp_path / "pair"), "--out", str(out),
          "--serve-requests", "2"])
    res = json.loads((out / "serve.json").read_text())
    names = ["vanilla", "speculative", "ouroboros", "ouroboros-private"]
    assert list(res["methods"]) == names
    assert res["mismatches"] == []  # greedy outputs of every method equal vanilla's
    rates = res["settings"]["rates"]
    assert len(rates) == 1 and rates[0] > 0
    for name in names:
        levels = res["methods"][name]["levels"]
        assert [(r["load"], r["value"]) for r in levels] == \
            [("concurrency", 1), ("concurrency", 2), ("rate", rates[0])]
        for r in levels:
            assert r["req_per_s"] > 0 and r["tok_per_s"] > 0 and r["completion_tokens"] > 0
            assert r["ttft_p50_s"] <= r["latency_p50_s"]
            assert r["latency_p50_s"] <= r["latency_p95_s"] <= r["latency_p99_s"]
    for r in res["methods"]["ouroboros"]["levels"]:
        # on the --quick random pair auto turns speculation off (plain decoding, no pool)
        assert r["pool_hit_rate"] is None or 0.0 <= r["pool_hit_rate"] <= 1.0
    md = (out / "serve.md").read_text()
    assert md.strip() == serve_markdown(res).strip()
    assert sum(line.startswith("| ouroboros-private |") for line in md.splitlines()) == 3
    assert os.path.getsize(out / "serve.png") > 1000
