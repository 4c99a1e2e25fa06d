"""The quantized-weights plan `ouroboros-jax memory --quantize int8|int4` prints: per-device bytes
of a target and its draft (params and KV caches) with bf16, int8 and int4 weights on 1, 2, 4 and
8 devices (a "model" axis: tensor parallel), and whether that fits devices of 80 GB (H100) and
141 GB (H200). From shapes alone (`sharding.memory_plan`), so a 70B plan runs on a laptop.

What it counts: one copy of the weights as `load_model(quantize=)` keeps them (codes at their
width, float32 scales, the embedding float: `models/quant.py`), the caches in `dtype`. Not
counted: activations, XLA's workspace and a packed copy of the weights (one GPU, `layout.py`),
so a fit within a few GB of the capacity is no fit in practice (the `headroom` column).
"""

from __future__ import annotations

from typing import Optional

from .models.config import ModelConfig
from .sharding import memory_plan

DEVICES = (1, 2, 4, 8)
CAPACITIES_GB = (80, 141)
# the targets and draft planned when the command names none (issue 56's 70B plan)
DEFAULT_TARGETS = ("llama-3.1-70b", "yi-34b")
DEFAULT_DRAFT = "llama-3.2-1b"


def plan_row(target: ModelConfig, draft: Optional[ModelConfig], scheme: Optional[str],
             devices: int, batch: int, cache_len: int, dtype: str = "bfloat16") -> dict:
    """Per-device bytes of target + draft (each params and cache) with `scheme` weights (None:
    float `dtype`) on a 1 x `devices` mesh."""
    parts = {}
    for who, config in (("target", target), ("draft", draft)):
        if config is None:
            continue
        p = memory_plan(config, 1, devices, batch, cache_len, dtype, quantize=scheme)
        parts[who] = (p["params_per_device_bytes"], p["kv_cache_per_device_bytes"])
    total = sum(a + b for a, b in parts.values())
    return {"scheme": scheme or dtype, "devices": devices, "parts": parts,
            "per_device_bytes": total}


def plan(targets: list, draft, schemes: list, batch: int, cache_len: int,
         dtype: str = "bfloat16") -> list:
    """[(target name, draft name, [plan_row for each scheme (float first) and device
    count])]. targets: [(name, config)]; draft: (name, config) or None."""
    out = []
    for name, config in targets:
        rows = [plan_row(config, None if draft is None else draft[1], s, n, batch, cache_len,
                         dtype)
                for s in [None] + [s for s in schemes if s is not None] for n in DEVICES]
        out.append((name, None if draft is None else draft[0], rows))
    return out


def format_plan(planned: list, batch: int, cache_len: int) -> str:
    """The plan as a table: per-device GB and, per device size, the GB left (negative: does
    not fit)."""
    lines = [f"weights plan: batch {batch}, cache {cache_len} tokens per row, 1 x N devices "
             "(tensor parallel); GB = 1e9 bytes; left = capacity - per-device (activations "
             "and workspace not counted)"]
    head = f"{'target + draft':<34}{'weights':>9}{'devices':>8}{'per-dev GB':>12}" + "".join(
        f"{f'left on {c} GB':>16}" for c in CAPACITIES_GB)
    lines.append(head)
    for tname, dname, rows in planned:
        label = tname + (f" + {dname}" if dname else "")
        for r in rows:
            gb = r["per_device_bytes"] / 1e9
            cells = "".join(f"{c - gb:>+12.1f} {'fits' if gb <= c else 'no  '}"
                            for c in CAPACITIES_GB)
            lines.append(f"{label:<34}{r['scheme']:>9}{r['devices']:>8}{gb:>12.1f}{cells}")
    return "\n".join(lines)
