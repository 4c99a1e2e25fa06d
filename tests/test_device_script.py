"""The prepared device script (experiments/device/run.sh) runs end to end at tiny shapes
on this CPU, with every network connection refused, and leaves the JSON and plot the device run
will leave: on the device nothing but the shapes changes.

Time: the per-round stage compiles each method's loop at the paper's recipe and at auto's
choice (Ouroboros' recipe alone about 20 s of CPU here), so the suite runs it for vanilla and
speculative (about 45 s of CPU); every method goes through the same `round_times` loop, and
each method's loop is tested on its own elsewhere. The whole script at --tiny, every method,
ran here too (docs/accelerators.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ouroboros_jax.bench.cost_model import LatencyTable
from experiments.device.probe import TINY_SIZES

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("vanilla", "speculative")
SCRIPT = ROOT / "experiments" / "device" / "run.sh"

# imported by every Python started with this directory on its path: any connection fails
NO_NETWORK = """
import socket

def _refused(*args, **kwargs):
    raise OSError("network access refused by the device-script test")

socket.socket.connect = _refused
socket.socket.connect_ex = _refused
socket.create_connection = _refused
"""


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("device")
    guard = d / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NO_NETWORK)
    out = d / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(guard), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(["bash", str(SCRIPT), "--tiny", "--budget-s", "100000", "--methods",
                           ",".join(METHODS), "--quantize", "int8"], env=env,
                          capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "device.json") as f:
        return json.load(f), out, proc.stderr


def test_every_stage_ran_offline(device_run):
    res, out, log = device_run
    failed = {k: v for k, v in res["stages"].items() if v["status"] != "ok"}
    assert not failed, failed
    assert "network access refused" not in log
    assert res["settings"]["tiny"] is True and res["device"]["platform"] == "cpu"
    assert (out / "device.png").stat().st_size > 0


def test_forward_times_for_every_size_and_model(device_run):
    res, _, _ = device_run
    for who in ("target", "draft"):
        t = res["t_of_T"][who]
        assert sorted(int(k) for k in t) == list(TINY_SIZES)
        assert all(v > 0 for v in t.values())
    # the cost model reads the device's table as it reads another machine's
    table = LatencyTable.from_json(res)
    assert table.t_target(1) == res["t_of_T"]["target"]["1"]
    assert table.t_draft(4) == res["t_of_T"]["draft"]["4"]


def test_every_method_at_the_recipe_and_at_auto(device_run):
    res, _, _ = device_run
    got = {(r["method"], r["config"]) for r in res["rounds"]}
    want = {(m, c) for m in METHODS for c in ("paper", "auto")} - {("vanilla", "auto")}
    assert got == want
    n = res["settings"]["new_tokens"]
    for r in res["rounds"]:
        assert r["new_tokens"] == n  # EOS ignored: every call generates the full length
        assert 1 <= r["target_calls"] <= n
        assert r["round_seconds"] == pytest.approx(r["seconds"] / r["target_calls"])
        if r["config"] == "auto":
            assert r["auto"]  # what auto chose, and why
    # vanilla: one target forward per token
    van = next(r for r in res["rounds"] if r["method"] == "vanilla")
    assert van["target_calls"] == n and van["eta"] == 1.0
    b = res["vanilla_bound"]
    assert b["weight_bytes"] > 0 and b["tokens_per_second_measured"] > 0
    # on a CPU no HBM figure applies: no bound is claimed
    assert b["tokens_per_second_bound"] is None


def test_the_demo_pair_on_the_device_is_exact(device_run):
    """The shipped pair by each method in float32 (--tiny's dtype): on this CPU every output
    equals vanilla's, so a row counting otherwise is the script miscounting."""
    res, _, _ = device_run
    rows = res["demo_pair"]
    assert {(r["method"], r["config"]) for r in rows} == (
        {(m, c) for m in METHODS for c in ("paper", "auto")} - {("vanilla", "auto")})
    for r in rows:
        assert r["dtype"] == "float32"
        assert r["identical"] == r["prompts"] == 1 and r["first_difference"] == [-1]
        assert r["tokens_per_second"] > 0 and r["eta"] >= 1.0
    spec = next(r for r in rows if (r["method"], r["config"]) == ("speculative", "paper"))
    assert spec["eta"] > 1.0  # a trained draft: accepted tokens, unlike random weights


def test_each_further_pair_leaves_a_latency_table(device_run):
    res, out, _ = device_run
    (name,) = res["settings"]["pairs"]
    entry = res["pairs"][name]
    table = LatencyTable.from_json(str(out / f"latency-{name}.json"))
    assert table.t_target(4) == entry["target"]["4"] and table.t_draft(1) == entry["draft"]["1"]
    assert "software" in res and res["software"]["backend"] == "cpu"


def test_the_quantized_stage_times_each_format_and_every_method(device_run):
    """The quantized stage (experiments/device/quantized.py) at --tiny with int8: t(T) of the
    int8 target, vanilla's seconds per token in bf16 and int8, every method's round on int8
    weights (exact on this CPU: the same tokens as int8 vanilla), the further pair in int8."""
    res, _, log = device_run
    q = res["quantized"]
    assert q["schemes"] == ["int8"]
    assert sorted(int(k) for k in q["t_of_T"]["int8"]) == list(q["sizes"])
    assert set(q["vanilla_seconds_per_token"]) == {"bfloat16", "int8"}
    assert 0.2 < q["weight_bytes"]["int8"] / q["weight_bytes"]["bfloat16"] < 0.8
    assert all(v > 0 for v in q["vanilla_seconds_per_token"].values())
    rows = q["rounds"]["int8"]
    assert [r["method"] for r in rows] == list(METHODS)
    assert all(r["first_difference"] == -1 and r["round_seconds"] > 0 for r in rows)
    (name,) = res["settings"]["pairs"]
    assert set(q["pairs"][name]["int8"]) == {"target", "draft"}


def test_the_quantized_summary_gives_ratios_to_bf16():
    from experiments.device.quantized import summary_lines

    q = {"vanilla_seconds_per_token": {"bfloat16": 0.010, "int8": 0.006},
         "t_of_T": {"int8": {"1": 0.004, "64": 0.008}},
         "rounds": {"int8": [{"method": "speculative", "round_seconds": 0.02,
                              "seconds_per_token": 0.01, "first_difference": -1}]}}
    text = "\n".join(summary_lines(q))
    assert "int8 6.00 ms (0.60x)" in text and "t(64)/t(1)=2.00" in text
    assert "speculative: 20.00 ms/round" in text
    assert set(q) >= {"vanilla_seconds_per_token", "t_of_T", "rounds"}


def test_the_first_difference():
    from experiments.device.demo_pair import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) == -1
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix departs where it ends


def test_pairs_flag_names_itself():
    from experiments.device.probe import parse_pairs

    assert set(parse_pairs("qwen2.5-coder-1.5b:qwen2.5-coder-0.5b", tiny=False)) == {
        "qwen2.5-coder-1.5b"}
    assert parse_pairs("", tiny=False) == {}
    with pytest.raises(ValueError, match="--pairs: unknown preset nope"):
        parse_pairs("nope:qwen2.5-coder-0.5b", tiny=False)
    with pytest.raises(ValueError, match="--pairs: expected TARGET:DRAFT"):
        parse_pairs("qwen2.5-coder-1.5b", tiny=False)


def test_variants_table_reads_rows_and_errors():
    from experiments.device.variants import VARIANTS, table

    ok = {"layers": "packed", "attention": "dense", "t_of_T": {"m": {"1": 0.002, "16": 0.003}},
          "calls": {"vanilla": {"seconds_per_token": 0.004}}}
    bad = {"layers": "stacked", "attention": "blockwise", "error": "boom"}
    text = table([ok, bad])
    assert "m 2.00/3.00" in text and "vanilla 4.00 ms/tok" in text and "boom" in text
    assert len(set(VARIANTS)) == 4  # every combination of the two switches
