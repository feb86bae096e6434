"""`python -m bench.comm`: see bench/comm/__init__.py."""
from bench.comm import main

raise SystemExit(main())
