"""The suite: tests/unit/<package>/ (one package's behaviour, in-process or on a few pooled ranks)
and tests/integration/<scenario>/ (train.py, the launch scripts and the jobs as their users run them)."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent   # the repository's root (tests run from anywhere)
