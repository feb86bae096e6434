"""`python -m bench.slow_link`: see bench/slow_link/__init__.py."""
from bench.slow_link import main

raise SystemExit(main())
