"""The prepared device script (run.sh, probe.py): what to measure the first time an accelerator
is at hand (docs/bench/device-h200.md, docs/accelerators.md). See probe.py's docstring."""
