#!/usr/bin/env bash
# What does the first accelerator at hand measure? Result: docs/bench/device-h200.md.
# The device script: run once on the first accelerator at hand (one H100/H200 or TPU chip),
# about 5-8 minutes, nothing downloaded. Measures t(T) for T = 1..256 at Llama-3.1-8B and
# Llama-3.2-1B shapes (random bf16 weights built on the device), the per-round time of every
# method at the paper's recipe and at config="auto"'s choice, and vanilla tokens/s against
# the HBM-bandwidth bound, and the same 8B shape with int8 and int4 weights (t(T) for T = 1..64,
# vanilla ms/token, every method's round; experiments/device/quantized.py); writes
# $OUT/device.json and $OUT/device.png (probe.py's docstring).
#
#   OUT=/tmp/device experiments/device/run.sh            # on the device
#   OUT=/tmp/device experiments/device/run.sh --tiny     # anywhere: tiny shapes (CI)
#
# Extra flags go to `python -m experiments.device.probe` (--budget-s, --methods, ...).
# Stages past --budget-s (default 400 s here, leaving room for the last stage under 8 minutes)
# are skipped and recorded; the JSON is rewritten after every stage.
set -euo pipefail
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
# the checkout this script lies in, so its package is the one imported
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
exec "${PYTHON:-python}" -m experiments.device.probe --out "$OUT" --budget-s 400 "$@"
