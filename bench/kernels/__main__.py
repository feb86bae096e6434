"""`python -m bench.kernels`: see bench/kernels/__init__.py."""
from bench.kernels import main

raise SystemExit(main())
