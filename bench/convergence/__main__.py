"""`python -m bench.convergence`: see bench/convergence/__init__.py."""
from bench.convergence import main

raise SystemExit(main())
