"""Benchmarks (speed is claimed here, side by side in one run, never in unit tests)."""
