"""Numbers as users write them in flags, YAML and DeepSpeed JSON."""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

from common.errors import ConfigError


def parse_number(value: Any, where: str) -> float:
    """A finite float from a number or a numeric string; booleans are refused, and so are
    inf, NaN and numbers too large for a float (1e400), which no setting means."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):   # OverflowError: an int beyond a float's range
        raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    return number


def parse_int(value: Any, where: str) -> int:
    """Integers, also written as 5e8, 5E8 or "5e8"."""
    number = parse_number(value, where)
    if number != int(number):
        raise ConfigError(f"{where} must be a whole number, got {value!r}")
    return int(number)


def refuse_value(where: str, value: Any, ok: Any, why: str):
    """One message shape for 'this key accepts one value only'."""
    raise ConfigError(f"{where}={json.dumps(value)} is not supported: {why}; "
                      f"remove the key or set it to {json.dumps(ok)}")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors raise ConfigError (one line, no usage dump), so that a command
    prints `error: ...` and exits 2 as for every other user error."""

    def error(self, message):
        raise ConfigError(message)
