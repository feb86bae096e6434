"""The user-error type of the whole product, and the collector that reports every problem
of one input (a command line, a config file) in one error."""
from __future__ import annotations

from contextlib import contextmanager


class ConfigError(ValueError):
    """Something the user gave (a flag, a config key, a file, the job's shape)
    is wrong. The message is one line naming the culprit and the fix."""


class Problems:
    """Every user error found in one input, so that one run names them all:

        problems = Problems()
        with problems.collect():
            check_one(args)           # its ConfigError joins the list; the next check still runs
        problems.add("--x is ...")
        problems.raise_if_any()       # one ConfigError: the problem itself, or "N problems: (1) ...; (2) ..."
    """

    def __init__(self):
        self.messages: list[str] = []

    def add(self, message: str):
        if message not in self.messages:
            self.messages.append(message)

    @contextmanager
    def collect(self):
        try:
            yield
        except ConfigError as e:   # a ConfigError of several problems (raise_if_any's) joins each
            for message in getattr(e, "problems", None) or [str(e)]:
                self.add(message)

    def __bool__(self) -> bool:
        return bool(self.messages)

    def raise_if_any(self):
        if not self.messages:
            return
        listed = "; ".join(f"({i}) {m}" for i, m in enumerate(self.messages, 1))
        error = ConfigError(self.messages[0] if len(self.messages) == 1 else f"{len(self.messages)} problems: {listed}")
        error.problems = list(self.messages)
        raise error
