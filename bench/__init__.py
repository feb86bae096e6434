"""Benchmarks: each prints a table and writes JSON under bench/results/; run
from the repository root as `python -m bench.NAME` (see bench/README.md)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the repository
RESULTS = ROOT / "bench" / "results"
