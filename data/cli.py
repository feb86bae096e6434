"""The data tools' entry point: a user error is one line and exit status 2, as in train.py."""
import argparse
import sys

from common import ConfigError


def run(main, argv=None) -> int:
    """Call ``main(argv)``; a ConfigError (DataError, TokenizerError, ...) is printed as
    ``error: ...`` on stderr and gives status 2. Other exceptions keep their traceback."""
    try:
        main(argv)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr, flush=True)
        return 2
    return 0


def at_least(n):
    """An argparse type for integers >= n."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < n:
            raise argparse.ArgumentTypeError(f"must be >= {n}, got {value}")
        return value
    return parse
