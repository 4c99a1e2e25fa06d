"""The accelerator projection (bench/accelerator.py): the roofline by hand at Llama-3.1-8B on
an H100, the flag refused by name, and the projected table priced by the shared cost model."""

import pytest

from ouroboros_jax.bench import accelerator as acc_mod
from ouroboros_jax.bench.accelerator import (ACCELERATORS, LAYER_OVERHEAD_S, ROUND_OVERHEAD_S,
                                             accelerator, forward_seconds, matmul_params,
                                             projected_table)
from ouroboros_jax.bench.cost_model import LatencyTable, predict_speedup
from ouroboros_jax.models.presets import PRESETS

L8 = PRESETS["llama-3.1-8b"]


def test_peak_figures_are_the_vendors():
    # bf16 dense TFLOP/s and HBM GB/s as the module docstring cites them
    assert {k: (a.tflops, a.hbm_gbps) for k, a in ACCELERATORS.items()} == {
        "v5e": (197.0, 819.0), "v5p": (459.0, 2765.0), "a100": (312.0, 2039.0),
        "h100": (989.0, 3350.0), "h200": (989.0, 4800.0)}
    assert ACCELERATORS["h100"].ridge_tokens == pytest.approx(989e12 / 3350e9)


def test_llama_8b_on_h100_by_hand():
    # per layer: q and o 4096x4096 each, k and v 4096x(8*128) each, MLP 3 x 4096x14336;
    # plus the LM head 4096 x 128256
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    w = 32 * per_layer + 4096 * 128256
    assert matmul_params(L8) == w == 7_504_658_432
    h100 = ACCELERATORS["h100"]
    fixed = 32 * LAYER_OVERHEAD_S
    # one token, empty cache: bandwidth-bound, 15.0 GB at 3.35 TB/s = 4.48 ms
    assert forward_seconds(h100, L8, 1, 0) == pytest.approx(2 * w / 3350e9 + fixed)
    # 16 tokens after 1000 cached: still the weights' time, plus the KV cache's 2 x 32 layers
    # x 1000 slots x 8 heads x 128 x 2 bytes
    kv = 2 * 32 * 1000 * 8 * 128 * 2
    assert forward_seconds(h100, L8, 16, 1000) == pytest.approx(
        (2 * w + kv) / 3350e9 + fixed)
    # 1024 tokens: past the ridge (~295 tokens), compute-bound: 2 flops per weight per token
    # plus attention's 4 * T * (context + T) * H * D per layer
    flops = 2 * 1024 * w + 4 * 32 * 1024 * 1024 * 32 * 128
    assert forward_seconds(h100, L8, 1024, 0) == pytest.approx(flops / 989e12 + fixed)
    # flat up to the ridge: a 64-token tree costs what one token does (the paper's regime)
    assert forward_seconds(h100, L8, 64, 0) == pytest.approx(forward_seconds(h100, L8, 1, 0))


def test_project_flag_refused_by_name():
    with pytest.raises(ValueError, match="--project must be one of v5e, v5p, a100, h100, h200"):
        accelerator("h800")
    assert accelerator("H100") is ACCELERATORS["h100"]


def test_projected_table_prices_counts_with_round_overhead():
    d1 = PRESETS["llama-3.2-1b"]
    h100 = ACCELERATORS["h100"]
    table = projected_table(h100, L8, d1, [5], [1, 2], context=0)
    assert "PROJECTION" in table.note and table.round_overhead == ROUND_OVERHEAD_S
    t1, t5 = table.t_target(1), table.t_target(5)
    s1 = table.t_draft(1)
    assert t5 == pytest.approx(t1) and s1 == pytest.approx(forward_seconds(h100, d1, 1, 0))
    # 100 vanilla steps vs 25 rounds of gamma 4 (100 draft forwards, the first of each round
    # 2 tokens): the same per-round overhead on both sides
    o = ROUND_OVERHEAD_S
    expect = 100 * (t1 + o) / (25 * (t5 + o) + 100 * s1 + 25 * (table.t_draft(2) - s1))
    assert predict_speedup(100, 25, 100, 5, 1, table, n_draft_first=2) == pytest.approx(expect)
    # the table survives JSON (as a --latency-json from the device script would)
    back = LatencyTable.from_json(table.to_json())
    assert back.round_overhead == table.round_overhead and back.t_target(5) == t5


def test_module_docstring_cites_every_device():
    for a in ACCELERATORS.values():
        assert a.source in acc_mod.__doc__
