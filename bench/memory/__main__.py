"""`python -m bench.memory`: see bench/memory/__init__.py."""
from bench.memory import main

raise SystemExit(main())
