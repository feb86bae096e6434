"""The bottom layer: what every other package may import (and nothing of
theirs). A user error is a `ConfigError` wherever it is found (flags, config
files, data, tokenizer, checkpoints, topology); `train.py` prints it as one
line and exits 2."""
from common.errors import ConfigError, Problems
from common.notes import forget_notes, job_rank, note
from common.parsing import OneLineParser, parse_int, parse_number, refuse_value
from common.paths import check_writable_dir

__all__ = ["ConfigError", "OneLineParser", "Problems", "check_writable_dir", "forget_notes", "job_rank", "note",
           "parse_int", "parse_number", "refuse_value"]
