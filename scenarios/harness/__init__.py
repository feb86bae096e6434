"""The harness the scenarios, the benchmarks and the tests share: rank processes (spawn.py),
jobs of train.py under torchrun or parallel.launch (jobs.py), network namespaces joined by a
slow link (netns.py), results with their provenance (results.py)."""
