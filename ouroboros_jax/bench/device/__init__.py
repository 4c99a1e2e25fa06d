"""The prepared device script (run.sh, probe.py): what to measure the first time an accelerator
is at hand. See probe.py's docstring and README's "On an accelerator"."""
