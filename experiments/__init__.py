"""One-off experiments: scripts that answered one question each about this project's speed or
cost, kept so their results can be re-run. Not part of the installed package; run them from
the repository root, e.g. `python -m experiments.round_cost --help`. Each module's first lines
say what it asked and where its answer is written (README.md here lists them all)."""
