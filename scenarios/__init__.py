"""What the project verifies, apart from what it measures (bench/): the fault matrix and its
cells and modes, the bad-input cases, the DiLoCo and groups jobs, the two-sites set-up. Tests
and benchmarks import it; the product never does. Beneath it, scenarios/harness/: the rank
pool (spawn), job launching (jobs), network namespaces (netns) and result writing (results).
Run one from the repository root, e.g. `python -m scenarios.faults` (see bench/README.md)."""
