"""`python -m bench.groups`: see bench/groups/__init__.py."""
from bench.groups import main

raise SystemExit(main())
