"""`python -m bench.report`: see bench/report/__init__.py."""
from bench.report import main

raise SystemExit(main())
