"""Benchmarks: each prints a table and writes JSON under bench/results/; run
from the repository root as `python -m bench.NAME` (see bench/README.md)."""
from scenarios.harness.results import RESULTS, ROOT, checkout_name, cpu_model, provenance, write_result  # noqa: F401
