"""The flat-latency projection: what a run's counted forwards would cost on an accelerator.

A PROJECTION, never a measurement: nothing here ran on the device it names. The counts are
measured (target forwards, draft forwards, their input sizes, the prompts' lengths); the
latencies are a roofline model of one bf16 forward at batch 1:

    t(T) = max(weight bytes / HBM bandwidth, FLOPs(T) / peak bf16 FLOP/s)
           + KV-cache bytes read / HBM bandwidth + L * LAYER_OVERHEAD_S

weight bytes: every matrix a forward reads (the layers' projections and the LM head; the
embedding lookup reads T rows, left out), 2 bytes each; FLOPs(T): 2 * T * those weights'
parameters + attention's 4 * T * context * H * D per layer; KV reads: 2 * L * context * K * D
values of 2 bytes. Below the ridge point (peak / bandwidth: about 300 tokens on an H100) a
forward of T tokens costs what one token costs: trees and phrases are nearly free, the regime
the paper's eq. 5 assumes and a CPU does not have (there a 16-token forward costs about 2x a
1-token one, README's "Where the CPU path stands").

Two overheads the roofline does not see, stated rather than measured (the device script,
experiments/device/run.sh, measures them the first time a device is at hand; its JSON then replaces
this table through `--latency-json`):
  LAYER_OVERHEAD_S  per layer of every forward: the fixed latency of a layer's ~10 kernels
                    (launch, pipeline fill) that no byte count explains; it is what makes a
                    0.5B draft cost more than its bytes say;
  ROUND_OVERHEAD_S  per round (each target forward): the while_loop's predicate and the
                    round's small ops (sampling, the accept walk, cache commits, pool updates),
                    each a latency-bound kernel of a few microseconds.

The projection prices the counted forwards with the same `cost_model.predict_seconds` that
predicts the CPU run from this CPU's measured latencies, plus the round overhead; the bench
prints that CPU prediction beside every projected row with its error against the measured time
(`cost_model.validate`: within 10% is the bound; experiments/cost_check.py checks it paired in
time).
A METHOD@auto row is priced by the configs auto ran on this CPU, call by call
(bench/auto_rows.py): a projection of what ran here, not of what auto would choose there.

Peak figures (bf16 dense, i.e. without 2:4 sparsity; HBM bandwidth), from the vendors' pages:
  v5e   197 TFLOP/s,   819 GB/s  https://cloud.google.com/tpu/docs/v5e
  v5p   459 TFLOP/s,  2765 GB/s  https://cloud.google.com/tpu/docs/v5p
  a100  312 TFLOP/s,  2039 GB/s  https://www.nvidia.com/en-us/data-center/a100/ (80GB SXM)
  h100  989 TFLOP/s,  3350 GB/s  https://www.nvidia.com/en-us/data-center/h100/ (SXM; the
                                 page lists 1,979 with sparsity)
  h200  989 TFLOP/s,  4800 GB/s  https://www.nvidia.com/en-us/data-center/h200/ (SXM; 1,979
                                 with sparsity)
Achieved bandwidth is typically 80-90% of peak on both; it scales every forward alike, so the
projected speed-ups (ratios) barely move with it. Letters as in the package glossary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..models.config import ModelConfig
from .cost_model import LatencyTable

BF16_BYTES = 2
LAYER_OVERHEAD_S = 4e-6
ROUND_OVERHEAD_S = 30e-6


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One chip's public peak figures.

    Attributes:
        name: the `--project` name.
        tflops: peak dense bf16 TFLOP/s.
        hbm_gbps: HBM bandwidth, GB/s (1e9 bytes).
        source: the vendor page the figures come from.
    """

    name: str
    tflops: float
    hbm_gbps: float
    source: str

    @property
    def ridge_tokens(self) -> float:
        """Tokens per forward at which a bf16 matmul turns compute-bound (FLOPs per weight
        byte: 2 per parameter over 2 bytes)."""
        return self.tflops * 1e12 / (self.hbm_gbps * 1e9)


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("v5e", 197.0, 819.0, "https://cloud.google.com/tpu/docs/v5e"),
    Accelerator("v5p", 459.0, 2765.0, "https://cloud.google.com/tpu/docs/v5p"),
    Accelerator("a100", 312.0, 2039.0, "https://www.nvidia.com/en-us/data-center/a100/"),
    Accelerator("h100", 989.0, 3350.0, "https://www.nvidia.com/en-us/data-center/h100/"),
    Accelerator("h200", 989.0, 4800.0, "https://www.nvidia.com/en-us/data-center/h200/"),
)}


def accelerator(name: str) -> Accelerator:
    """The named accelerator; ValueError naming `--project` otherwise."""
    if not isinstance(name, str) or name.lower() not in ACCELERATORS:
        raise ValueError(f"--project must be one of {', '.join(ACCELERATORS)}, got {name!r}")
    return ACCELERATORS[name.lower()]


def matmul_params(config: ModelConfig) -> int:
    """Parameters of every matrix one forward reads whole: per layer q, k, v, o and the MLP's
    three, plus the LM head (V x E, tied or not)."""
    E, F, H, K, D = (config.hidden_size, config.intermediate_size, config.num_heads,
                     config.num_kv_heads, config.head_dim)
    per_layer = 2 * E * H * D + 2 * E * K * D + 3 * E * F
    return config.num_layers * per_layer + E * config.vocab_size


def forward_cost(config: ModelConfig, tokens: int, context: int) -> dict:
    """Bytes and FLOPs of one bf16 forward of T = tokens at batch 1 after `context` cached
    tokens: {"weight_bytes", "kv_bytes", "flops"}."""
    L, K, D, H = config.num_layers, config.num_kv_heads, config.head_dim, config.num_heads
    w = matmul_params(config)
    return {"weight_bytes": w * BF16_BYTES,
            "kv_bytes": 2 * L * context * K * D * BF16_BYTES,
            "flops": 2 * tokens * w + 4 * L * tokens * (context + tokens) * H * D}


def forward_seconds(acc: Accelerator, config: ModelConfig, tokens: int, context: int,
                    layer_overhead: float = LAYER_OVERHEAD_S) -> float:
    """The roofline t(T) of the module docstring, seconds."""
    c = forward_cost(config, tokens, context)
    bw, peak = acc.hbm_gbps * 1e9, acc.tflops * 1e12
    return (max(c["weight_bytes"] / bw, c["flops"] / peak) + c["kv_bytes"] / bw
            + config.num_layers * layer_overhead)


def projected_table(acc: Accelerator, tconfig: ModelConfig, dconfig: Optional[ModelConfig],
                    target_sizes, draft_sizes, context: int, prefill_sizes=(),
                    layer_overhead: float = LAYER_OVERHEAD_S,
                    round_overhead: float = ROUND_OVERHEAD_S) -> LatencyTable:
    """A `LatencyTable` of roofline times on `acc` at the given input sizes (and prefills of
    the given prompt buckets), labelled as the projection it is."""
    t = lambda cfg, n, ctx: forward_seconds(acc, cfg, int(n), ctx, layer_overhead)  # noqa: E731
    draft = {} if dconfig is None else {int(n): t(dconfig, n, context) for n in draft_sizes}
    return LatencyTable(
        target={int(n): t(tconfig, n, context) for n in set(target_sizes) | {1}},
        draft=draft, context=context,
        target_prefill={int(P): t(tconfig, P, 0) for P in prefill_sizes},
        draft_prefill=({} if dconfig is None else
                       {int(P): t(dconfig, P, 0) for P in prefill_sizes}),
        round_overhead=round_overhead,
        note=f"PROJECTION for {acc.name} ({acc.tflops:g} TFLOP/s bf16, {acc.hbm_gbps:g} GB/s): "
             f"roofline bf16 forwards, {layer_overhead * 1e6:g} us per layer, "
             f"{round_overhead * 1e6:g} us per round; not a measurement")


def projection_rows(results: dict, configs: dict, acc: Accelerator, tconfig: ModelConfig,
                    dconfig: Optional[ModelConfig], context: int) -> tuple[LatencyTable, list]:
    """(the projected table, `cost_model.cost_rows` priced with it): each measured method's
    counted forwards projected onto `acc`, METHOD@auto rows by the configs auto ran on this
    CPU (a projection of what ran here, not of what auto would choose there)."""
    from .cost_model import cost_rows, forward_size_sets, prompt_bucket

    ts, ds, ds1 = forward_size_sets(results, configs)
    van = results["methods"].get("vanilla") or {}
    buckets = {prompt_bucket(c["prompt_tokens"]) for c in van.get("per_call", [])}
    # no first-draft timings on a roofline: a round's first draft forward is priced as any
    table = projected_table(acc, tconfig, dconfig, ts, ds | ds1, context, buckets)
    return table, cost_rows(results, table, configs)


def with_cpu_validation(prows: list, cpu_rows: list) -> list:
    """Projection rows with their CPU validation beside them: each row's CPU-model price of
    the same counted forwards (`cpu_predicted_seconds`), the measured time
    (`cpu_measured_seconds`), the relative error and whether it is within cost_model's
    tolerance (None where the CPU rows lack the row)."""
    cpu = {r["method"]: r for r in cpu_rows}
    out = []
    for r in prows:
        c = cpu.get(r["method"], {})
        out.append({**r, "cpu_predicted_seconds": c.get("predicted_seconds"),
                    "cpu_measured_seconds": c.get("measured_seconds"),
                    "cpu_error": c.get("cpu_error"),
                    "cpu_within_tolerance": c.get("within_tolerance")})
    return out
